"""Experiment trackers beside metrics.jsonl: TensorBoard event files, MLflow and W&B runs (`report_to`).

The trainer hands every row it appends to metrics.jsonl to the trackers
(rank 0 only) and, at the end, the record. No tracker may stop or slow a run:
TensorBoard's writer queues events for a thread of its own, and every MLflow
and W&B call runs on a worker thread fed by a queue, so a slow or vanished
server costs the training loop one `put`. A tracker that fails warns once,
goes quiet, and the run carries on; metrics.jsonl still holds every row.

`out_dir/trackers.json` names where the run went (the TensorBoard folder,
the MLflow tracking URI and run id, the W&B project and run id), so a
resumed run continues the same MLflow and W&B run, and `log_artifacts` can
add the notebook's plots to the MLflow run. A resumed run first hands each
tracker metrics.jsonl's rows up to its checkpoint, and each sends only the
steps it lacks: a killed run's last rows may never have left its process.

A run writes inside its folder only: unless the user set them, W&B's cache
and data folders point into out_dir/wandb and MLflow's telemetry is off,
for the run's duration.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from cflib.atomic import write_json_atomic
from cflib.errors import ParamError
from cflib.jsonio import read_json
from cflib.train.wandb_history import wandb_history_steps

TRACKING_FILE = "trackers.json"
# How long the end of a run waits for MLflow or W&B to take the last metrics and the record; then it goes on without.
CLOSE_TIMEOUT_S = 30.0
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"  # as transformers' MLflow callback reads it
DEFAULT_EXPERIMENT = "cflib"
WANDB_PROJECT_ENV = "WANDB_PROJECT"  # as transformers' W&B callback reads it; the W&B project defaults to cflib
WANDB_SERVICE_ENV = "WANDB_SERVICE"  # set by wandb.init once W&B's service runs in this process (or a parent)
# A vanished server should be noticed in seconds, not after MLflow's default minutes of retries.
_MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                         "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# MLflow's telemetry writes an installation id to ~/.config/mlflow when mlflow is first imported.
_MLFLOW_QUIET = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def scalars(row: dict) -> dict[str, float]:
    """The tracked scalars of one metrics.jsonl row, under the names every tracker uses."""
    if row.get("event") == "train":
        found = {"train/loss": row.get("loss"), "train/learning_rate": row.get("lr"),
                 "train/grad_norm": row.get("grad_norm"),
                 # a run with a teacher: the loss's cross-entropy and KL terms (cflib.train.step.StepResult)
                 "train/ce_loss": row.get("ce_loss"), "train/kl_loss": row.get("kl_loss")}
        if row.get("seconds"):
            found["train/tokens_per_s"] = row["tokens"] / row["seconds"]
            found["train/supervised_tokens_per_s"] = row["supervised_tokens"] / row["seconds"]
    elif row.get("event") == "eval":
        found = {"eval/loss": row.get("loss")}
        for task, rate in (row.get("exact_match") or {}).items():
            found[f"eval/exact_match/{task}"] = rate
        for source, loss in (row.get("loss_by_source") or {}).items():  # a mixture's sources
            found[f"eval/source/{source}/loss"] = loss
        for source, rate in (row.get("exact_match_by_source") or {}).items():
            found[f"eval/source/{source}/exact_match"] = rate
        for name, value in (row.get("metrics") or {}).items():  # register_metric's (cflib.train.best_metric)
            found[f"eval/{name}"] = value
        for task, scores in (row.get("lm_eval") or {}).items():  # eval_tasks_every (cflib.train.task_scores)
            for metric, value in scores.items():
                found[f"lm_eval/{task}/{metric}"] = value
    else:
        return {}
    return {key: float(value) for key, value in found.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def final_metrics(record: dict) -> dict[str, float]:
    """The run's last evaluation, under the names its rows had."""
    return scalars({**record["eval"]["final"], "event": "eval"})


