"""A grid of train_sft runs: the sweep's parameters, its points, and what a re-run does with each.

`expand_sweep(SweepParams)` expands `grid` (the full product) or `points`
over `repeats` seeds, checks every point with TrainParams and the batch
arithmetic before any of them runs, and reads what `out_dir` already holds:
a finished point (its run COMPLETE and its executed notebook run to its last
cell) is skipped, one whose run completed but whose notebook was stopped has
its cells after training run again, a killed one resumes from its latest
resumable checkpoint (train_sft's `resume: latest`), a failed one stays failed
unless `rerun_failed`. A point that fails its checks is failed from the start;
the others still run. A sweep's points are never dropped: a plan that no
longer makes a point sweep.json holds is refused (adding points is not).
An `init_checkpoint: hub:ORG/NAME[@REVISION]` is resolved to its commit once
for the whole sweep, as it is planned, and every point is given that commit
(hub:ORG/NAME@COMMIT), so a branch that moves while the sweep runs moves no
point; sweep.json records it (`hub_starts`) and a re-run of the sweep keeps it.
`cflib.lab.sweep_run.run_sweep` then runs the points, one
papermill run of train_sft.ipynb per point, and the sweep ends with
`cflib.lab.compare` over its points.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from cflib.atomic import copy_beside, write_json_atomic
from cflib.errors import ParamError, shown
from cflib.export.push import names_hub_commit
from cflib.export.pull import hub_parts, is_hub, pinned_spec, resolve_start
from cflib.jobs import job_out_dir, refuse_links
from cflib.jsonio import MAX_BYTES, read_bounded, read_json
from cflib.lab.compare import SWEEP_FILE, CompareParams, Comparison, compare
from cflib.locks import FileLock, check_free
from cflib.model.checkpoint import CheckpointError, latest_resumable
from cflib.paths import resolve_path
from cflib.schema import Params, is_none_word, parsed_by, reject_unknown
from cflib.train.params import TrainParams, load_params_file
from cflib.train.run import RUN_FILES, batch_arithmetic
from cflib.yamlio import load_yaml, read_yaml

# The sweep owns where each point runs and how it continues.
OWNED_BY_SWEEP = ("out_dir", "resume")
LOCK_FILE = "sweep.lock"
POINT_FILE = "point.yaml"  # the parameters papermill gives the point's train_sft.ipynb (-f)
POINT_LOG, POINT_NOTEBOOK = "papermill.log", "train_sft.ipynb"  # what the sweep writes beside the point's run
COMPARISON_DIR = "comparison"  # the sweep's comparison of its points (cflib.lab.compare)
# What a point whose run completed while its notebook was stopped does: the notebook's cells after training.
FINISH = "finish"
# A sweep's points, seeds included: each is a training run, and the plan checks every one before the first runs.
MAX_POINTS = 10_000


def _mapping_or_file(name: str, value: Any) -> Any:
    """A grid or points value: as given, or read from the YAML file (or inline YAML text) a string names."""
    if not isinstance(value, (str, Path)):
        return value
    path = resolve_path(value)
    if path.is_file():
        return read_yaml(path, ParamError, f"{name} file")
    try:
        parsed = load_yaml(str(value), name, ParamError)
    except ParamError:
        parsed = None
    if isinstance(parsed, (dict, list)):
        return parsed
    raise ParamError(f"{name}: {shown(value)} is neither a YAML file ({path} does not exist) nor a YAML mapping")


def _grid(name: str, value: Any) -> dict | None:
    if value is None or is_none_word(value):
        return None
    grid = _mapping_or_file(name, value)
    if not isinstance(grid, dict) or not grid:
        raise ParamError(f"grid must map parameter names to lists of values, got {shown(grid)}")
    return grid


def _points(name: str, value: Any) -> tuple[dict, ...] | None:
    if value is None or is_none_word(value):
        return None
    points = _mapping_or_file(name, value)
    if not isinstance(points, (list, tuple)) or not points or not all(isinstance(p, dict) for p in points):
        raise ParamError(f"points must be a list of mappings of parameter: value, got {shown(points)}")
    return tuple(points)


def _repeats(name: str, repeats: Any) -> int | tuple[int, ...]:
    if isinstance(repeats, str) and len(repeats) <= 20 * MAX_POINTS:
        items = [item.strip() for item in repeats.strip().strip("[]()").split(",")]
        if all(item.isdigit() and len(item) <= 20 for item in items):
            repeats = [int(item) for item in items] if len(items) > 1 else int(items[0])
    if isinstance(repeats, int) and not isinstance(repeats, bool):
        if not 1 <= repeats <= MAX_POINTS:
            raise ParamError(f"repeats must be a number of seeds in [1, {MAX_POINTS:,}] (or a list of seeds), got "
                             f"{shown(repeats)}")
        return repeats
    if isinstance(repeats, (list, tuple)) and 0 < len(repeats) <= MAX_POINTS and all(
            isinstance(s, int) and not isinstance(s, bool) for s in repeats):
        if len(set(repeats)) != len(repeats):
            raise ParamError(f"repeats repeats a seed: {shown(list(repeats))}")
        return tuple(repeats)
    raise ParamError(f"repeats must be a number of seeds or a list of at most {MAX_POINTS:,} seeds, got "
                     f"{shown(repeats)}")


def _gpus(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("cpu", "none", "")):
        return None
    if isinstance(value, str):
        try:
            value = [int(item) for item in value.strip().strip("[]()").split(",")]
        except ValueError:
            raise ParamError(f"gpus must be 'cpu' or a list of device indices, got {shown(value)}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ParamError(f"gpus must be 'cpu' or a list of device indices, got {shown(value)}")
    if len(set(value)) != len(value):
        raise ParamError(f"gpus names a device twice: {list(value)}")
    return tuple(value)


@dataclass(frozen=True)
class SweepParams(Params):
    """sweep.ipynb's parameters."""

    base: str | None = "params/sweep_smoke.yaml"  # a train_sft params file every point starts from; None: defaults
    # parameter -> list of values, the full product; or a YAML file holding that mapping
    grid: dict | None = parsed_by(_grid)
    # instead of grid: a list of override mappings (or a YAML file of one)
    points: tuple[dict, ...] | None = parsed_by(_points)
    # seeds per point: n runs base seed, +1, ... +n-1; or a list of seeds
    repeats: tuple[int, ...] | int = parsed_by(_repeats, 1)
    # device indices, one point per GPU at a time; None ("cpu"): one at a time
    gpus: tuple[int, ...] | None = parsed_by(_gpus)
    out_dir: str | None = None  # None: a new outputs/sweeps/<time>/; an existing sweep folder continues
    rerun_failed: bool = False  # run failed points again (a finished point is never re-run)
    metric: str = "final_eval_loss"  # what the comparison plots each swept parameter against

    @cached_property
    def base_values(self) -> dict[str, Any]:
        """The base params file's values; {} for train_sft's defaults."""
        return load_params_file(resolve_path(self.base)) if self.base is not None else {}

    @property
    def seeds(self) -> tuple[int, ...]:
        """Each point's seeds: `repeats` of them counted from the base's seed, or the list `repeats` gives."""
        if isinstance(self.repeats, int):
            return tuple(int(self.base_values.get("seed", 0)) + i for i in range(self.repeats))
        return self.repeats

    def validate(self) -> None:
        reject_unknown(self.base_values, TrainParams.names(), f"base {self.base}")
        if self.grid is not None and self.points is not None:
            raise ParamError("give grid (every combination) or points (a list of overrides), not both")
        if self.grid is not None:
            _check_overrides(self.grid, "grid")
            for name, options in self.grid.items():
                if not isinstance(options, list) or not options:
                    raise ParamError(f"grid: {name} must be a non-empty list of values, got {shown(options)}")
        for index, point in enumerate(self.points or ()):
            _check_overrides(point, f"points[{index}]")
        swept = set(self.grid or {}) | {name for point in self.points or () for name in point}
        combinations = math.prod(len(options) for options in self.grid.values()) if self.grid is not None else (
            len(self.points) if self.points is not None else 1)  # counted, not listed
        seeds = self.repeats if isinstance(self.repeats, int) else len(self.repeats)
        if combinations * seeds > MAX_POINTS:
            raise ParamError(f"the sweep has {combinations:,} point(s) x {seeds:,} seed(s) = {combinations * seeds:,} "
                             f"runs, more than {MAX_POINTS:,}; sweep fewer values")
        if "seed" in swept and len(self.seeds) > 1:
            raise ParamError("seed is swept and repeats gives several seeds: choose one of them")
        CompareParams.from_dict({"metric": self.metric})


