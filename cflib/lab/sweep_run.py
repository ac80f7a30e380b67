"""Running a sweep: one papermill run of train_sft.ipynb per point, one per GPU at a time, a live table.

Each point runs as its own process (`python -m papermill`, its executed
notebook and log in its run folder) with its own CUDA_VISIBLE_DEVICES: one
GPU each on a multi-GPU host, none on the CPU, where points run one at a
time. The table of points (queued, running, done, failed, with step, losses
and exact match) updates in place in JupyterLab; under papermill each change
is a line of text and the table is printed at the end. sweep.json is
rewritten at every change, so a killed sweep re-run with the same out_dir
knows what each point had reached (cflib.lab.sweep). A point whose run
completed while its notebook was stopped runs train_sft.ipynb's cells after
training alone (`finish_notebook`): its record is read back, nothing trains.
"""
from __future__ import annotations

import ctypes
import html
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING

import nbformat
import yaml

from cflib.atomic import first_free_name, open_append, set_aside, write_text_atomic
from cflib.errors import ParamError
from cflib.jobs import utc_now
from cflib.lab.compare import SWEEP_FILE
from cflib.lab.sweep import (
    FINISH,
    POINT_FILE,
    POINT_LOG,
    POINT_NOTEBOOK,
    Point,
    Sweep,
    notebook_finished,
    sweep_file_digest,
    sweep_lock,
)
from cflib.paths import resolve_path
from cflib.progress import frontend_attached, tqdm
from cflib.train.records import read_metrics
from cflib.train.run import RUN_FILES
from cflib.train.run_folder import read_run_record

if TYPE_CHECKING:
    from cflib.train.params import TrainParams

TRAIN_NOTEBOOK = "notebooks/train_sft.ipynb"
POLL_S = 0.5


@dataclass
class Running:
    point: Point
    process: subprocess.Popen
    slot: str  # "cpu", or the GPU index it sees as its only device
    started: float
    log: IO


def _die_with_parent() -> None:
    """In the point's process: SIGTERM when the sweep's process dies (a killed kernel), so no point runs on."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class FinishedRun:
    """What the cells after training read of `run` when the run trained to the end before (finish_notebook)."""

    out_dir: Path

    def describe(self) -> str:
        return (f"out_dir      {self.out_dir}: trained to the end before (COMPLETE); its record is read back and "
                "the cells after training run on it, nothing is trained again")


def finished_point(params: TrainParams) -> tuple[FinishedRun, dict]:
    """In a finishing notebook: the point's completed run and its record (read as a copied folder would be)."""
    out_dir = resolve_path(params.out_dir or "")
    if not (out_dir / "COMPLETE").is_file():
        raise ParamError(f"out_dir {out_dir} holds no completed run (no COMPLETE): nothing to finish")
    return FinishedRun(out_dir), read_run_record(out_dir)


def _imports(source: str) -> list[str]:
    """The import statements that open a cell (continued lines included): what the later cells use of it."""
    kept: list[str] = []
    for line in source.splitlines():
        if line.startswith(("from ", "import ")) or (kept and line.startswith((" ", ")"))):
            kept.append(line)
        elif line.strip():
            break
    return kept


