"""The parameters form: in JupyterLab, pick a params file or edit the main parameters, see the arithmetic.

A notebook shows it in the cell after its parameters cell:

    parameter_form(globals(), names, main=..., check=..., derived=...)   # any notebook
    train_form(globals())                                                # train_sft.ipynb

`check` turns the form's values into the notebook's parameter object (raising
ValueError naming the culprit); `derived` turns that object into the lines of
arithmetic shown under the form, recomputed on every keystroke. **Apply**
writes the values into the notebook's namespace, where the cells below read
them; re-running the parameters cell brings the defaults back.

Under papermill, nbval or any other headless run the form is not built and
the cell shows nothing (frontend_attached says how that is told).
"""
from __future__ import annotations

import ast
import html
from pathlib import Path
from typing import Any, Callable, Sequence

import ipywidgets as widgets

from cflib.bench.components import components
from cflib.bench.throughput import BATCHES, ThroughputParams
from cflib.bench.tune import TuneParams
from cflib.bench.validate import ValidateParams, resolve_grid
from cflib.lab.compare import CompareParams
from cflib.lab.sweep import SweepParams, expand_sweep
from cflib.paths import project_root, resolve_path
from cflib.progress import frontend_attached
from cflib.train.params import ParamError, TrainParams, load_params_file
from cflib.train.run import batch_arithmetic, describe_arithmetic

NOTEBOOK_VALUES = "(this notebook's values)"
# The parameters a person changes between runs of train_sft.ipynb; a params file sets the rest.
MAIN_TRAIN_PARAMETERS = ("model", "init_checkpoint", "data", "out_dir", "seq_len", "micro_batch_per_rank",
                         "global_batch", "epochs", "max_steps", "lr", "optimizer", "bf16", "grad_ckpt",
                         "nproc_per_node", "device")


def parameter_form(namespace: dict[str, Any], names: Sequence[str], *, main: Sequence[str] | None = None,
                   check: Callable[[dict[str, Any]], Any] = dict, derived: Callable[[Any], str] | None = None,
                   params_dir: str | Path = "params") -> "ParameterForm | None":
    """The form for a notebook whose parameters are `names` in `namespace`, or None when no person is looking."""
    if not frontend_attached():
        return None
    return ParameterForm(namespace, names, main=main, check=check, derived=derived, params_dir=params_dir)


def train_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """train_sft.ipynb's form: TrainParams checks the values; batch, schedule and memory arithmetic below."""
    return parameter_form(namespace, TrainParams.names(), main=MAIN_TRAIN_PARAMETERS,
                          check=lambda values: TrainParams.from_dict(values, source="form"),
                          derived=lambda params: describe_arithmetic(batch_arithmetic(params), params))


def validate_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """validate_kernels.ipynb's form: the comparisons the chosen dtypes and shapes make on this machine."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def derived(params: ValidateParams) -> str:
        dtypes, shapes = resolve_grid(params.dtypes, params.shapes, device)
        count = len(components())
        return (f"{count * len(dtypes) * len(shapes)} comparisons on {device.type}: "
                f"{count} components x {', '.join(dtypes)} x {', '.join(s.name for s in shapes)}")
    return parameter_form(namespace, ValidateParams.names(),
                          check=lambda values: ValidateParams.from_dict(values, "form"),
                          derived=derived, params_dir="params")


def tune_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """tune_microbatch.ipynb's form: TuneParams checks the values; the usable budget below."""

    def derived(params: TuneParams) -> str:
        budget = (f"usable {params.budget_gib * (1 - params.headroom):.2f} GiB of a {params.budget_gib:g} GiB budget"
                  if params.budget_gib is not None else "budget: the CUDA device's memory")
        return (f"{budget}; at most {params.max_probes} probes of {params.probe_steps} measured steps, microbatch "
                f"1..{params.max_micro_batch}; global batch {params.global_batch} over {params.world_size} rank(s)")
    return parameter_form(namespace, TuneParams.names(), check=lambda values: TuneParams.from_dict(values, "form"),
                          derived=derived, main=["model", "seq_len", "budget_gib", "headroom", "global_batch",
                                                 "world_size", "bf16", "use_custom_kernels", "grad_ckpt",
                                                 "exhaustive_sweep"])