def _check_overrides(overrides: dict, where: str) -> None:
    reject_unknown(overrides, TrainParams.names(), where)
    owned = [name for name in overrides if name in OWNED_BY_SWEEP]
    if owned:
        raise ParamError(f"{where}: {owned[0]} is set by the sweep (each point runs in its own folder of the "
                         "sweep's out_dir and resumes from it); remove it")


def _short(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (bool, int, str)) or value is None:
        text = str(value)
    else:
        text = hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).rstrip("-")[:40] or "x"


def point_name(overrides: dict, seed: int | None) -> str:
    """The point's folder name: its overrides, then its seed when the sweep repeats points."""
    parts = [f"{name}-{_short(value)}" for name, value in overrides.items()]
    return "_".join(parts + ([f"seed-{seed}"] if seed is not None else [])) or "base"


@dataclass
class Point:
    name: str
    overrides: dict  # what differs from the base (the seed included when the sweep repeats)
    params: dict  # what papermill gives train_sft.ipynb: base, overrides, seed, out_dir
    run_dir: Path
    status: str = "queued"  # queued | running | done | failed
    action: str = "run"  # what this sweep does with it: run, resume, finish, skip (finished before), or why it failed
    error: str | None = None
    total_steps: int | None = None
    attempts: list = field(default_factory=list)

    def state(self, sweep_dir: Path) -> dict:
        return {"name": self.name, "overrides": self.overrides, "run_dir": self.run_dir.relative_to(sweep_dir).as_posix(),
                "status": self.status, "action": self.action, "error": self.error, "total_steps": self.total_steps,
                "attempts": self.attempts}