def finish_notebook() -> nbformat.NotebookNode:
    """train_sft.ipynb with its preparation, data cells and training replaced by reading the completed run back:
    the cells after training (curves, exact match, summary, answers, the Hub bundle, lm-eval) run as they would
    have."""
    notebook = nbformat.read(resolve_path(TRAIN_NOTEBOOK), as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    prepare = next((cell for cell in code if "prepare_job(" in cell.source), None)
    train = next((cell for cell in code if "fit(run)" in cell.source), None)
    if prepare is None or train is None or notebook.cells.index(prepare) > notebook.cells.index(train):
        raise ParamError(f"{TRAIN_NOTEBOOK}: no cell calls prepare_job( and fit(run), so the sweep cannot run its "
                         "cells after training alone; finish the point by hand, or set its folder aside and run "
                         "the sweep again")
    prepare.source = "\n".join([*_imports(prepare.source), "from cflib.lab.sweep_run import finished_point", "",
                                "params = TrainParams.from_namespace(globals())",
                                "run, record = finished_point(params)  # the run trained to the end before",
                                "print(run.describe())"])
    train.source = "# trained before this notebook was stopped: the cell above read its record back"
    start, end = notebook.cells.index(prepare), notebook.cells.index(train)
    notebook.cells = notebook.cells[:start + 1] + [train] + notebook.cells[end + 1:]  # the data cells need the
    return notebook  # prepared job, and showed the data when the run trained


def _keep_stopped_notebook(run_dir: Path) -> None:
    """The stopped notebook (the training's output) kept beside the one that finishes it."""
    executed = run_dir / POINT_NOTEBOOK
    if not executed.is_file():
        return
    executed.rename(first_free_name(lambda index: run_dir / f"{executed.stem}.stopped-{index}{executed.suffix}"))


def _start(point: Point, slot: str, sweep: Sweep) -> Running:
    finishing = point.action.startswith(FINISH)
    source = finish_notebook() if finishing else None  # checked before anything in the folder changes
    if point.action.startswith("run again") and any((point.run_dir / name).exists() for name in RUN_FILES):
        moved = set_aside(point.run_dir)
        point.action += f" ({moved.name})"
    if finishing:
        _keep_stopped_notebook(point.run_dir)
    point.run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(point.run_dir / POINT_FILE, yaml.safe_dump(point.params, sort_keys=False))
    # A finishing notebook is read from papermill's stdin ("-"): nothing but the executed notebook is written.
    command = [sys.executable, "-m", "papermill", "-" if finishing else str(resolve_path(TRAIN_NOTEBOOK)),
               str(point.run_dir / POINT_NOTEBOOK), "-f", str(point.run_dir / POINT_FILE),
               "--cwd", str(resolve_path("notebooks")), "--log-output", "--no-progress-bar"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "" if slot == "cpu" else slot, "PYTHONUNBUFFERED": "1"}
    env.setdefault("MLFLOW_EXPERIMENT_NAME", sweep.out_dir.name)  # report_to mlflow: one experiment per sweep
    env.setdefault("WANDB_RUN_GROUP", sweep.out_dir.name)  # report_to wandb: one group per sweep
    log = open_append(point.run_dir / POINT_LOG)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                               preexec_fn=_die_with_parent, stdin=subprocess.PIPE if finishing else None)
    if source is not None:  # a notebook far smaller than the pipe's buffer: written at once
        try:
            process.stdin.write(nbformat.writes(source).encode())
            process.stdin.close()
        except BrokenPipeError:  # papermill ended before reading it: its exit code and log say why
            pass
    point.status, point.error = "running", None
    point.attempts.append({"started_utc": utc_now(), "device": slot if slot == "cpu" else f"cuda:{slot}",
                           "resumed": point.params.get("resume") == "latest",
                           **({"finished_cells_only": True} if finishing else {})})
    sweep.save()
    return Running(point, process, slot, time.monotonic(), log)


def notebook_error(executed: Path) -> str | None:
    """The first error the executed notebook shows, as 'Name: message'."""
    try:
        notebook = nbformat.read(executed, as_version=4)
    except (OSError, ValueError):
        return None
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else ():
            if output.output_type == "error":
                return f"{output.ename}: {output.evalue}"
    return None


def _finish(running: Running, sweep: Sweep) -> None:
    point, code = running.point, running.process.returncode
    running.log.close()
    seconds = time.monotonic() - running.started
    point.attempts[-1].update(finished_utc=utc_now(), seconds=round(seconds, 1), returncode=code)
    if code == 0 and (point.run_dir / "COMPLETE").is_file() and notebook_finished(point.run_dir / POINT_NOTEBOOK):
        point.status, point.error = "done", None
    else:
        tail = (point.run_dir / POINT_LOG).read_text(errors="replace").strip().splitlines()[-3:]
        point.status = "failed"
        point.error = notebook_error(point.run_dir / POINT_NOTEBOOK) or f"exit code {code}: " + " | ".join(tail)
    sweep.save()


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def point_progress(point: Point) -> dict:
    """What the live table shows of a point: its step, last losses, exact match, time spent."""
    rows = read_metrics(point.run_dir / "metrics.jsonl") if (point.run_dir / "metrics.jsonl").is_file() else []
    train = [row for row in rows if row.get("event") == "train"]
    evals = [row for row in rows if row.get("event") == "eval"]
    exact = next((e["exact_match"]["overall"] for e in reversed(evals) if e.get("exact_match")), None)
    seconds = sum(attempt.get("seconds", 0.0) for attempt in point.attempts)
    return {"step": train[-1]["step"] if train else 0, "train_loss": train[-1]["loss"] if train else None,
            "eval_loss": evals[-1]["loss"] if evals else None, "exact_match": exact, "seconds": seconds}


COLUMNS = ("point", "status", "step", "train loss", "eval loss", "exact match", "seconds", "note")


def _row(point: Point, running: Running | None) -> list[str]:
    progress = point_progress(point) if point.status != "failed" or point.run_dir.is_dir() else {}
    seconds = progress.get("seconds", 0.0) + (time.monotonic() - running.started if running else 0.0)

    def number(key: str, fmt: str) -> str:
        return format(progress[key], fmt) if progress.get(key) is not None else "-"
    note = point.error.splitlines()[0][:100] if point.status == "failed" and point.error else (
        point.action if point.status == "queued" or (running and point.action != "run") else "")
    return [point.name, point.status, f"{progress.get('step', 0)}/{point.total_steps or '?'}",
            number("train_loss", ".4f"), number("eval_loss", ".4f"), number("exact_match", ".3f"),
            f"{seconds:.0f}" if seconds else "-", note]