def flat_params(params: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """Parameters as the trackers store them: scalars as they are, None, lists and mappings as text."""
    out: dict[str, str | int | float | bool] = {}
    for name, value in params.items():
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        else:
            out[name] = json.dumps(value, sort_keys=True, default=str) if isinstance(value, dict) else str(value)
    return out


def _warn_once(tracker: str, what: str, err: BaseException | str) -> str:
    message = (f"{tracker} tracker stopped ({what}: {err}); training goes on and metrics.jsonl keeps every row")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message


class TensorBoardTracker:
    """Event files under out_dir/tensorboard, written by SummaryWriter's own thread."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, replay: list[dict]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = out_dir / "tensorboard"
        self.error: str | None = None
        # Every event file opens with a session start at step 0 (purge_step 0). TensorBoard takes each start after
        # the first as a restart and hides every event the earlier files hold, samples included; so a resumed
        # run's file replaces the killed run's and begins with metrics.jsonl's rows up to the checkpoint: a killed
        # run's last events may never have left its writer's buffer.
        self.writer = SummaryWriter(str(self.folder), purge_step=0)
        for row in replay:
            step = int(row.get("step", 0))
            self.log(scalars(row), step)
            if _samples_on_disk(out_dir, row):
                self.log_samples(out_dir / row["samples_file"], step)

    def log(self, values: dict[str, float], step: int) -> None:
        if self.error:
            return
        try:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        except Exception as err:  # a full disk, say: the run matters more than its event file
            self.error = _warn_once(self.name, "writing events", err)

    def log_samples(self, path: Path, step: int) -> None:
        """log_samples' prompts and answers as a Markdown table under the text tag eval/samples."""
        if self.error:
            return
        try:
            self.writer.add_text("eval/samples", samples_markdown(path), step)
        except Exception as err:
            self.error = _warn_once(self.name, "writing samples", err)

    def close(self, record: dict | None, status: str) -> None:
        if self.error:
            return
        try:
            if record is not None:
                from torch.utils.tensorboard.summary import hparams

                for summary in hparams(flat_params(record["params"]), final_metrics(record)):
                    self.writer.file_writer.add_summary(summary)
            self.writer.close()
        except Exception as err:
            self.error = _warn_once(self.name, "closing", err)

    def describe(self) -> dict:
        return {"log_dir": str(self.folder), "error": self.error}


_STOP = object()


class QueuedTracker:
    """A tracker whose every call to its service runs on a thread of its own, fed by a queue: the training loop
    pays one `put` per row. A subclass starts its run (`_start`), sends rows (`_send`) and ends it (`_finish`).
    Resumed, it first sends `replay` (metrics.jsonl's rows up to the checkpoint); `_send` and `_send_file` leave
    out the steps its service already holds, so each step arrives once."""

    name = "queued"
    where = "its service"  # named in the warning a failure gives

    def __init__(self, out_dir: Path, params: dict, run_id: str | None, on_started: Callable[[], None],
                 replay: list[dict] | None = None) -> None:
        self.out_dir, self.run_id = out_dir, run_id
        self.error: str | None = None
        self._params, self._on_started, self._replay_rows = params, on_started, replay or []
        self._queue: queue.Queue = queue.Queue()
        self._held: Any = None  # an end-of-run item met while batching metrics
        self._thread = threading.Thread(target=self._work, name=f"cflib-{self.name}", daemon=True)
        self._thread.start()

    def log(self, values: dict[str, float], step: int) -> None:
        if not self.error:
            self._queue.put((values, step, int(time.time() * 1000)))

    def log_samples(self, path: Path, step: int) -> None:
        """A file of log_samples, sent as an artifact of the run."""
        if not self.error:
            self._queue.put(("file", path, step))

    def close(self, record: dict | None, status: str) -> None:
        self._queue.put(("close", record, status))
        self._queue.put(_STOP)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive() and not self.error:
            self.error = _warn_once(self.name, "closing", f"the server took no answer within {CLOSE_TIMEOUT_S:g} s")

    # --- on the tracker's thread ------------------------------------------------------
    def _work(self) -> None:
        try:
            self._start()
        except Exception as err:
            self.error = _warn_once(self.name, f"starting a run at {self.where}", err)
        if not self.error:
            try:
                self._replay(self._replay_rows)
            except Exception as err:
                self.error = _warn_once(self.name, f"sending metrics.jsonl's earlier rows to {self.where}", err)
        while True:
            item, self._held = (self._held, None) if self._held is not None else (self._queue.get(), None)
            if item is _STOP:
                self._stopped()
                return
            if self.error:
                continue  # drained, never sent: the run goes on
            try:
                if isinstance(item, tuple) and item[0] == "close":
                    self._finish(item[1], item[2])
                elif isinstance(item, tuple) and item[0] == "file":
                    self._send_file(item[1], item[2])
                else:
                    self._send([item] + self._more())
            except Exception as err:
                self.error = _warn_once(self.name, f"sending to {self.where}", err)

    def _more(self) -> list:
        """The metric updates already queued behind the first, up to one batch: one request for them all."""
        items = []
        while len(items) < 200:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP or (isinstance(item, tuple) and item[0] in ("close", "file")):
                self._held = item  # handled next, after this batch
                break
            items.append(item)
        return items

    def _replay(self, rows: list[dict]) -> None:
        """Rows of an earlier attempt, in step order: a samples file goes after its step's metrics (W&B drops a
        step below the last it logged)."""
        pending: list = []
        stamp = int(time.time() * 1000)
        for row in rows:
            values, step = scalars(row), int(row.get("step", 0))
            if values:
                pending.append((values, step, stamp))
            if _samples_on_disk(self.out_dir, row) and self._lacks_file(row["samples_file"], step):
                self._send(pending)
                pending = []
                self._send_file(self.out_dir / row["samples_file"], step)
        self._send(pending)

    def _lacks_file(self, name: str, step: int) -> bool:
        """Whether the service lacks the samples file `name` (relative to out_dir) of an earlier attempt."""
        return True

    def _start(self) -> None:
        raise NotImplementedError

    def _send(self, items: list) -> None:
        raise NotImplementedError

    def _send_file(self, path: Path, step: int) -> None:
        raise NotImplementedError

    def _finish(self, record: dict | None, status: str) -> None:
        raise NotImplementedError

    def _stopped(self) -> None:
        """The last call on the tracker's thread, after `_finish` or a failure: what the tracker started goes."""


# What the end of a run hands MLflow and W&B beside the metrics.
RUN_FILES = ("record.json", "metrics.jsonl", "params.json", "loss_weighting.json")


class MlflowTracker(QueuedTracker):
    """One MLflow run per training run."""

    name = "mlflow"

    def __init__(self, out_dir: Path, params: dict, tracking_uri: str | None, run_id: str | None,
                 on_started: Callable[[], None], replay: list[dict] | None = None) -> None:
        self.tracking_uri = self.where = tracking_uri or default_tracking_uri(out_dir)
        self.experiment = os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
        self._steps_held: dict[str, int] = {}  # metric -> the largest step the MLflow run holds (resumed)
        self._files_held: set[str] = set()  # the samples files it holds, as out_dir-relative paths
        super().__init__(out_dir, params, run_id, on_started, replay)

    def describe(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment": self.experiment, "run_id": self.run_id,
                "error": self.error}

    def _start(self) -> None:
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.tracking_uri)
        if self.run_id is not None:  # a resumed run continues its MLflow run
            self.client.update_run(self.run_id, status="RUNNING")
            self._steps_held, self._files_held = self._holdings()
            return
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            self.experiment, artifact_location=_artifact_location(self.tracking_uri))
        run = self.client.create_run(experiment_id, run_name=self.out_dir.name,
                                     tags={"cflib.out_dir": str(self.out_dir)})
        self.run_id = run.info.run_id
        self._on_started()
        values = [Param(name, str(value)[:6000]) for name, value in flat_params(self._params).items()]
        for start in range(0, len(values), 100):  # MLflow takes at most 100 parameters a request
            self.client.log_batch(self.run_id, params=values[start:start + 100])

    def _holdings(self) -> tuple[dict[str, int], set[str]]:
        """What the MLflow run holds from earlier attempts: each metric's largest step, and the samples files.
        MLflow keeps every value logged and cannot drop one, so a step it holds is never sent again: the
        killed attempt's values stay for the steps it sent past its checkpoint."""
        steps = {key: max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
                 for key in self.client.get_run(self.run_id).data.metrics}
        files = {item.path for item in self.client.list_artifacts(self.run_id, "samples")}
        return steps, files

    def _send(self, items: list) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, stamp, step) for values, step, stamp in items for key, value in values.items()
                   if step > self._steps_held.get(key, -1)]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def _lacks_file(self, name: str, step: int) -> bool:
        return name not in self._files_held

    def _send_file(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), str(path.parent.relative_to(self.out_dir)))

    def _finish(self, record: dict | None, status: str) -> None:
        for name in RUN_FILES:
            if (self.out_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.out_dir / name))
        self.client.set_terminated(self.run_id, status=status)