@dataclass
class Sweep:
    params: SweepParams
    out_dir: Path
    points: list[Point]
    swept: list[str]
    planned_on: str | None = None  # sweep.json's digest when planned: run_sweep runs the plan only on that state
    # hub:ORG/NAME[@REVISION] as a point names it -> HubStart.record(): the commit every point naming it starts from,
    # resolved once for the sweep; None: a sweep.json written before cflib pinned them, whose points resolve their own
    hub_starts: dict[str, dict] | None = field(default_factory=dict)

    def save(self) -> None:
        """sweep.json: the points and every point's state, replaced whole at every change."""
        p = self.params
        write_json_atomic(self.out_dir / SWEEP_FILE, {
            "base": p.base, "grid": p.grid, "points_given": list(p.points) if p.points else None,
            "repeats": list(p.seeds), "gpus": list(p.gpus) if p.gpus else "cpu", "swept": self.swept,
            "metric": p.metric, **({"hub_starts": self.hub_starts} if self.hub_starts is not None else {}),
            "points": [point.state(self.out_dir) for point in self.points]})
        self.planned_on = sweep_file_digest(self.out_dir)  # this sweep's own state, which it goes on from

    def points_table(self) -> str:
        """The points and what each overrides (deterministic for given parameters)."""
        width = max(len(point.name) for point in self.points)
        return "\n".join(f"{point.name:<{width}}  " + ", ".join(f"{k}={v}" for k, v in point.overrides.items())
                         for point in self.points)

    def describe(self) -> str:
        device = "cpu, one point at a time" if self.params.gpus is None else (
            f"GPUs {', '.join(map(str, self.params.gpus))}, one point per GPU at a time")
        lines = [f"out_dir  {self.out_dir}", f"base     {self.params.base or '(train_sft defaults)'}",
                 f"points   {len(self.points)} ({' x '.join(self.swept) or 'the base alone'}"
                 + (f", seeds {', '.join(map(str, self.params.seeds))}" if len(self.params.seeds) > 1 else "")
                 + f"), on {device}"]
        lines += [f"hub      {spec} pinned to commit {start['commit']} for every point naming it"
                  for spec, start in (self.hub_starts or {}).items()
                  if spec != pinned_spec(start)]
        for point in self.points:
            what = point.action + (f": {point.error}" if point.status == "failed" else "")
            lines.append(f"  {point.name}: {what}")
        return "\n".join(lines)

    def compare(self) -> Comparison:
        """The finished points side by side (cflib.lab.compare), written beside them in out_dir/comparison."""
        return compare(CompareParams(runs=(str(self.out_dir),), metric=self.params.metric,
                                     out_dir=str(self.out_dir / COMPARISON_DIR)))