def throughput_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """measure_throughput.ipynb's form: ThroughputParams checks the values; the runs it will time below."""

    def derived(params: ThroughputParams) -> str:
        parts = []
        for kind in params.batches:
            paths = [name for name in params.paths if name in BATCHES[kind]]
            micros = params.micro_batches if kind == "random_rows" else (params.compare_micro_batch,)
            parts.append(f"{kind}: {len(paths) * len(micros)} measurements ({len(paths)} paths x "
                         f"micro-batch{'es' if len(micros) > 1 else ''} {', '.join(map(str, micros))})")
        rounds = f", {params.repetitions} rounds of them" if params.repetitions > 1 else ""
        return (f"{'; '.join(parts)}{rounds}; each {params.warmup_steps} warm-up + {params.timed_steps} timed steps "
                f"of {params.seq_len}-token rows or windows; ratios at micro-batch {params.compare_micro_batch}")
    return parameter_form(namespace, ThroughputParams.names(),
                          check=lambda values: ThroughputParams.from_dict(values, "form"), derived=derived,
                          main=["model", "seq_len", "micro_batches", "compare_micro_batch", "paths", "batches",
                                "shard", "timed_steps", "bf16", "compile_backend", "device"])


def sweep_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """sweep.ipynb's form: SweepParams checks the values; every point and what this sweep does with it below."""
    return parameter_form(namespace, SweepParams.names(), check=lambda values: SweepParams.from_dict(values, "form"),
                          derived=lambda params: expand_sweep(params).describe())


def compare_form(namespace: dict[str, Any]) -> "ParameterForm | None":
    """compare_runs.ipynb's form: CompareParams checks the values."""
    return parameter_form(namespace, CompareParams.names(),
                          check=lambda values: CompareParams.from_dict(values, "form"),
                          derived=lambda params: f"comparing {', '.join(params.runs)} on {params.metric}")


def show_value(value: Any) -> str:
    """A parameter value as typed into the form: strings bare, everything else as Python writes it."""
    return value if isinstance(value, str) else repr(value)