class WandbTracker(QueuedTracker):
    """One W&B run per training run, in the project WANDB_PROJECT names (cflib by default); its local files in
    out_dir/wandb unless WANDB_DIR says otherwise. WANDB_MODE=offline keeps it on disk for `wandb sync`.

    W&B serves every run of a process from one service, started with the first run's environment and settings: its
    log (core-debug-*.log) in that run's WANDB_CACHE_DIR. A service this tracker started (none ran, WANDB_SERVICE
    unset) is torn down when its run ends, so the next run of the process (a sweep's next point, another run in the
    notebook) starts one of its own, logging in its own folder; one that ran before (a W&B run of the user's) is
    left alone."""

    name = "wandb"

    def __init__(self, out_dir: Path, params: dict, run_id: str | None, on_started: Callable[[], None],
                 replay: list[dict] | None = None) -> None:
        self.project = os.environ.get(WANDB_PROJECT_ENV) or DEFAULT_EXPERIMENT
        self.where = f"W&B project {self.project}"
        self.mode: str | None = None
        self._first_new_step = 0  # resumed: the first step the W&B run lacks
        self._owns_service = False  # wandb.init started W&B's service: torn down at the end (_stopped)
        super().__init__(out_dir, params, run_id, on_started, replay)

    def describe(self) -> dict:
        return {"project": self.project, "run_id": self.run_id, "mode": self.mode, "error": self.error}

    def _start(self) -> None:
        import wandb

        folder = Path(os.environ.get("WANDB_DIR") or self.out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # create_new: a W&B run the user has open in the notebook is left alone; a resumed run continues its own.
        resumed = self.run_id is not None
        self._owns_service = WANDB_SERVICE_ENV not in os.environ  # wandb.init starts one (and sets it)
        self.run = wandb.init(project=self.project, name=self.out_dir.name, dir=str(folder), config=self._params,
                              id=self.run_id, resume="allow" if resumed else None, reinit="create_new")
        self.run_id, self.mode = self.run.id, self.run.settings.mode
        if resumed:
            self._first_new_step = self._last_step_held(folder / "wandb") + 1
        self._on_started()

    def _last_step_held(self, wandb_dir: Path) -> int:
        """The last step the W&B run holds. Online, the server tells wandb.init the run's next step
        (starting_step) and W&B drops any step below it; offline, it is the last history row in the run's
        earlier offline folders, so that `wandb sync` of them all, oldest first, sends each step once."""
        if self.mode != "offline":
            return self.run.starting_step - 1
        current = Path(self.run.dir).parent.resolve()
        return max((step for log in sorted(wandb_dir.glob(f"offline-run-*-{self.run_id}/run-{self.run_id}.wandb"))
                    if log.parent.resolve() != current for step in wandb_history_steps(log)), default=-1)

    def _send(self, items: list) -> None:
        for values, step, _ in items:
            if step >= self._first_new_step:  # W&B would drop it with a warning, or hold the step twice offline
                self.run.log(values, step=step)

    def _lacks_file(self, name: str, step: int) -> bool:
        return step >= self._first_new_step

    def _send_file(self, path: Path, step: int) -> None:
        """An artifact of type samples, and a table of them at the step."""
        import wandb

        if step < self._first_new_step:
            return
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        columns = ["example_id", "task", "prompt", "answer", "reference", "hit"]
        self.run.log({"eval/samples": wandb.Table(columns=columns, data=[[row.get(c) for c in columns]
                                                                         for row in rows])}, step=step)
        artifact = wandb.Artifact(f"samples-{self.run.id}", type="samples")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact, aliases=[path.stem])

    def _finish(self, record: dict | None, status: str) -> None:
        if record is not None:
            self.run.summary.update(final_metrics(record))
        for name in RUN_FILES:
            if (self.out_dir / name).is_file():
                self.run.save(str(self.out_dir / name), base_path=str(self.out_dir), policy="now")
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def _stopped(self) -> None:
        if self._owns_service and WANDB_SERVICE_ENV in os.environ:
            import wandb

            try:
                wandb.teardown()  # the service ends, WANDB_SERVICE cleared: the next run starts its own
            except (Exception, SystemExit) as err:  # SystemExit: the service's non-zero exit code
                if not self.error:
                    self.error = _warn_once(self.name, "ending W&B's service", err)