def _expand(params: SweepParams, base: dict) -> list[tuple[dict, int | None]]:
    if params.grid is not None:
        names = list(params.grid)
        combos = [dict(zip(names, values)) for values in itertools.product(*(params.grid[n] for n in names))]
    else:
        combos = [dict(point) for point in params.points] if params.points else [{}]
    repeated = len(params.seeds) > 1
    return [(combo, seed if repeated else None) for combo in combos for seed in params.seeds]


def _varying(combos: list[dict]) -> list[str]:
    """The parameters whose value differs between points (a one-value grid entry sets, but does not name)."""
    names = list(dict.fromkeys(name for combo in combos for name in combo))
    return [name for name in names if len({json.dumps(c.get(name), sort_keys=True, default=str) for c in combos}) > 1]


def sweep_lock(out_dir: Path) -> FileLock:
    """One process sweeps a folder at a time (cflib.locks): taken before the first write, gone with the process."""
    return FileLock(out_dir / LOCK_FILE, error=ParamError, remove=True, refusal=lambda holder: ParamError(
        f"out_dir {out_dir} is being swept by another process ({holder}): wait for it, or stop it first"))


def sweep_file_digest(out_dir: Path) -> str | None:
    """What sweep.json held when the sweep was planned (None: none yet): the plan is run only on that state."""
    path = out_dir / SWEEP_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    # Read as _recorded_plan reads it (bounded, a regular file only): a file past the bound is never read whole,
    # and a FIFO in its place is refused by name rather than waited on or taken for no file.
    return hashlib.sha256(read_bounded(path, MAX_BYTES, ParamError, "sweep file")).hexdigest()


def expand_sweep(params: SweepParams) -> Sweep:
    """Every point checked and its action chosen from what out_dir holds; nothing runs, nothing is written."""
    base = params.base_values
    # A sweep continues in its own folder (sweep.json), so only a file in its place is refused here.
    out_dir = job_out_dir(params.out_dir or None, "sweeps", (), "a sweep")
    lock = sweep_lock(out_dir)
    check_free(lock.path, lock.refusal, ParamError)
    # One look at the folder. A sweep starting at this moment takes its lock, then writes sweep.json (through a
    # staging copy beside it), and only then anything else: those files alone are no one's output (its lock, not
    # this check, refuses the second sweep when it starts), and whatever else one listing shows, sweep.json was
    # already there.
    names = {path.name for path in out_dir.iterdir()} if out_dir.is_dir() else set()
    previous, digest, hub_starts = {}, None, {}
    if SWEEP_FILE in names:
        digest = sweep_file_digest(out_dir)
        plan = _recorded_plan(out_dir / SWEEP_FILE)
        previous = {p["name"]: p for p in plan["points"]}
        hub_starts = _recorded_hub_starts(plan, out_dir / SWEEP_FILE)
    elif any(name != LOCK_FILE and copy_beside(name) != SWEEP_FILE for name in names):
        raise ParamError(f"out_dir {out_dir} holds files but no {SWEEP_FILE}: choose an empty or new folder")
    refuse_links(out_dir, ("runs", COMPARISON_DIR))
    points: list[Point] = []
    expanded = _expand(params, base)
    varying = _varying([overrides for overrides, _ in expanded])
    names = _point_names(expanded, varying)
    _refuse_dropped(out_dir, previous, names)
    pins = None if hub_starts is None else HubPins(hub_starts)
    for (overrides, seed), name in zip(expanded, names):
        shown = {**overrides, **({"seed": seed} if seed is not None else {})}
        run_dir = out_dir / "runs" / name
        refuse_links(run_dir.parent, (name,))  # the sweep writes in a point's folder, papermill and the run too
        refuse_links(run_dir, (POINT_FILE, POINT_LOG, POINT_NOTEBOOK))
        values = {**base, **overrides, **({"seed": seed} if seed is not None else {}), "out_dir": str(run_dir)}
        points.append(_judge(Point(name, shown, values, run_dir), previous.get(name), params, pins))
    swept = list(varying)
    if len(params.seeds) > 1:
        swept.append("seed")
    return Sweep(params, out_dir, points, swept, digest, None if pins is None else pins.starts)


