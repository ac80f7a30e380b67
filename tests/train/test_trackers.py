"""report_to: TensorBoard's own reader and a real MLflow tracking server get what metrics.jsonl holds."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from cflib.train import train
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics
from cflib.train.trackers import log_artifacts, read_tracking

SERVER_START_S = 120


def run_params(out_dir: Path, **overrides) -> dict:
    # The embedded data, 6 steps, held-out loss at 0, 3 and 6 and exact match over 16 prompts at 0 and 6.
    return {"model": "smoke", "out_dir": str(out_dir), "max_steps": 6, "eval_every_steps": 3,
            "exact_match_limit": 16, "device": "cpu", **overrides}


def rows(out_dir: Path, event: str) -> list[dict]:
    return [row for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == event]


def test_report_to_is_checked_before_anything_runs():
    pytest.importorskip("mlflow")  # a test extra; the GPU tier's image may lack it
    assert TrainParams.from_dict({"report_to": "none"}).report_to is None
    assert TrainParams.from_dict({"report_to": ["none"]}).report_to is None
    installed = tuple(name for name in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(name))
    assert TrainParams.from_dict({"report_to": "all"}).report_to == installed  # as transformers: every one installed
    assert TrainParams.from_dict({"report_to": "tensorboard, mlflow"}).report_to == ("tensorboard", "mlflow")
    assert TrainParams.from_namespace({"report_to": ["mlflow"]}).report_to == ("mlflow",)
    with pytest.raises(ParamError, match="report_to: unknown tracker 'comet'"):
        TrainParams.from_dict({"report_to": ["tensorboard", "comet"]})
    with pytest.raises(ParamError, match="mlflow_tracking_uri is 'http://127.0.0.1:1' but report_to has no mlflow"):
        TrainParams.from_dict({"report_to": "tensorboard", "mlflow_tracking_uri": "http://127.0.0.1:1"})


@pytest.mark.parametrize("uri, words", [
    ("http//localhost:5000", "scheme (none) is none of MLflow's stores"),
    ("htp://localhost:5000", "scheme htp: is none of MLflow's stores"),
    ("http://localhost:99999", "Port out of range"),
    ("http://:5000", "names no host"),
    ("http://[::1", "not a URI"),
    ("sqlite://mlflow.db", "a local store is sqlite:/// followed by an absolute path"),
    ("http://host:5000/ x", "holding spaces"),
])
def test_a_malformed_tracking_uri_is_refused_before_anything_runs(tmp_path, uri, words):
    pytest.importorskip("mlflow")
    with pytest.raises(ParamError) as caught:
        TrainParams.from_dict({"report_to": "mlflow", "mlflow_tracking_uri": uri, "out_dir": str(tmp_path / "run")})
    assert str(caught.value).startswith("mlflow_tracking_uri ") and words in str(caught.value)
    assert not (tmp_path / "run").exists()
    for good in ("http://127.0.0.1:5000", "https://mlflow.example.org", "sqlite:////tmp/mlflow.db", "databricks",
                 "postgresql+psycopg2://user@host/db"):
        TrainParams.from_dict({"report_to": "mlflow", "mlflow_tracking_uri": good})


def test_tensorboard_reads_back_every_scalar_and_the_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out_dir = tmp_path / "run"
    record = train(run_params(out_dir, report_to="tensorboard"), progress=False)
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(s.step, s.value) for s in events.Scalars(tag)]

    train_rows, eval_rows = rows(out_dir, "train"), rows(out_dir, "eval")
    assert series("train/loss") == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_rows]
    assert series("train/learning_rate") == [(r["step"], pytest.approx(r["lr"], rel=1e-6)) for r in train_rows]
    assert series("train/grad_norm") == [(r["step"], pytest.approx(r["grad_norm"], rel=1e-6)) for r in train_rows]
    assert series("train/tokens_per_s") == [(r["step"], pytest.approx(r["tokens"] / r["seconds"], rel=1e-6))
                                            for r in train_rows]
    assert [step for step, _ in series("eval/loss")] == [0, 3, 6]
    assert series("eval/loss") == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in eval_rows]
    final = record["eval"]["final"]["exact_match"]
    assert set(final) >= {"overall"}
    for task, rate in final.items():
        assert series(f"eval/exact_match/{task}")[-1] == (6, pytest.approx(rate))
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["lr"].number_value == pytest.approx(1e-3)
    assert start.hparams["model"].string_value == "smoke"
    assert read_tracking(out_dir)["tensorboard"] == {"log_dir": str(out_dir / "tensorboard"), "error": None}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """`mlflow server` on loopback over an SQLite store, its artifacts served through it."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "server.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                 "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
                 "--port", str(self.port), "--workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder,
                # No job runner: its eight consumer processes serve MLflow's GenAI jobs, which no run here uses,
                # and cost a loaded CI machine some 20 s of CPU to start.
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"mlflow server did not start on {self.url}:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One server for the module (it takes seconds to start): the test that kills it is the last to use it."""
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow") / "server")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def experiment_name(monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "cflib-tests")


