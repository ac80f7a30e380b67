"""Runs side by side: the parameters that differ, what each reached, their curves, a sweep's trends.

`compare(CompareParams)` reads run folders (named, globbed, or a sweep's
points) from their records; `comparison_table`, `plot_curves`,
`plot_exact_match` and `plot_sweep` show them, `save_comparison` writes
comparison.json, comparison.csv and the figures. A run whose record is not
complete (killed, failed, still running) is refused by name unless
`include_incomplete`, when what its metrics.jsonl holds is shown instead.
A curriculum's folder reads as one run: its stages' metrics joined in order.
Runs whose records name different held-out sets (another eval shard, a
mixture's other sources, other examples left out by `overlong_examples:
drop`) are said to be so: their eval losses average over different examples.
`out_dir` is new, empty, or holds only an earlier comparison (its
comparison.json), whose files are replaced; anything else there is refused.
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import EngFormatter

from cflib.atomic import atomic_file, copy_beside, save_figure, write_json_atomic
from cflib.errors import ParamError
from cflib.jobs import new_out_dir, refuse_links
from cflib.jsonio import read_json
from cflib.paths import resolve_path
from cflib.progress import tqdm
from cflib.schema import Params, parsed_by
from cflib.train.params import TrainParams
from cflib.train.records import read_metrics
from cflib.yamlio import load_yaml

SWEEP_FILE = "sweep.json"  # a sweep folder's points and the state of each (cflib.lab.sweep)
METRICS = ("final_eval_loss", "best_eval_loss", "exact_match/overall", "best_value", "tokens_per_s", "peak_memory_gib",
           "wall_s")
# A mixture's held-out figures per source (cflib.train.held_out): `source_loss/<name>`, `source_exact_match/<name>`.
SOURCE_METRICS = ("source_loss/", "source_exact_match/")
SCORES = ("exact_match/", "lm_eval/", *SOURCE_METRICS)  # the per-task and per-source columns
# Parameters that name where a run lives, not what it trained.
_NOT_COMPARED = ("out_dir", "resume")
MANIFEST = "comparison.json"  # marks a folder as a comparison's own: a later comparison may replace its files
FIGURES = ("loss_curves.png", "exact_match.png", "sweep.png")
COMPARISON_FILES = (MANIFEST, "comparison.csv", *FIGURES)
CURRICULUM_FILE = "curriculum.json"  # a curriculum's folder (cflib.train.curriculum_run): its stages are runs


def run_list(name: str, value: Any) -> tuple[str, ...]:
    """Run folders, globs or sweep folders: one, or a list of them (a YAML list in a string, as `-p runs "[a, b]"`
    gives it)."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = load_yaml(value, name, ParamError)
    runs = (value,) if isinstance(value, (str, Path)) else tuple(value) if isinstance(value, (list, tuple)) else None
    if not runs or not all(isinstance(item, (str, Path)) and str(item).strip() for item in runs):
        raise ParamError(f"{name} must name run folders, globs or a sweep folder, got {value!r}")
    return tuple(str(item) for item in runs)


@dataclass(frozen=True)
class CompareParams(Params):
    """compare_runs.ipynb's parameters."""

    runs: tuple[str, ...] = parsed_by(run_list, ("outputs/records/sweep_lr_seeds_cpu",))  # folders, globs, sweeps
    include_incomplete: bool = False  # show killed or failed runs from their metrics instead of refusing them
    metric: str = "final_eval_loss"  # what a sweep's parameters are plotted against: one of METRICS
    out_dir: str | None = None  # None: a new outputs/comparisons/<time>/; else empty, new, or an earlier comparison's

    def validate(self) -> None:
        if self.metric not in METRICS and not self.metric.startswith(SCORES):
            raise ParamError(f"metric {self.metric!r} is not compared; choose from {', '.join(METRICS)}, "
                             "exact_match/<task>, lm_eval/<task>/<metric>, or a mixture's source_loss/<source> or "
                             "source_exact_match/<source>")