def text_table(sweep: Sweep, running: dict[str, Running] | None = None) -> str:
    live = {r.point.name: r for r in (running or {}).values()}
    rows = [list(COLUMNS)] + [_row(point, live.get(point.name)) for point in sweep.points]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def html_table(sweep: Sweep, running: dict[str, Running]) -> str:
    live = {r.point.name: r for r in running.values()}
    colors = {"done": "#2e7d32", "failed": "#c62828", "running": "#1565c0", "queued": "#757575"}
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{c}</th>" for c in COLUMNS)
    body = ""
    for point in sweep.points:
        cells = _row(point, live.get(point.name))
        cells[1] = f"<b style='color:{colors.get(point.status, 'inherit')}'>{html.escape(cells[1])}</b>"
        body += "<tr>" + "".join(f"<td style='padding:2px 8px'>{c if i == 1 else html.escape(c)}</td>"
                                 for i, c in enumerate(cells)) + "</tr>"
    return f"<table class='cflib-sweep-table'><tr>{head}</tr>{body}</table>"


class LiveTable:
    """In JupyterLab a table updated in place; elsewhere a line per change (papermill keeps no live output)."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self.widget = None
        if frontend_attached():
            import ipywidgets as widgets
            from IPython.display import display

            self.widget = widgets.HTML(html_table(sweep, {}))
            display(self.widget)

    def update(self, running: dict[str, Running]) -> None:
        if self.widget is not None:
            self.widget.value = html_table(self.sweep, running)

    def event(self, line: str) -> None:
        tqdm.write(f"[{datetime.now().strftime('%H:%M:%S')}] {line}")


def _outcome(point: Point) -> str:
    if point.status == "done":
        progress = point_progress(point)
        exact = f", exact match {progress['exact_match']:.3f}" if progress["exact_match"] is not None else ""
        return f"done in {point.attempts[-1]['seconds']:.0f} s: eval loss {progress['eval_loss']:.4f}{exact}"
    return f"failed: {point.error}"


def run_sweep(sweep: Sweep, poll_s: float = POLL_S) -> Sweep:
    """Run every queued point (one per slot at a time), showing the table; returns the sweep, its states final.
    An interrupt (the kernel's stop button) stops the running points; the next run resumes them."""
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    with sweep_lock(sweep.out_dir):  # taken atomically; a second sweep of the folder is refused, naming this one
        if sweep_file_digest(sweep.out_dir) != sweep.planned_on:
            raise ParamError(f"out_dir {sweep.out_dir}: {SWEEP_FILE} changed since this sweep was planned (another "
                             "sweep ran there meanwhile); plan it again")
        return _run_locked(sweep, poll_s)


def _run_locked(sweep: Sweep, poll_s: float) -> Sweep:
    sweep.save()
    queue = [point for point in sweep.points if point.status == "queued"]
    slots = ["cpu"] if sweep.params.gpus is None else [str(index) for index in sweep.params.gpus]
    running: dict[str, Running] = {}
    view = LiveTable(sweep)
    for point in sweep.points:
        if point.status != "queued":
            view.event(f"{point.name}: {point.action}" + (f": {point.error}" if point.status == "failed" else ""))
    bar = tqdm(total=len(sweep.points), initial=len(sweep.points) - len(queue), desc="points", unit="point")
    try:
        while queue or running:
            for slot in slots:
                if slot not in running and queue:
                    point = queue.pop(0)
                    running[slot] = _start(point, slot, sweep)
                    view.event(f"{point.name}: started on {running[slot].point.attempts[-1]['device']}"
                               + (f" ({point.action})" if point.action != "run" else ""))
            for slot, job in list(running.items()):
                if job.process.poll() is not None:
                    _finish(job, sweep)
                    del running[slot]
                    bar.update(1)
                    view.event(f"{job.point.name}: {_outcome(job.point)}")
            view.update(running)
            if queue or running:
                time.sleep(poll_s)
    except BaseException:
        for job in running.values():
            _stop(job.process)
            job.log.close()
            job.point.status, job.point.action = "queued", "interrupted: resumes on the next run"
            job.point.attempts[-1].update(finished_utc=utc_now(), seconds=round(time.monotonic() - job.started, 1),
                                          interrupted=True)
        sweep.save()
        raise
    finally:
        bar.close()
    view.update({})
    if view.widget is None:  # in JupyterLab the table above is already final
        print(text_table(sweep))
    return sweep


def sweep_summary(sweep: Sweep) -> str:
    counts = {status: sum(p.status == status for p in sweep.points) for status in ("done", "failed", "queued")}
    return (f"{counts['done']} of {len(sweep.points)} points done, {counts['failed']} failed"
            + (f", {counts['queued']} not run" if counts["queued"] else "") + f"; sweep.json in {sweep.out_dir}")