@pytest.mark.slow
def test_mlflow_server_receives_params_metrics_samples_and_the_record(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    out_dir = tmp_path / "run"
    train(run_params(out_dir, report_to="mlflow", mlflow_tracking_uri=mlflow_server.url, log_samples=2),
          progress=False)
    tracked = read_tracking(out_dir)["mlflow"]
    assert tracked["tracking_uri"] == mlflow_server.url and tracked["error"] is None
    (out_dir / "loss_curves.png").write_bytes(b"\x89PNG a plot")
    assert log_artifacts(out_dir, "loss_curves.png", "absent.png") == ["loss_curves.png"]

    client = MlflowClient(mlflow_server.url)
    run = client.get_run(tracked["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "cflib-tests"
    assert run.data.params["lr"] == "0.001" and run.data.params["max_steps"] == "6"
    assert run.data.params["report_to"] == "mlflow" and run.data.params["init_checkpoint"] == "None"
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in
                                                    rows(out_dir, "train")]
    evals = sorted(client.get_metric_history(run.info.run_id, "eval/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in evals] == [(r["step"], pytest.approx(r["loss"])) for r in rows(out_dir, "eval")]
    assert len(client.get_metric_history(run.info.run_id, "train/learning_rate")) == 6
    # log_samples generates answers at every evaluation, so exact match is scored at each
    matched = client.get_metric_history(run.info.run_id, "eval/exact_match/overall")
    assert sorted(m.step for m in matched) == [0, 3, 6]
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"record.json", "metrics.jsonl", "params.json", "loss_curves.png", "samples"} <= artifacts
    downloaded = Path(client.download_artifacts(run.info.run_id, "record.json", str(tmp_path)))
    assert json.loads(downloaded.read_text()) == json.loads((out_dir / "record.json").read_text())
    # log_samples' files reach the server as artifacts
    sent = sorted(item.path for item in client.list_artifacts(run.info.run_id, "samples"))
    written = sorted(f"samples/{path.name}" for path in (out_dir / "samples").glob("*.jsonl"))
    assert sent == written == [row["samples_file"] for row in rows(out_dir, "eval")] and len(sent) == 3
    downloaded = Path(client.download_artifacts(run.info.run_id, sent[-1], str(tmp_path / "samples")))
    assert downloaded.read_text() == (out_dir / sent[-1]).read_text()


@pytest.mark.slow
def test_a_server_killed_mid_run_only_warns(tmp_path, mlflow_server):
    """The server dies after a few steps: one warning, every step trained, every row in metrics.jsonl. (The
    module's server: no test after this one uses it.)"""
    from mlflow.tracking import MlflowClient

    out_dir = tmp_path / "run"
    steps = 100  # about three seconds: the server dies early in the run
    killed_at: list[int] = []

    def kill_after_three_steps() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            started = (read_tracking(out_dir).get("mlflow") or {}).get("run_id") if out_dir.is_dir() else None
            # The MLflow run may start before the first row is written.
            if started and (out_dir / "metrics.jsonl").is_file() and len(rows(out_dir, "train")) >= 3:
                killed_at.append(len(rows(out_dir, "train")))
                mlflow_server.stop()
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_three_steps, daemon=True)
    killer.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        record = train(run_params(out_dir, max_steps=steps, eval_every_steps=None, exact_match_limit=0,
                                  report_to="mlflow", mlflow_tracking_uri=mlflow_server.url), progress=False)
        elapsed = time.monotonic() - started
    killer.join(5)
    assert killed_at and killed_at[0] < steps, "the server was killed too late to test anything"
    stopped = [w for w in caught if "mlflow tracker stopped" in str(w.message)]
    assert len(stopped) == 1, [str(w.message) for w in caught]
    assert "training goes on" in str(stopped[0].message)
    assert record["schedule"]["steps_done"] == steps and (out_dir / "COMPLETE").is_file()
    assert [r["step"] for r in rows(out_dir, "train")] == list(range(1, steps + 1))
    assert read_tracking(out_dir)["mlflow"]["error"].startswith("mlflow tracker stopped")
    # What the server took before it died is in its store, as metrics.jsonl has it; the run never ended.
    store = MlflowClient(f"sqlite:///{mlflow_server.folder / 'mlflow.db'}")
    run = store.get_run(read_tracking(out_dir)["mlflow"]["run_id"])
    assert run.info.status == "RUNNING"
    losses = {r["step"]: r["loss"] for r in rows(out_dir, "train")}
    for metric in store.get_metric_history(run.info.run_id, "train/loss"):
        assert metric.value == pytest.approx(losses[metric.step])
    # The end of the run waited at most the tracker's bound, not MLflow's minutes of retries.
    assert elapsed < record["timing"]["wall_s"] + 45


def _tensorboard_series(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(s.step, s.value) for s in events.Scalars(tag)]


@pytest.mark.slow
def test_a_run_killed_and_resumed_shows_each_step_once_in_tensorboard(tmp_path):
    out_dir = tmp_path / "run"
    params = run_params(out_dir, max_steps=80, eval_every_steps=None, exact_match_limit=0, save_every_steps=8,
                        report_to="tensorboard")
    code = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(params)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out_dir / "checkpoints" / "step-16").is_dir():
        assert child.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert not (out_dir / "COMPLETE").exists(), "killed too late: the run had finished"
    # What a SIGKILL can cost: events still in the writer's buffer never reach the disk. Here, all of them.
    for events in (out_dir / "tensorboard").glob("events.out.tfevents.*"):
        events.unlink()
    train({**params, "resume": "latest"}, progress=False)
    train_rows = rows(out_dir, "train")
    assert [r["step"] for r in train_rows] == list(range(1, 81))
    assert _tensorboard_series(out_dir / "tensorboard", "train/loss") == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_rows]
    assert [step for step, _ in _tensorboard_series(out_dir / "tensorboard", "eval/loss")] == [0, 80]


# Under DDP rank 0 alone reports: tests/train/test_distributed.py's two-process run reads its TensorBoard events.


def test_trackers_that_cannot_all_start_leave_the_environment_as_it_was(tmp_path, monkeypatch):
    """A tracker failing to start (TensorBoard's folder a file here) ends the ones already started and takes back
    the variables set for the run: a later run in the kernel would take them for the user's own."""
    pytest.importorskip("mlflow")
    from cflib.train.trackers import Trackers

    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    (tmp_path / "tensorboard").write_text("a file where the event folder goes")
    with pytest.raises(OSError):
        Trackers(tmp_path, {}, ["mlflow", "tensorboard"], None, 0)
    assert "MLFLOW_DISABLE_TELEMETRY" not in os.environ