@dataclass
class RunView:
    """One run as the comparison sees it: its parameters, its record when complete, its metrics rows."""

    name: str
    path: Path
    params: dict
    record: dict | None
    metrics: list[dict]
    problem: str | None = None  # why the record is incomplete; None: complete
    sweep_point: bool = False  # named through a sweep folder: a point of the sweep plot
    stages: list[str] = field(default_factory=list)  # a curriculum's stages, in the order they ran

    @property
    def complete(self) -> bool:
        return self.problem is None


@dataclass
class Comparison:
    runs: list[RunView]
    differing: list[str]  # parameters whose values differ between the runs
    rows: list[dict]  # one per run: the table, comparison.csv
    metric: str
    swept: list[str] = field(default_factory=list)  # a sweep's swept parameters (sweep.json)
    skipped: list[str] = field(default_factory=list)  # a sweep's points left out, and why
    out_dir: Path | None = None

    @property
    def held_out(self) -> dict[str, dict]:
        """Each run's held-out set as its record names it (held_out_set), for the runs whose record does."""
        return {run.name: held for run in self.runs if (held := held_out_set(run)) is not None}

    @property
    def held_out_differs(self) -> bool:
        sets = list(self.held_out.values())
        return any(not _same_held_out(sets[0], other) for other in sets[1:])

    def describe(self) -> str:
        lines = [f"{len(self.runs)} run(s): " + ", ".join(run.name for run in self.runs),
                 "parameters that differ: " + (", ".join(self.differing) or "none")]
        if self.held_out_differs:
            lines.append("held-out sets differ: each run's eval loss averages over other examples, so the losses "
                         "do not compare as they stand: " + "; ".join(
                             f"{name} {describe_held_out(held)}" for name, held in self.held_out.items()))
        if self.swept:
            lines.append(f"swept: {', '.join(self.swept)}, against {self.metric}")
        lines += [f"not compared: {line}" for line in self.skipped]
        lines += [f"incomplete: {run.name} ({run.problem}): shown from its metrics.jsonl"
                  for run in self.runs if not run.complete]
        lines += [f"curriculum: {run.name}, stages {' then '.join(run.stages)}, their metrics joined"
                  for run in self.runs if run.stages]
        if self.swept and self.off_sweep_plot:
            lines.append("not in the sweep plot: " + ", ".join(self.off_sweep_plot))
        return "\n".join(lines)

    @property
    def off_sweep_plot(self) -> list[str]:
        """The runs the sweep plot leaves out, and why: only a sweep's complete points are its points."""
        return [f"{run.name} ({'not a point of the sweep' if not run.sweep_point else 'incomplete'})"
                for run in self.runs if not (run.sweep_point and run.complete)]


def _is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("record.json", "params.json", CURRICULUM_FILE))


def _sweep_points(folder: Path) -> tuple[list[Path], list[str], list[str]]:
    """A sweep folder's finished points (and any other with a run folder), its swept parameters, the rest."""
    plan = read_json(folder / SWEEP_FILE, ParamError, "sweep file")
    if not isinstance(plan, dict) or not isinstance(plan.get("points"), list) or not all(
            isinstance(point, dict) and isinstance(point.get("run_dir"), str) for point in plan["points"]):
        raise ParamError(f"{folder / SWEEP_FILE}: not a sweep's file (a 'points' list, each with its 'run_dir')")
    found, skipped = [], []
    for point in plan["points"]:
        run_dir = folder / point["run_dir"]
        if point.get("status") == "failed":
            error = (str(point.get("error") or "").strip().splitlines() or ["no reason recorded"])[0]
            skipped.append(f"{point['name']} (failed: {error})")  # whole: a reason cut mid-phrase misleads
        elif _is_run_folder(run_dir):
            found.append(run_dir)
        else:
            skipped.append(f"{point['name']} ({point.get('status', 'queued')}, no run yet)")
    return found, list(plan.get("swept", [])), skipped


