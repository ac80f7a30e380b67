"""The losses, metrics and attention backends a notebook registered, carried to torchrun's workers by where they
are defined.

`register_loss`, `register_metric` and `register_backend` fill dictionaries of the process that calls them (a
notebook's kernel, say); torchrun's workers are fresh processes, with cflib's built-in losses and backends alone.
So the launcher hands them, beside their parameters, the import path (`module:qualified.name`) of each registered
loss, metric and attention backend the run uses, and each worker imports and registers them under the same names
before it reads its parameters: the user's own modules run there, and nothing else. An instance or a closure has no
name of its own: it is carried by the name its module binds it to (`module:name`, a module-level
`factory = Factory()`), and a `regex_metric` by its pattern. A backend is a `Backend` record, an instance of
cflib's class: it is carried by the module-level name a module binds it to (those defining its kernels and its
check are looked in first, then every module imported). An object that importing its module and following its name
does not give back (defined in a notebook cell, whose module is `__main__`; a closure or instance no module binds;
redefined since it was registered) cannot be carried: the launcher refuses the run before any worker starts,
naming it.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

from cflib.errors import ParamError
from cflib.ops.attention import BACKENDS, BUILT_IN_BACKENDS, Backend, register_backend
from cflib.ops.sft_loss import BUILT_IN_LOSSES, LOSSES, register_loss
from cflib.train.best_metric import ANSWER_METRICS, RegexMetric, register_metric
from cflib.train.params import TrainParams

REGISTERED_FILE = "registered.json"  # in the launcher's folder, beside the workers' params.json
WHERE = ("define it in a module the worker processes can import (a .py file in the notebook's folder, or on "
         "PYTHONPATH) and register it from there")
UNNAMED = ("has no name of its own that the {workers} worker processes can import it by: register a class or "
           "function defined at module level, or bind the object to a name at module level, in a module they can "
           "import (a .py file in the notebook's folder, or on PYTHONPATH)")
REGEX_METRIC = "cflib.train.best_metric:regex_metric"  # called with the pattern carried beside it
BACKEND_WHERE = ("define it in a module they can import (a .py file in the notebook's folder, or on PYTHONPATH), "
                 "bound to a name at module level there (`my_backend = Backend(...)`), and register it from there")


def defined_at(obj: Any) -> str:
    """`module:qualified.name` as the object names itself (an instance: its class's), or the name its module binds
    it to where it has none that leads back to it; a regex_metric, `regex_metric(pattern)`. What the record says,
    importable or not."""
    if type(obj) is RegexMetric:
        return f"{REGEX_METRIC}({obj.pattern!r})"
    module = getattr(obj, "__module__", None) or "?"
    path = f"{module}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    if _names_itself(obj) or module == "__main__":
        return path
    names = getattr(sys.modules.get(module), "__dict__", {})
    bound = next((name for name, value in names.items() if value is obj), None)
    return f"{module}:{bound}" if bound is not None else path


def resolve(path: str) -> Any:
    """The object at `module:qualified.name`, its module imported (ImportError or AttributeError where not)."""
    module, _, name = path.partition(":")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def import_path(obj: Any) -> str | None:
    """obj's `module:qualified.name` (or `module:name` it is bound to) where importing that gives obj back, else
    None. Never `__main__`: a worker's `__main__` is cflib.train's, not the notebook's."""
    path = defined_at(obj)
    if path.startswith(("__main__:", "?:")) or "<locals>" in path or type(obj) is RegexMetric:
        return None
    try:
        return path if resolve(path) is obj else None
    except Exception:  # a module not imported yet runs the user's code, which may raise anything: not importable
        return None


def _names_itself(obj: Any) -> bool:
    """A class or function defined at module level: its qualified name, not an instance's or a closure's."""
    qualname = getattr(obj, "__qualname__", None)
    return isinstance(qualname, str) and "<locals>" not in qualname and "<lambda>" not in qualname


def _backend_bindings(backend: Backend) -> list[str]:
    """`module:name` of each module-level name bound to `backend`: in the modules that define its kernels and its
    check first, then in every other module imported (`__main__`, a notebook's cells, included; `builtins` never,
    where an interactive prompt keeps its last value)."""
    kernels = [kernel for kernel in (backend.dense, backend.packed) if kernel is not None]
    callables = [backend.problem, *(kernel.run for kernel in kernels), *(kernel.mask for kernel in kernels)]
    own = list(dict.fromkeys(getattr(f, "__module__", None) for f in callables if f is not None))
    modules = [name for name in own if isinstance(name, str)] + [name for name in list(sys.modules) if name not in own]
    main = sys.modules.get("__main__")
    found = []
    for module in modules:
        try:  # sys.modules may hold objects of any kind, whose attributes run code of their own
            names = vars(sys.modules[module]) if module != "builtins" and module in sys.modules else None
        except Exception:  # noqa: BLE001  (what cannot be read binds nothing a worker could import)
            continue
        # multiprocessing files a notebook's `__main__` again as `__mp_main__`: a worker's __main__ is its own
        where = "__main__" if main is not None and sys.modules.get(module) is main else module
        if isinstance(names, dict):
            found += [f"{where}:{name}" for name, value in list(names.items()) if value is backend]
    return list(dict.fromkeys(found))


def backend_defined_at(backend: Backend) -> str:
    """Where a registered backend is defined, as the record says it: the module-level name bound to it, importable
    or not (a notebook cell's, `__main__:NAME`), or that none is."""
    bindings = _backend_bindings(backend)
    importable = [path for path in bindings if not path.startswith("__main__:")]
    return (importable or bindings or [f"Backend {backend.name!r}, bound to no module-level name"])[0]


def backend_import_path(backend: Backend) -> str | None:
    """A `module:name` whose import gives the backend back in a worker, or None (bound in `__main__` alone, or
    nowhere)."""
    for path in _backend_bindings(backend):
        if path.startswith("__main__:"):
            continue
        try:
            if resolve(path) is backend:
                return path
        except Exception:  # noqa: BLE001  (a module that fails to import is not importable)
            continue
    return None


def registered_backends(params: TrainParams) -> dict[str, Backend]:
    """The registered (not built-in) backends a run may attend with: the one attention_backend names, or under
    auto every one auto tries (for training's rows or for held-out evaluation's dense ones), in registry order."""
    requested = params.attention_backend
    return {name: backend for name, backend in BACKENDS.items() if BUILT_IN_BACKENDS.get(name) is not backend
            and (name == requested or (requested == "auto" and backend.auto_for))}


def _cannot_carry(obj: Any, workers: int) -> tuple[str, str]:
    """What obj is, and why the workers cannot import it with the way out."""
    path = defined_at(obj)
    if _names_itself(obj) or path.startswith("__main__:"):
        return path, f"cannot be imported by that name in the {workers} worker processes; {WHERE}"
    what = f"an instance of {path}" if getattr(obj, "__qualname__", None) is None else f"the closure {path}"
    return what, UNNAMED.format(workers=workers)


def for_workers(params: TrainParams) -> dict:
    """What the workers import and register before they read their parameters: {"losses": {name: path},
    "metrics": {name: {"path": path, "greater_is_better": bool}}, "left_out": [name], "attention_backends":
    {name: path}}, left_out the registered metrics the run does not name (its evaluations score every registered
    one) that cannot be carried. ParamError naming the loss, the metric best_metric names, or the registered
    attention backend the run may attend with (registered_backends), that cannot be."""
    losses: dict[str, str] = {}
    build = LOSSES.get(params.loss_type)
    if build is not None and build is not BUILT_IN_LOSSES.get(params.loss_type):
        path = import_path(build)
        if path is None:
            what, why = _cannot_carry(build, params.world_size)
            raise ParamError(f"loss_type {params.loss_type!r}: its loss {what} {why}")
        losses[params.loss_type] = path
    backends: dict[str, str] = {}
    for name, backend in registered_backends(params).items():
        path = backend_import_path(backend)
        if path is None:
            bound = next(iter(_backend_bindings(backend)), None)  # __main__'s alone: a notebook cell's
            why = (f"is defined as {bound}, a name the {params.world_size} worker processes cannot import it by"
                   if bound else f"is bound to no module-level name the {params.world_size} worker processes could "
                   "import it by")
            if name == params.attention_backend:
                raise ParamError(f"attention_backend {name!r}: the registered backend {why}; {BACKEND_WHERE}")
            raise ParamError(f"attention_backend 'auto' tries the registered backend {name!r}, which {why}; "
                             f"{BACKEND_WHERE}, or name a built-in attention_backend")
        backends[name] = path
    metrics: dict[str, dict] = {}
    left_out: list[str] = []
    named = params.best_metric.split("/")[0]
    for name, metric in ANSWER_METRICS.items():
        path = import_path(metric.score)
        if type(metric.score) is RegexMetric:
            metrics[name] = {"path": REGEX_METRIC, "pattern": metric.score.pattern,
                             "greater_is_better": metric.greater_is_better}
        elif path is not None:
            metrics[name] = {"path": path, "greater_is_better": metric.greater_is_better}
        elif name == named:
            what, why = _cannot_carry(metric.score, params.world_size)
            raise ParamError(f"best_metric {params.best_metric!r}: the metric {name!r}, {what}, {why}")
        elif params.exact_match_limit != 0:  # scored in a run on one process: said to be left out here
            left_out.append(name)
    return {"losses": losses, "metrics": metrics, "left_out": left_out, "attention_backends": backends}


def register_carried(carried: dict) -> None:
    """In a worker, before its parameters are read: what the launcher carried (for_workers), imported and
    registered. ParamError naming the one this process cannot import (another PYTHONPATH than the notebook's)."""
    for name, path in carried.get("attention_backends", {}).items():  # in the launcher's order, which auto follows
        backend = _imported(path, f"attention_backend {name!r}")
        if not isinstance(backend, Backend) or backend.name != name:
            found = f"the backend {backend.name!r}" if isinstance(backend, Backend) else "no Backend"
            raise ParamError(f"attention_backend {name!r}: {path} is {found} in this worker; {BACKEND_WHERE}")
        register_backend(backend)
    for name, path in carried.get("losses", {}).items():
        register_loss(name, _imported(path, f"loss_type {name!r}"))
    for name, metric in carried.get("metrics", {}).items():
        score = _imported(metric["path"], f"metric {name!r}")
        register_metric(name, score(metric["pattern"]) if "pattern" in metric else score, metric["greater_is_better"])


def describe_carried(carried: dict) -> str | None:
    """A line of the run's description: what the workers import, and the registered metrics they leave out."""
    parts = [f"loss_type {name} ({path})" for name, path in carried["losses"].items()]
    parts += [f"attention_backend {name} ({path})" for name, path in carried.get("attention_backends", {}).items()]
    parts += [f"metric {name} ({metric['path']}" + (f"({metric['pattern']!r}))" if "pattern" in metric else ")")
              for name, metric in carried["metrics"].items()]
    said = [f"import {', '.join(parts)}"] if parts else []
    if carried["left_out"]:
        said.append(f"leave out metric {', '.join(carried['left_out'])} (not importable by name: define it, or bind "
                    "it to a name, at module level of a module on PYTHONPATH to have it scored)")
    return f"workers      {'; '.join(said)}" if said else None


def _imported(path: str, what: str) -> Any:
    try:
        return resolve(path)
    except Exception as err:  # the user's module may raise anything on import: named, with the way out
        raise ParamError(f"{what}: this worker cannot import {path} ({type(err).__name__}: {err}); {WHERE}") from err


def describe_registered(params: TrainParams) -> dict:
    """The record's `registered`: where the run's registered loss, the registered metrics and the registered
    attention backends it may attend with are defined."""
    build = LOSSES[params.loss_type]
    loss = {} if build is BUILT_IN_LOSSES.get(params.loss_type) else {params.loss_type: defined_at(build)}
    return {"loss_type": loss, "metrics": {name: defined_at(metric.score) for name, metric in ANSWER_METRICS.items()},
            "attention_backends": {name: backend_defined_at(backend)
                                   for name, backend in registered_backends(params).items()}}