def read_value(text: str) -> Any:
    """What a person typed: a Python literal (3, 1e-3, None, True, 'a b') or else the text itself."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def _shown_path(path: Path) -> str:
    return path.relative_to(project_root()).as_posix() if path.is_relative_to(project_root()) else str(path)


class ParameterForm(widgets.VBox):
    """A params-file picker, one field per main parameter, the derived arithmetic and an Apply button."""

    def __init__(self, namespace: dict[str, Any], names: Sequence[str], *, main: Sequence[str] | None = None,
                 check: Callable[[dict[str, Any]], Any] = dict, derived: Callable[[Any], str] | None = None,
                 params_dir: str | Path = "params") -> None:
        missing = [name for name in names if name not in namespace]
        if missing:
            raise NameError(f"parameter_form: {', '.join(missing)} not defined (run the parameters cell first)")
        self.namespace, self.check, self.derived = namespace, check, derived
        self.started_with = {name: namespace[name] for name in names}
        self.file_values: dict[str, Any] = {}
        self.file_error: str | None = None  # a picked file that cannot be used: nothing applies until another is
        files = [(_shown_path(path), str(path)) for path in sorted(resolve_path(params_dir).glob("*.yaml"))]
        # "" stands for no file: a Dropdown's None means nothing selected, and shows a blank box.
        self.picker = widgets.Dropdown(options=[(NOTEBOOK_VALUES, ""), *files], value="", description="params file",
                                       style={"description_width": "150px"}, layout=widgets.Layout(width="50%"))
        self.fields = {name: self._field(name, self.started_with[name]) for name in (main or names)}
        self.arithmetic = widgets.HTML()
        self.status = widgets.HTML()
        self.apply_button = widgets.Button(description="Apply", button_style="primary",
                                           tooltip="set these values for the cells below")
        self.picker.observe(self._pick_file, names="value")
        for field in self.fields.values():
            field.observe(self._update, names="value")
        self.apply_button.on_click(self.apply)
        fields = list(self.fields.values())
        super().__init__([self.picker, widgets.GridBox(fields, layout=widgets.Layout(
            grid_template_columns="repeat(2, minmax(320px, 1fr))")), self.arithmetic,
            widgets.HBox([self.apply_button, self.status])])
        self.add_class("cflib-parameter-form")
        self._loading = False
        self._update()

    @staticmethod
    def _field(name: str, value: Any) -> widgets.ValueWidget:
        style, layout = {"description_width": "150px"}, widgets.Layout(width="95%")
        if isinstance(value, bool):
            return widgets.Checkbox(value=value, description=name, indent=True, style=style, layout=layout)
        return widgets.Text(value=show_value(value), description=name, continuous_update=True, style=style,
                            layout=layout)

    def values(self) -> dict[str, Any]:
        """Every parameter: the fields, over the chosen file, over the values the notebook had."""
        values = {**self.started_with, **self.file_values}
        for name, field in self.fields.items():
            values[name] = field.value if isinstance(field, widgets.Checkbox) else read_value(field.value)
        return values

    def _pick_file(self, change: dict | None = None) -> None:
        self.file_values, self.file_error = {}, None
        if self.picker.value:
            try:
                values = load_params_file(self.picker.value)
                unknown = sorted(set(values) - set(self.started_with))
                if unknown:
                    raise ParamError(f"{self.picker.label}: {', '.join(unknown)} not parameters of this notebook")
            except ValueError as err:
                self.file_error = str(err)
                self._show_error(self.file_error)
                return
            self.file_values = values
        self._loading = True  # one recomputation for the whole file, not one per field
        try:
            for name, field in self.fields.items():
                value = self.file_values.get(name, self.started_with[name])
                field.value = value if isinstance(field, widgets.Checkbox) else show_value(value)
        finally:
            self._loading = False
        self._update()

    def _update(self, change: dict | None = None) -> Any:
        """Check the values and redraw the arithmetic; the checked parameters, or None when they fail."""
        if self._loading:
            return None
        if self.file_error:
            self._show_error(self.file_error)
            return None
        try:
            checked = self.check(self.values())
            text = self.derived(checked) if self.derived else ""
        except (ValueError, OSError) as err:
            self._show_error(str(err))
            return None
        self.arithmetic.value = f"<pre class='cflib-arithmetic'>{html.escape(text)}</pre>"
        self.status.value = ""
        self.apply_button.disabled = False
        return checked

    def _show_error(self, message: str) -> None:
        self.arithmetic.value = (f"<pre class='cflib-form-error' style='color: var(--jp-error-color1, #d32f2f)'>"
                                 f"{html.escape(message)}</pre>")
        self.apply_button.disabled = True

    def apply(self, button: widgets.Button | None = None) -> None:
        """Set the checked values in the notebook's namespace; the cells below then run with them."""
        if self._update() is None:
            return
        values = self.values()
        changed = [name for name, value in values.items() if self.namespace.get(name) != value]
        self.namespace.update(values)
        source = f"from {self.picker.label}, " if self.picker.value else ""
        summary = ", ".join(f"{name}={show_value(values[name])}" for name in changed) or "no change"
        self.status.value = (f"<span class='cflib-form-applied'>Applied {source}{html.escape(summary)}. "
                             "Now run the cells below (Run &#9656; Run Selected Cell and All Below).</span>")