def resolve_runs(runs: Sequence[str]) -> tuple[list[Path], list[str], list[str], set[Path]]:
    """Run folders in the order named (a glob's sorted), a sweep's swept parameters, a sweep's points left out,
    and which of the folders are a sweep's points."""
    found: list[Path] = []
    swept: list[str] = []
    skipped: list[str] = []
    points_of_sweeps: set[Path] = set()
    for item in runs:
        path = resolve_path(item)
        if (path / SWEEP_FILE).is_file():
            points, names, left_out = _sweep_points(path)
            found += points
            points_of_sweeps |= {point.resolve() for point in points}
            swept += [name for name in names if name not in swept]
            skipped += left_out
        elif glob.has_magic(str(item)):
            matches = [Path(p) for p in sorted(glob.glob(str(path))) if _is_run_folder(Path(p))]
            if not matches:
                raise ParamError(f"runs: {item!r} matches no run folder (one holding record.json or params.json)")
            found += matches
        elif _is_run_folder(path):
            found.append(path)
        else:
            raise ParamError(f"runs: {item} is neither a run folder (record.json or params.json) nor a sweep folder "
                             f"({SWEEP_FILE})" + ("" if path.exists() else ": it does not exist"))
    unique = list(dict.fromkeys(path.resolve() for path in found))
    if not unique:
        raise ParamError(f"runs: {', '.join(runs)} hold no run to compare yet" + (
            f" ({'; '.join(skipped)})" if skipped else ""))
    return unique, swept, skipped, points_of_sweeps


def _incomplete(path: Path, record: dict | None, metrics_file: str = "metrics.jsonl") -> str | None:
    if not (path / "COMPLETE").is_file():
        return "no COMPLETE marker: killed, failed or still running"
    if record is None:
        return "no record.json"
    for key in ("eval", "throughput", "kernel_path", "timing", "params"):
        if key not in record:
            return f"record.json has no {key!r}"
    if not (path / metrics_file).is_file():
        return f"no {metrics_file}"
    return None


def _metrics(path: Path) -> list[dict]:
    try:
        return read_metrics(path) if path.is_file() else []
    except ValueError as err:
        raise ParamError(f"runs: {err}") from None


def load_run(path: Path, name: str) -> RunView:
    if (path / CURRICULUM_FILE).is_file():
        return load_curriculum(path, name)
    record = _document(path / "record.json", "run record") if (path / "record.json").is_file() else None
    metrics = _metrics(path / "metrics.jsonl")
    params = record["params"] if record and "params" in record else (
        _document(path / "params.json", "run's parameters") if (path / "params.json").is_file() else {})
    return RunView(name, path, with_defaults(params), record, metrics, _incomplete(path, record))


def _stage_names(path: Path, record: dict | None) -> list[str]:
    """A curriculum's stages in the order they ran: as its record links them, else as curriculum.json plans them."""
    linked = ((record or {}).get("curriculum") or {}).get("stages")
    planned = _document(path / CURRICULUM_FILE, "curriculum file").get("stages")
    stages = linked if isinstance(linked, list) and linked else planned
    if not isinstance(stages, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in stages):
        raise ParamError(f"{path / CURRICULUM_FILE}: a curriculum's file lists its 'stages', each with its 'name'")
    return [stage["name"] for stage in stages]


def load_curriculum(path: Path, name: str) -> RunView:
    """A curriculum as one run: its record (the last stage's, with `curriculum`), and every stage's metrics.jsonl
    joined in the order the stages ran, each stage's steps counted on from where the stage before ended."""
    record = _document(path / "record.json", "run record") if (path / "record.json").is_file() else None
    stages = _stage_names(path, record)
    joined: list[dict] = []
    offset = 0
    for stage in stages:
        rows = _metrics(path / "stages" / stage / "metrics.jsonl")
        joined += [{**row, "step": row["step"] + offset, "stage": stage} for row in rows if "step" in row]
        offset += max((row["step"] for row in rows if row.get("event") == "train"), default=0)
    first = path / "stages" / stages[0] / "params.json" if stages else None
    started = _document(first, "run's parameters") if first is not None and first.is_file() else {}
    curriculum = _document(path / CURRICULUM_FILE, "curriculum file").get("curriculum")
    params = with_defaults({**started, "curriculum": curriculum, "max_steps": offset or started.get("max_steps")})
    problem = _incomplete(path, record, metrics_file=f"stages/{stages[0]}/metrics.jsonl" if stages else "stages")
    return RunView(name, path, params, record, joined, problem, stages=stages)