class HubPins:
    """A sweep's hub: init_checkpoints, each resolved to its commit once (recorded ones as sweep.json has them)."""

    def __init__(self, starts: dict[str, dict]) -> None:
        self.starts = dict(starts)
        self.refused: dict[str, Exception] = {}  # a name the Hub refused: each point naming it fails alike, unasked

    def pinned(self, values: dict) -> dict:
        """`values` with a hub: init_checkpoint pinned to the sweep's commit for it; CheckpointError (a name the Hub
        lacks, no network) fails the point's checks."""
        spec = values.get("init_checkpoint")
        if not is_hub(spec):
            return values
        if spec in self.refused:
            raise self.refused[spec]
        if spec not in self.starts:
            try:
                self.starts[spec] = resolve_start(spec).record()
            except CheckpointError as err:
                self.refused[spec] = err
                raise
        start = self.starts[spec]
        return {**values, "init_checkpoint": pinned_spec(start)}


def _point_names(expanded: list[tuple[dict, int | None]], varying: list[str]) -> list[str]:
    """Each point's folder name; a name made twice gets -2, -3, ..."""
    seen: dict[str, int] = {}
    names = []
    for overrides, seed in expanded:
        name = point_name({k: v for k, v in overrides.items() if k in varying}, seed)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return names


def _refuse_dropped(out_dir: Path, previous: dict[str, dict], names: list[str]) -> None:
    """ParamError when sweep.json holds points this plan no longer makes (the grid or points were edited): going
    on would drop them, their attempts and their runs from the sweep. A plan that only adds points goes on."""
    dropped = [name for name in previous if name not in set(names)]
    if dropped:
        raise ParamError(f"out_dir {out_dir}: its {SWEEP_FILE} holds point(s) {', '.join(dropped[:5])}"
                         + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
                         + " that this grid (or points list) no longer makes: a sweep's points are never dropped. "
                         "Run the changed sweep in a new out_dir, or give the grid that made them (adding values "
                         "keeps every earlier point)")


def notebook_finished(executed: Path) -> bool:
    """Whether papermill ran the executed notebook to its last cell: it writes `end_time` into the notebook's
    metadata only then (with `exception` set where a cell failed). A kill leaves it null, whatever the run did."""
    try:
        notebook = read_json(executed, ParamError, "executed notebook") if executed.is_file() else None
    except ParamError:
        return False
    run = ((notebook or {}).get("metadata") or {}).get("papermill") if isinstance(notebook, dict) else None
    return isinstance(run, dict) and bool(run.get("end_time")) and not run.get("exception")


def _close_attempts(attempts: list, run_dir: Path) -> list:
    """Earlier attempts left open (their sweep was killed, every process at once): closed as interrupted, ending
    when the run last wrote metrics.jsonl, so sweep.json holds every attempt's time."""
    metrics = run_dir / "metrics.jsonl"
    last_write = datetime.fromtimestamp(metrics.stat().st_mtime, timezone.utc) if metrics.is_file() else None
    closed = []
    for attempt in attempts:
        if isinstance(attempt, dict) and "finished_utc" not in attempt and "started_utc" in attempt:
            try:
                started = datetime.fromisoformat(attempt["started_utc"])
            except (TypeError, ValueError):
                started = None
            end = last_write if last_write is not None and started is not None and last_write >= started else started
            attempt = {**attempt, "interrupted": True,
                       **({"finished_utc": end.isoformat(timespec="seconds"),
                           "seconds": round((end - started).total_seconds(), 1)} if end is not None else {})}
        closed.append(attempt)
    return closed


def _recorded_plan(path: Path) -> dict:
    """A sweep.json, checked for its points, each with its name."""
    plan = read_json(path, ParamError, "sweep file")
    if not isinstance(plan, dict) or not isinstance(plan.get("points"), list) or not all(
            isinstance(point, dict) and isinstance(point.get("name"), str) for point in plan["points"]):
        raise ParamError(f"{path}: not a sweep's file (a 'points' list, each with its 'name')")
    return plan