def samples_markdown(path: Path) -> str:
    """A file of log_samples as a Markdown table: prompt, answer, reference, hit."""
    lines = ["| prompt | answer | reference | hit |", "| --- | --- | --- | --- |"]
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            cells = [str(row[key]).replace("|", "\\|").replace("\n", " ") for key in ("prompt", "answer", "reference")]
            lines.append(f"| {' | '.join(cells)} | {'yes' if row['hit'] else 'no'} |")
    return "\n".join(lines)


def _samples_on_disk(out_dir: Path, row: dict) -> bool:
    return bool(row.get("samples_file")) and (out_dir / row["samples_file"]).is_file()


def default_tracking_uri(out_dir: Path) -> str:
    """An SQLite store in out_dir/mlruns (MLflow's file store no longer takes new runs)."""
    (out_dir / "mlruns").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(out_dir / 'mlruns' / 'mlflow.db').resolve()}"


def _artifact_location(tracking_uri: str) -> str | None:
    """Beside an SQLite store, its artifacts; a server chooses its own."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
    return None


class Trackers:
    """The trackers report_to names, fed each metrics row; a context that ends their runs, FAILED on an error."""

    def __init__(self, out_dir: Path, params: dict, report_to: Iterable[str], tracking_uri: str | None,
                 resumed_step: int, kept_rows: Sequence[dict] = ()) -> None:
        """kept_rows: metrics.jsonl's rows a run resumed at `resumed_step` keeps (MetricsLog.truncate_after),
        replayed to each tracker first."""
        self.out_dir, self.record = out_dir, None
        report_to = tuple(report_to)
        # Before any tracker starts: the libraries read these when first imported or started.
        self._env = ScopedEnv(private_folders(out_dir, report_to))
        self.trackers: list = []
        self._lock = threading.Lock()
        try:
            self._start(params, report_to, tracking_uri, resumed_step, list(kept_rows))
        except BaseException:  # the trackers started so far ended, the environment as it was: nothing leaks on
            for tracker in self.trackers:
                tracker.close(None, "FAILED")
            self._env.restore()
            raise

    def _start(self, params: dict, report_to: tuple[str, ...], tracking_uri: str | None, resumed_step: int,
               kept_rows: list[dict]) -> None:
        out_dir = self.out_dir
        previous = read_tracking(out_dir) if resumed_step else {}
        replay = kept_rows if resumed_step else []
        for name in report_to:
            if name == "tensorboard":
                self.trackers.append(TensorBoardTracker(out_dir, replay))
            elif name == "mlflow":
                run_id = previous.get("mlflow", {}).get("run_id")
                uri = previous.get("mlflow", {}).get("tracking_uri") if run_id else tracking_uri
                self.trackers.append(MlflowTracker(out_dir, params, uri, run_id, on_started=self.save,
                                                   replay=replay))
            elif name == "wandb":
                self.trackers.append(WandbTracker(out_dir, params, previous.get("wandb", {}).get("run_id"),
                                                  on_started=self.save, replay=replay))
        self.save()

    def log(self, row: dict) -> None:
        values = scalars(row)
        if values:
            for tracker in self.trackers:
                tracker.log(values, int(row.get("step", 0)))
        if row.get("samples_file"):
            for tracker in self.trackers:
                tracker.log_samples(self.out_dir / row["samples_file"], int(row.get("step", 0)))

    def finished(self, record: dict) -> dict:
        self.record = record
        return record

    def save(self) -> None:
        with self._lock:
            write_json_atomic(self.out_dir / TRACKING_FILE, {t.name: t.describe() for t in self.trackers})

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, traceback: Any) -> None:
        status = "FINISHED" if kind is None else "KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED"
        try:
            for tracker in self.trackers:
                tracker.close(self.record if kind is None else None, status)
            self.save()
        finally:
            self._env.restore()


def private_folders(out_dir: Path, report_to: Iterable[str]) -> dict[str, str]:
    """The environment that keeps the trackers' libraries inside the run folder: W&B's cache (its service's
    debug logs, artifact copies) and data (artifact staging) in out_dir/wandb, MLflow's telemetry off. W&B's
    config folder is left alone: W&B only reads it (the user's `wandb login --host`), never writes it."""
    env: dict[str, str] = {}
    if "wandb" in report_to:
        env["WANDB_CACHE_DIR"] = str((out_dir / "wandb" / "cache").resolve())
        env["WANDB_DATA_DIR"] = str((out_dir / "wandb" / "data").resolve())
    if "mlflow" in report_to:
        env.update(_MLFLOW_QUIET)
    return env


class ScopedEnv:
    """Environment variables set until `restore`, each only where the user has not set it already."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = {name: value for name, value in values.items() if name not in os.environ}
        os.environ.update(self.values)

    def restore(self) -> None:
        for name, value in self.values.items():
            if os.environ.get(name) == value:  # one changed meanwhile stays as it is
                del os.environ[name]
        self.values = {}


def open_trackers(run: Any, metrics: Any, resumed_step: int, kept_rows: Sequence[dict], active: bool) -> Trackers:
    """The run's trackers (none off rank 0, or without report_to), fed by the metrics log's every row; a resumed
    run's `kept_rows` (the metrics rows up to its checkpoint) first."""
    from dataclasses import asdict

    p = run.params
    if not (active and p.report_to):
        return _NoTrackers()
    trackers = Trackers(run.out_dir, {**asdict(p), "out_dir": str(run.out_dir)}, p.report_to,
                        p.mlflow_tracking_uri, resumed_step, kept_rows)
    metrics.listeners.append(trackers.log)
    return trackers


class _NoTrackers:
    def log(self, row: dict) -> None:
        pass

    def finished(self, record: dict) -> dict:
        return record

    def __enter__(self) -> "_NoTrackers":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def read_tracking(out_dir: str | Path) -> dict:
    path = Path(out_dir) / TRACKING_FILE
    return read_json(path, ParamError, "tracking file") if path.is_file() else {}


def log_artifacts(out_dir: str | Path, *names: str, timeout_s: float = CLOSE_TIMEOUT_S) -> list[str]:
    """Add files of out_dir (the notebook's plots) to the run's MLflow run, when it has one; the names sent.
    A server that fails or does not answer within timeout_s warns, and the notebook goes on."""
    out_dir = Path(out_dir)
    tracked = read_tracking(out_dir).get("mlflow") or {}
    files = [out_dir / name for name in names if (out_dir / name).is_file()]
    if not tracked.get("run_id") or tracked.get("error") or not files:
        return []
    sent: list[str] = []

    def send() -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracked["tracking_uri"])
        for path in files:
            client.log_artifact(tracked["run_id"], str(path))
            sent.append(path.name)

    failure: list[BaseException] = []
    env = ScopedEnv(_MLFLOW_QUIET)  # a notebook's first import of mlflow may be this one
    thread = threading.Thread(target=lambda: _capture(send, failure), name="cflib-mlflow-artifacts", daemon=True)
    try:
        thread.start()
        thread.join(timeout_s)
    finally:
        env.restore()
    if failure or thread.is_alive():
        _warn_once("mlflow", "sending artifacts", failure[0] if failure else f"no answer within {timeout_s:g} s")
    return sent


def _capture(fn: Callable[[], None], failure: list[BaseException]) -> None:
    try:
        fn()
    except Exception as err:
        failure.append(err)