def with_defaults(params: dict) -> dict:
    """A run's parameters with those its version of cflib did not record at today's defaults: an older record
    differs from a newer one only where they trained differently."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainParams) if f.default is not dataclasses.MISSING}
    return {**defaults, **params} if params else params


def _document(path: Path, what: str) -> dict:
    """A run's record or parameters: a JSON object, or ParamError naming the file."""
    document = read_json(path, ParamError, what)
    if not isinstance(document, dict):
        raise ParamError(f"{path}: a {what} is a JSON object, got {type(document).__name__}")
    return document


def _names(paths: list[Path]) -> list[str]:
    """Each run's folder name, or parent/name where two runs share a folder name."""
    names = [path.name for path in paths]
    return [f"{path.parent.name}/{path.name}" if names.count(path.name) > 1 else path.name for path in paths]


def _shown(value: Any) -> Any:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value


def held_out_set(run: RunView) -> dict | None:
    """What a run's held-out loss averages over, from its complete record's `data`: the eval examples it kept, the
    eval shard (a digest of its files' SHA-256 as the shard's index records them, else its root), a mixture's
    sources by root, and the examples overlong_examples: drop left out of each eval partition (at which seq_len).
    None: no complete record."""
    data = run.record.get("data") if run.record is not None and run.complete else None
    if not isinstance(data, dict):
        return None
    files = (data.get("sha256") or {}).get("eval")
    sources = (data.get("mixture") or {}).get("sources")
    overlong = data.get("overlong") or {}
    dropped = {name: counts["dropped"] for name, counts in (overlong.get("partitions") or {}).items()
               if name.split(" ")[0] == "eval" and isinstance(counts, dict) and counts.get("dropped")}
    return {"examples": data.get("eval_examples"),
            "shard": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12] if files else None,
            "roots": [source.get("root") for source in sources] if sources else [data.get("root")],
            "dropped": dropped, "seq_len": overlong.get("seq_len") if dropped else None}


def _same_held_out(a: dict, b: dict) -> bool:
    """Two runs evaluated the same examples: as many, from the same eval shard (by its files' digest where both
    records hold one, else by root) or the same sources, overlong_examples: drop having left out as many of each
    partition (a mixture's sources, named by root alone, may have been converted again in between). Not seq_len:
    drop keeps the examples of at most seq_len tokens, so as many left out of the same examples at another seq_len
    are the same ones."""
    where = "shard" if a["shard"] and b["shard"] else "roots"
    return a["examples"] == b["examples"] and a[where] == b[where] and a["dropped"] == b["dropped"]


def describe_held_out(held: dict) -> str:
    """A held-out set in a few words: its examples, where from, what overlong_examples: drop left out."""
    examples = f"{held['examples']:,}" if isinstance(held["examples"], int) else "?"
    source = f"eval/ {held['shard']}" if held["shard"] else "eval/ of " + ", ".join(map(str, held["roots"]))
    dropped = (f", {sum(held['dropped'].values()):,} longer than seq_len {held['seq_len']} left out"
               if held["dropped"] else "")
    return f"({examples} examples of {source}{dropped})"


def differing_parameters(runs: list[RunView]) -> list[str]:
    """The parameters whose values differ between the runs (a missing one at its default: `with_defaults`)."""
    names = list(dict.fromkeys(name for run in runs for name in run.params))
    return [name for name in names if name not in _NOT_COMPARED
            and len({json.dumps(run.params.get(name), sort_keys=True, default=str) for run in runs}) > 1]


def by_source(evaluation: dict) -> dict:
    """A mixture's held-out figures per source: `source_loss/<name>`, `source_exact_match/<name>`."""
    return {**{f"source_loss/{name}": loss for name, loss in (evaluation.get("loss_by_source") or {}).items()},
            **{f"source_exact_match/{name}": rate
               for name, rate in (evaluation.get("exact_match_by_source") or {}).items()}}