def _recorded_hub_starts(plan: dict, path: Path) -> dict[str, dict] | None:
    """The commits a sweep.json pinned its hub: init_checkpoints to, checked; None for a sweep.json written before
    cflib recorded them (its points, whose point.yaml name the unpinned name, resolve their own as they did)."""
    if "hub_starts" not in plan:
        return None
    starts = plan["hub_starts"]
    if not isinstance(starts, dict):
        raise ParamError(f"{path}: hub_starts must map each hub: init_checkpoint to the commit the sweep pinned, got "
                         f"{shown(starts)}")
    for spec, start in starts.items():
        try:
            repo_id = hub_parts(spec)[0] if is_hub(spec) else None
        except CheckpointError:
            repo_id = None
        if not (repo_id is not None and names_hub_commit(start, repo_id)):
            raise ParamError(f"{path}: hub_starts[{shown(spec)}] must name the repository {repo_id or 'ORG/NAME'} "
                             f"and a commit in full (40 hex digits), got {shown(start)}; choose another out_dir "
                             "rather than edit a sweep's file")
    return starts


def _judge(point: Point, before: dict | None, params: SweepParams, pins: HubPins | None = None) -> Point:
    """The point's checks (its hub: init_checkpoint pinned to the sweep's commit first), then what this sweep does
    with it given what its folder holds."""
    try:
        if pins is not None:
            point.params = pins.pinned(point.params)
        checked = TrainParams.from_dict(point.params, source=f"point {point.name}")
        if params.gpus is not None and checked.world_size > 1:
            raise ParamError(f"point {point.name}: nproc_per_node x nnodes is {checked.world_size}, but a sweep "
                             "gives each point one GPU")
        point.total_steps = batch_arithmetic(checked)["total_steps"]
    except (ValueError, OSError) as err:
        message = str(err) if str(err).startswith(f"point {point.name}") else f"point {point.name}: {err}"
        point.status, point.action, point.error = "failed", "failed its checks", message
        return point
    recorded = point.run_dir / POINT_FILE
    if recorded.is_file() and _without_resume(load_params_file(recorded)) != _without_resume(_as_yaml(point.params)):
        raise ParamError(f"point {point.name} in {point.run_dir.parent.parent} ran with other parameters "
                         f"({recorded}); choose another out_dir for a changed sweep")
    point.attempts = _close_attempts(list(before.get("attempts", [])) if before else [], point.run_dir)
    if before and before.get("status") == "failed" and not params.rerun_failed:
        point.status, point.action, point.error = "failed", "failed before (rerun_failed: true runs it again)", \
            before.get("error")
        return point
    if (point.run_dir / "COMPLETE").is_file() and not (before and before.get("status") == "failed"):
        if notebook_finished(point.run_dir / POINT_NOTEBOOK):
            point.status, point.action = "done", "skip: finished before"
        else:  # killed between the run's end and the notebook's: the bundle, curves and lm-eval are missing
            stopped = "stopped before its last cells" if (point.run_dir / POINT_NOTEBOOK).is_file() else "is missing"
            point.action = (f"{FINISH}: its run trained to the end (COMPLETE) but its {POINT_NOTEBOOK} {stopped}; "
                            "the cells after training run again, nothing is trained again")
            point.params = _without_resume(point.params)
        return point
    started = [name for name in RUN_FILES if (point.run_dir / name).exists()]
    if started and before and before.get("status") == "failed":
        point.action = "run again: the failed run's folder is set aside"
    elif started:
        try:
            checkpoint = latest_resumable(point.run_dir / "checkpoints")
            point.action = f"resume from {checkpoint.name}"
            point.params = {**point.params, "resume": "latest"}
        except CheckpointError:
            point.action = "run again: killed before a resumable checkpoint (save_every_steps makes them)"
    return point


def _without_resume(values: dict) -> dict:
    return {name: value for name, value in values.items() if name != "resume"}


def _as_yaml(values: dict) -> dict:
    """Values as they read back from point.yaml (tuples become lists)."""
    return yaml.safe_load(yaml.safe_dump(values))