def run_row(run: RunView, differing: list[str]) -> dict:
    """The table's row of one run: its differing parameters, then what it reached."""
    evals = [row for row in run.metrics if row.get("event") == "eval"]
    train = [row for row in run.metrics if row.get("event") == "train"]
    row: dict[str, Any] = {"run": run.name, "complete": run.complete}
    row.update({name: _shown(run.params.get(name)) for name in differing})
    if run.record is not None and run.complete:
        record = run.record
        final, history = record["eval"]["final"], record["eval"]["history"]
        row.update(steps=record["schedule"]["steps_done"], final_eval_loss=final["loss"],
                   best_eval_loss=min(e["loss"] for e in history if e["step"] > 0 or len(history) == 1))
        if run.stages:  # the record is the last stage's: the curriculum's steps and best span every stage
            trained = [e for e in evals if e["step"] > 0]
            row.update(steps=train[-1]["step"] if train else 0,
                       best_eval_loss=min(e["loss"] for e in trained) if trained else row["best_eval_loss"])
        exact = final.get("exact_match") or {}
        row.update({f"exact_match/{task}": rate for task, rate in exact.items()}, **by_source(final))
        row.update(best_scores(record))
        throughput = record["throughput"]
        row.update(tokens_per_s=throughput["steady_state_tokens_per_s"], peak_memory_gib=throughput["peak_memory_gib"],
                   kernel_path=" ".join(f"{k}={v}" for k, v in record["kernel_path"].items()),
                   wall_s=record["timing"]["wall_s"])
    else:  # what metrics.jsonl holds of an incomplete run: only evaluations after training began, so the
        # evaluation at start (step 0) is never shown as what the run reached
        trained = [e for e in evals if e["step"] > 0]
        decoded = next((e for e in reversed(trained) if e.get("exact_match")), {})
        exact = decoded.get("exact_match", {})
        row.update(steps=train[-1]["step"] if train else 0, final_eval_loss=trained[-1]["loss"] if trained else None,
                   best_eval_loss=min(e["loss"] for e in trained) if trained else None,
                   **{f"exact_match/{task}": rate for task, rate in exact.items()},
                   **by_source({"loss_by_source": trained[-1].get("loss_by_source") if trained else None,
                                "exact_match_by_source": decoded.get("exact_match_by_source")}),
                   tokens_per_s=None, peak_memory_gib=None, kernel_path=None, wall_s=None)
    return row


def best_scores(record: dict) -> dict:
    """What chose best/ (best_metric: its name, value and step) and the last lm-eval scores of the run
    (eval_tasks_every), as lm_eval/<task>/<metric>."""
    best = record.get("best_metric") or {"name": "eval_loss"}
    scored = next((e["lm_eval"] for e in reversed(record["eval"]["history"]) if e.get("lm_eval")), {})
    return {"best_metric": best["name"], "best_value": best.get("value"), "best_step": best.get("step"),
            **{f"lm_eval/{task}/{metric}": value for task, scores in scored.items()
               for metric, value in scores.items()}}


def compare(params: CompareParams) -> Comparison:
    """Read the runs params names; an incomplete record stops here, naming the run, unless include_incomplete."""
    paths, swept, skipped, points = resolve_runs(params.runs)
    out_dir = comparison_out_dir(resolve_path(params.out_dir)) if params.out_dir else new_out_dir("comparisons")
    runs = [load_run(path, name) for path, name in tqdm(list(zip(paths, _names(paths))), desc="reading runs",
                                                         unit="run")]
    for run in runs:
        run.sweep_point = run.path in points
    incomplete = [run for run in runs if not run.complete]
    if incomplete and not params.include_incomplete:
        first = incomplete[0]
        raise ParamError(f"run {first.name} ({first.path}) has no complete record: {first.problem}; "
                         "include_incomplete: true shows what its metrics.jsonl holds"
                         + (f" (also incomplete: {', '.join(r.name for r in incomplete[1:])})" if incomplete[1:] else ""))
    differing = differing_parameters(runs)
    rows = [run_row(run, differing) for run in runs]
    if not any(params.metric in row for row in rows):
        have = [key for key in rows[0] if key in METRICS or key.startswith(SCORES)]
        raise ParamError(f"metric {params.metric!r}: no run has it; these have {', '.join(have)}")
    return Comparison(runs, differing, rows, params.metric, [s for s in swept if s in differing] or swept, skipped,
                      out_dir)


def _is_manifest(path: Path) -> bool:
    """Whether `path` is a comparison.json this module wrote (read without following a link)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        document = read_json(path, ParamError, "comparison file")
    except ParamError:
        return False
    return isinstance(document, dict) and {"runs", "rows", "metric", "differing"} <= set(document)


def comparison_out_dir(out: Path) -> Path:
    """`out` when a comparison may write there: new, empty, or holding only an earlier comparison's files (its
    comparison.json among them), which it replaces. Anything else is someone's output (a run's loss_curves.png, a
    sweep's sweep.json): refused, naming it. Links are refused too: written through, they would change files
    outside the folder."""
    if out.exists() and not out.is_dir():
        raise ParamError(f"out_dir {out} exists and is not a folder; choose another out_dir")
    if not out.is_dir():
        return out
    names = sorted(os.listdir(out))
    refuse_links(out, names)
    foreign = sorted((name for name in names if name not in COMPARISON_FILES and copy_beside(name) not in
                      COMPARISON_FILES), key=lambda name: (name.startswith("."), name))  # what a person sees first
    if foreign:
        raise ParamError(f"out_dir {out} holds {foreign[0]}" + (f" and {len(foreign) - 1} more" if foreign[1:] else "")
                         + ", which no comparison wrote: a comparison writes only into a new or empty folder, or "
                         f"over an earlier comparison (its {MANIFEST}); choose another out_dir")
    ours = [name for name in names if name in COMPARISON_FILES]
    if ours and not _is_manifest(out / MANIFEST):
        raise ParamError(f"out_dir {out} holds {ours[0]} but no {MANIFEST} of a comparison: it is not a "
                         "comparison's folder, and its files are not replaced; choose another out_dir")
    return out


def _cell(value: Any, column: str, parameters: Sequence[str]) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if column in parameters:
            return f"{value:g}"  # a parameter as it was set, not rounded
        if column == "tokens_per_s":
            return f"{value:,.0f}"
        if column.startswith(("exact_match/", "source_exact_match/", "lm_eval/")):
            return f"{value:.3f}"
        return f"{value:.1f}" if column == "wall_s" else f"{value:.4f}"
    return str(value)


def table_columns(comparison: Comparison) -> list[str]:
    columns = ["run", *comparison.differing, "steps", "final_eval_loss", "best_eval_loss"]
    columns += sorted({key for row in comparison.rows for key in row
                       if key.startswith(SCORES) and not key.startswith(SOURCE_METRICS)},
                      key=lambda key: (key != "exact_match/overall", key))
    columns += sorted({key for row in comparison.rows for key in row if key.startswith(SOURCE_METRICS)},
                      key=lambda key: (key.split("/", 1)[1], key))
    if any(row.get("best_metric") not in (None, "eval_loss") for row in comparison.rows):
        columns += [c for c in ("best_metric", "best_value", "best_step") if c not in columns]  # maybe a parameter
    columns += ["tokens_per_s", "peak_memory_gib", "kernel_path", "wall_s"]
    if not all(row["complete"] for row in comparison.rows):
        columns.insert(1, "complete")
    return columns


def comparison_table(comparison: Comparison) -> str:
    """Markdown: one row per run, the parameters that differ first; each kernel path a letter, spelt out below
    (a path names every module's kernel: in the table it would crowd out the figures)."""
    columns = table_columns(comparison)
    letters, paths = kernel_letters(comparison)
    lines = ["| " + " | ".join(columns) + " |",
             "| " + " | ".join("---" if c in ("run", "kernel_path", *comparison.differing) else "---:"
                               for c in columns) + " |"]
    for row, letter in zip(comparison.rows, letters):
        shown = {**row, "kernel_path": letter}
        lines.append("| " + " | ".join(_cell(shown.get(column), column, comparison.differing) for column in columns)
                     + " |")
    lines += ["", *(f"kernel path {letter}: {path}" + ("  " if len(paths) > 1 else "")
                    for letter, path in paths.items())]
    return "\n".join(lines).rstrip()


def _same_kernels(a: dict, b: dict) -> bool:
    """Two kernel paths agree on every module both name: a newer cflib records more modules (residual, optimizer),
    which an older record does not make different."""
    return all(a[key] == b[key] for key in a.keys() & b.keys())


def kernel_letters(comparison: Comparison) -> tuple[list[str | None], dict[str, str]]:
    """Each row's kernel path letter (None: unknown), and each letter's path spelt out (the fullest recorded)."""
    chosen: list[tuple[str, dict]] = []
    letters: list[str | None] = []
    for run in comparison.runs:
        path = run.record.get("kernel_path") if run.record is not None and run.complete else None
        if not isinstance(path, dict):
            letters.append(None)
            continue
        index = next((i for i, (_, seen) in enumerate(chosen) if _same_kernels(seen, path)), None)
        if index is None:
            chosen.append((chr(ord("A") + len(chosen)) if len(chosen) < 26 else str(len(chosen)), path))
            index = len(chosen) - 1
        elif len(path) > len(chosen[index][1]):
            chosen[index] = (chosen[index][0], path)
        letters.append(chosen[index][0])
    return letters, {letter: " ".join(f"{k}={v}" for k, v in path.items()) for letter, path in chosen}


def show_comparison(comparison: Comparison) -> None:
    """The table, as markdown in JupyterLab and as text under papermill."""
    from IPython.display import display

    table = comparison_table(comparison)
    display({"text/markdown": table, "text/plain": table}, raw=True)


def _tokens_seen(metrics: list[dict]) -> dict[int, int]:
    """Tokens fed to the model by the end of each step (step 0: none)."""
    seen, total = {0: 0}, 0
    for row in metrics:
        if row.get("event") == "train":
            total += row["tokens"]
            seen[row["step"]] = total
    return seen


def plot_curves(comparison: Comparison, save_to: str | Path | None = None) -> plt.Figure:
    """Train and held-out loss of every run, by optimizer step and by tokens seen. A run with a teacher logs a loss
    that mixes in the KL: its train curve is its cross-entropy term (`ce_loss`), which a plain run's loss is."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharey="row")
    distilled = False
    for index, run in enumerate(comparison.runs):
        color = f"C{index % 10}"
        seen = _tokens_seen(run.metrics)
        train = [row for row in run.metrics if row.get("event") == "train"]
        evals = [row for row in run.metrics if row.get("event") == "eval"]
        teacher = any("ce_loss" in row for row in train)  # a resume may have dropped or added it
        distilled |= teacher
        for column, x_of in enumerate((lambda row: row["step"], lambda row: seen.get(row["step"], math.nan))):
            axes[0][column].plot([x_of(r) for r in train], [r.get("ce_loss", r["loss"]) for r in train], lw=1,
                                 color=color, label=run.name + (" (cross-entropy term)" if teacher else ""))
            axes[1][column].plot([x_of(r) for r in evals], [r["loss"] for r in evals], "o-", ms=3, color=color,
                                 label=run.name)
    train_what = "train loss (per step; with a teacher, its cross-entropy term)" if distilled else \
        "train loss (per step)"
    for row, what in enumerate((train_what, "held-out loss")):
        for column, xlabel in enumerate(("optimizer step", "tokens seen")):
            ax = axes[row][column]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(what)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[row][1].xaxis.set_major_formatter(EngFormatter(sep=""))  # 50k, 1M: tokens read at a glance
    axes[0][1].legend(fontsize=7, loc="upper right")
    fig.suptitle("loss curves, overlaid")
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
    return fig


def plot_exact_match(comparison: Comparison, save_to: str | Path | None = None) -> plt.Figure | None:
    """Final held-out exact match per task, one bar per run; None when no run decoded."""
    tasks = sorted({key.split("/", 1)[1] for row in comparison.rows for key in row if key.startswith("exact_match/")},
                   key=lambda task: (task == "overall", task))
    if not tasks:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(tasks) + 0.4 * len(comparison.rows)), 3.6))
    width = 0.8 / len(comparison.rows)
    for index, row in enumerate(comparison.rows):
        ax.bar([t + index * width for t in range(len(tasks))],
               [row.get(f"exact_match/{task}") or 0.0 for task in tasks], width, label=row["run"])
    ax.set_xticks([t + width * (len(comparison.rows) - 1) / 2 for t in range(len(tasks))], tasks)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out exact match")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
    return fig


def plot_sweep(comparison: Comparison, save_to: str | Path | None = None) -> plt.Figure | None:
    """Each swept parameter against the chosen metric: every complete point of the sweep a dot, the mean over the
    rest a line. Other runs (named beside the sweep, incomplete) are no points of it: left out, and named below."""
    swept = [name for name in comparison.swept if name in comparison.differing] or comparison.swept
    rows = [row for row, run in zip(comparison.rows, comparison.runs) if run.sweep_point and run.complete]
    if not swept or not rows:
        return None
    fig, axes = plt.subplots(1, len(swept), figsize=(4.5 * len(swept), 3.4), squeeze=False)
    for ax, name in zip(axes[0], swept):
        points = [(row.get(name), row.get(comparison.metric)) for row in rows
                  if row.get(comparison.metric) is not None]
        if not points:  # no complete point has the metric: an empty panel, not a failed figure
            ax.set_xlabel(name)
            continue
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in points)
        labels = sorted({x for x, _ in points}, key=lambda x: (x is None, x if numeric else str(x)))
        position = (lambda x: x) if numeric else (lambda x: labels.index(x))
        ax.plot([position(x) for x, _ in points], [y for _, y in points], "o", alpha=0.6, label="each run")
        means = [sum(y for x, y in points if x == value) / sum(1 for x, _ in points if x == value) for value in labels]
        ax.plot([position(x) for x in labels], means, "-", color="C3", label="mean")
        if numeric and all(x > 0 for x in labels) and max(labels) / min(labels) >= 10:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(labels)), [str(x) for x in labels])
        elif len(labels) <= 8:  # a sweep's few values, each named where it sits
            ax.set_xticks(labels, [f"{x:g}" for x in labels])
            ax.minorticks_off()
        ax.set_xlabel(name)
        ax.set_ylabel(comparison.metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if comparison.off_sweep_plot:
        fig.text(0.01, 0.01, "left out: " + ", ".join(comparison.off_sweep_plot), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.06 if comparison.off_sweep_plot else 0, 1, 1))
    if save_to is not None:
        save_figure(fig, save_to)
    return fig


def save_comparison(comparison: Comparison) -> list[Path]:
    """comparison.json, comparison.csv and the figures in comparison.out_dir; the files written."""
    out = comparison_out_dir(comparison.out_dir)  # again: something may have been written there since compare()
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json_atomic(out / "comparison.json", {
        "runs": [{"name": run.name, "path": str(run.path), "complete": run.complete, "problem": run.problem}
                 for run in comparison.runs],
        "differing": comparison.differing, "swept": comparison.swept, "metric": comparison.metric,
        "skipped": comparison.skipped, "held_out": comparison.held_out,
        "held_out_differs": comparison.held_out_differs, "rows": comparison.rows})]
    columns = table_columns(comparison)
    with atomic_file(out / "comparison.csv") as staging, open(staging, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(comparison.rows)
    written.append(out / "comparison.csv")
    for name, plot in (("loss_curves.png", plot_curves), ("exact_match.png", plot_exact_match),
                       ("sweep.png", plot_sweep)):
        figure = plot(comparison, save_to=out / name)
        if figure is not None:
            plt.close(figure)
            written.append(out / name)
        elif not (out / name).is_symlink():  # an earlier comparison's figure this one has none of: not left beside it
            (out / name).unlink(missing_ok=True)
    return written
