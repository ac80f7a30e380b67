"""report_to wandb: an offline W&B run read back by wandb's own transaction-log reader (`wandb leet inspect`)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from cflib.train import train
from cflib.train.records import read_metrics
from cflib.train.trackers import read_tracking

pytest.importorskip("wandb")  # a test extra; the GPU tier's image may lack it


def run_params(out_dir: Path, **overrides) -> dict:
    # The embedded data, 6 steps, held-out loss at 0, 3 and 6 and exact match over 16 prompts at 0 and 6.
    return {"model": "smoke", "out_dir": str(out_dir), "max_steps": 6, "eval_every_steps": 3,
            "exact_match_limit": 16, "device": "cpu", "report_to": "wandb", **overrides}


def rows(out_dir: Path, event: str) -> list[dict]:
    return [row for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == event]


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """W&B offline, its files in the test's folder."""
    folder = tmp_path / "wandb-files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    monkeypatch.setenv("WANDB_PROJECT", "cflib-tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return folder


def offline_runs(folder: Path) -> list[list[dict]]:
    """Every offline run under folder, oldest first, as the records wandb's own reader finds in its .wandb file."""
    runs = []
    for run_dir in sorted((folder / "wandb").glob("offline-run-*")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        runs.append([json.loads(line) for line in out.splitlines() if line.strip()])
    return runs


def history(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["history"]["step"]["num"], r["history"]["item"][key]) for r in records
            if r["type"] == "history" and key in r["history"]["item"]]


def one(records: list[dict], kind: str) -> dict:
    found = [r[kind] for r in records if r["type"] == kind]
    assert len(found) == 1, (kind, found)
    return found[0]


@pytest.mark.slow
def test_an_offline_wandb_run_holds_every_row_the_parameters_and_the_record(tmp_path, offline):
    out_dir = tmp_path / "run"
    record = train(run_params(out_dir), progress=False)
    tracked = read_tracking(out_dir)["wandb"]
    assert tracked["project"] == "cflib-tests" and tracked["mode"] == "offline" and tracked["error"] is None

    [records] = offline_runs(offline)
    run = one(records, "run")
    assert run["run_id"] == tracked["run_id"] and run["project"] == "cflib-tests" and run["display_name"] == "run"
    config = run["config"]["update"]
    assert config["lr"] == pytest.approx(1e-3) and config["max_steps"] == 6 and config["report_to"] == ["wandb"]
    train_rows, eval_rows = rows(out_dir, "train"), rows(out_dir, "eval")
    assert history(records, "train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in train_rows]
    assert history(records, "train/learning_rate") == [(r["step"], pytest.approx(r["lr"])) for r in train_rows]
    assert history(records, "train/tokens_per_s") == [(r["step"], pytest.approx(r["tokens"] / r["seconds"]))
                                                      for r in train_rows]
    assert history(records, "eval/loss") == [(r["step"], pytest.approx(r["loss"])) for r in eval_rows]
    assert [step for step, _ in history(records, "eval/loss")] == [0, 3, 6]
    final = record["eval"]["final"]
    summary: dict = {}
    for update in (r["summary"]["update"] for r in records if r["type"] == "summary"):
        summary.update(update)
    assert summary["eval/loss"] == pytest.approx(final["loss"])
    assert summary["eval/exact_match/overall"] == pytest.approx(final["exact_match"]["overall"])
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert {"record.json", "metrics.jsonl", "params.json"} <= saved
    assert one(records, "exit")["exit_code"] == 0


@pytest.mark.slow
def test_log_samples_reach_wandb_as_tables_and_artifacts(tmp_path, offline):
    out_dir = tmp_path / "run"
    train(run_params(out_dir, log_samples=2), progress=False)
    [records] = offline_runs(offline)
    assert history(records, "eval/samples._type") == [(step, "table-file") for step in (0, 3, 6)]  # every evaluation
    assert [rows for _, rows in history(records, "eval/samples.nrows")] == [2, 2, 2]
    written = sorted((out_dir / "samples").glob("*.jsonl"))
    [run_dir] = (offline / "wandb").glob("offline-run-*")
    table = json.loads((run_dir / "files" / history(records, "eval/samples.path")[-1][1]).read_text())
    columns = table["columns"]
    assert [dict(zip(columns, row)) for row in table["data"]] == [
        json.loads(line) for line in written[-1].read_text().splitlines()]
    artifacts = [r["artifact"] for r in records if r["type"] == "artifact" and r["artifact"]["type"] == "samples"]
    assert sorted(alias for a in artifacts for alias in a["aliases"] if alias.startswith("step-")) == [
        path.stem for path in written]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, offline):
    out_dir = tmp_path / "run"
    params = run_params(out_dir, eval_every_steps=None, exact_match_limit=0, save_every_steps=3)
    train(params, progress=False)
    first_id = read_tracking(out_dir)["wandb"]["run_id"]
    # What a kill after the step-3 checkpoint leaves: no record, no COMPLETE; resuming continues from step 3.
    for name in ("COMPLETE", "record.json"):
        (out_dir / name).unlink()
    train({**params, "resume": "latest"}, progress=False)
    assert read_tracking(out_dir)["wandb"]["run_id"] == first_id

    first, resumed = offline_runs(offline)
    assert one(first, "run")["run_id"] == one(resumed, "run")["run_id"] == first_id
    assert one(resumed, "run").get("resume") is True
    # The first run's file holds steps 4 to 6 already: the resumed run's file leaves them out, so that
    # `wandb sync` of both sends each step once.
    losses = {r["step"]: r["loss"] for r in rows(out_dir, "train")}
    assert history(first, "train/loss") == [(step, pytest.approx(losses[step])) for step in range(1, 7)]
    assert history(resumed, "train/loss") == []


def test_a_wandb_that_cannot_start_only_warns(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "no/slashes")  # wandb.init refuses the name
    out_dir = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = train(run_params(out_dir, max_steps=3, eval_every_steps=None, exact_match_limit=0), progress=False)
    stopped = [str(w.message) for w in caught if "wandb tracker stopped" in str(w.message)]
    assert len(stopped) == 1 and "training goes on" in stopped[0], [str(w.message) for w in caught]
    assert record["schedule"]["steps_done"] == 3 and (out_dir / "COMPLETE").is_file()
    assert [r["step"] for r in rows(out_dir, "train")] == [1, 2, 3]
    assert read_tracking(out_dir)["wandb"]["error"].startswith("wandb tracker stopped")


def own_wandb_service() -> dict[str, str]:
    """The environment for a child process that starts a W&B service of its own: wandb.init leaves
    WANDB_SERVICE in os.environ for children to share the parent's (this test process's, after a test above)."""
    return {name: value for name, value in os.environ.items() if name != "WANDB_SERVICE"}


def wandb_services_of(pid: int) -> list[str]:
    """The W&B service processes a (killed) process started: they outlive a kill of its process group."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"wandb" in command and f"--pid\0{pid}\0".encode() in command:
            found.append(proc.name)
    return found


def cut_after_step(log: Path, step: int) -> None:
    """Cut a .wandb transaction log (a leveldb log of Record protobufs) before its first history row past
    `step`, if it holds one: what a kill costs when W&B's service had not yet written the rest. (It buffers
    its writes, so a killed run's file may hold every row handed to W&B, a part, or none.)"""
    from wandb.proto.wandb_internal_pb2 import Record

    data, at, start, entry = log.read_bytes(), 7, 7, b""
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # block padding
            at += 32768 - at % 32768
            continue
        _, length, kind = struct.unpack_from("<IHB", data, at)
        if kind in (1, 2):  # a whole entry, or the first chunk of one
            start, entry = at, b""
        entry += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = Record.FromString(entry)
            if record.WhichOneof("record_type") == "history" and record.history.step.num > step:
                log.write_bytes(data[:start])
                return


def last_checkpoint(out_dir: Path) -> int:
    steps = [int(path.name.removeprefix("step-")) for path in (out_dir / "checkpoints").glob("step-*")
             if path.name.removeprefix("step-").isdigit()]
    return max(steps, default=-1)


def mlflow_last_step(out_dir: Path) -> int:
    """The last train/loss step the run's SQLite MLflow store holds, read while the run writes it."""
    db = out_dir / "mlruns" / "mlflow.db"
    if not db.is_file():
        return -1
    try:
        with sqlite3.connect(db, timeout=5) as store:
            found = store.execute("SELECT max(step) FROM metrics WHERE key = 'train/loss'").fetchone()
    except sqlite3.Error:  # the tables not made yet
        return -1
    return found[0] if found and found[0] is not None else -1


@pytest.mark.slow
def test_a_run_killed_and_resumed_holds_each_step_once_in_every_tracker(tmp_path, offline):
    """Killed after its step-16 checkpoint or a later one, when MLflow already held steps past it; W&B's file cut
    after step 5. Resumed, TensorBoard, MLflow and the W&B files each hold every row of metrics.jsonl once."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    out_dir = tmp_path / "run"
    # Far more steps than the kill needs: under a loaded machine MLflow's queue lags the steps, and the run must
    # still be going when it holds one past the checkpoint.
    params = run_params(out_dir, max_steps=200, eval_every_steps=8, exact_match_limit=2, log_samples=1,
                        save_every_steps=8, report_to=["tensorboard", "mlflow", "wandb"])
    code = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(params)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, env=own_wandb_service())
    deadline = time.monotonic() + 120
    while not (last_checkpoint(out_dir) >= 16 and mlflow_last_step(out_dir) > last_checkpoint(out_dir)):
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert not (out_dir / "COMPLETE").exists(), "killed too late: the run had finished"
    while wandb_services_of(child.pid):  # its last records written, the W&B service exits
        assert time.monotonic() < deadline, "W&B's service outlived its killed run"
        time.sleep(0.05)
    [killed_log] = (offline / "wandb").glob("offline-run-*/run-*.wandb")
    cut_after_step(killed_log, 5)

    train({**params, "resume": "latest"}, progress=False)
    train_rows, eval_rows = rows(out_dir, "train"), rows(out_dir, "eval")
    assert [r["step"] for r in train_rows] == list(range(1, 201))
    eval_steps = [r["step"] for r in eval_rows]
    assert eval_steps == list(range(0, 201, 8))
    losses = [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_rows]
    eval_losses = [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in eval_rows]

    # W&B: the killed run's file up to step 5 at most, the resumed run's the rest; every samples table once.
    killed, resumed = offline_runs(offline)
    assert len(history(killed, "train/loss")) <= 5
    assert history(killed, "train/loss") + history(resumed, "train/loss") == losses
    assert history(killed, "eval/loss") + history(resumed, "eval/loss") == eval_losses
    assert [step for step, _ in history(killed, "eval/samples._type") + history(resumed, "eval/samples._type")
            ] == eval_steps
    # MLflow: the steps past the checkpoint the killed run sent stay, never sent twice; the loss is the same.
    tracked = read_tracking(out_dir)["mlflow"]
    client = MlflowClient(tracked["tracking_uri"])

    def mlflow_series(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(tracked["run_id"], key))

    assert mlflow_series("train/loss") == losses and mlflow_series("eval/loss") == eval_losses
    assert [step for step, _ in mlflow_series("train/tokens_per_s")] == list(range(1, 201))
    sent = sorted(item.path for item in client.list_artifacts(tracked["run_id"], "samples"))
    assert sent == [r["samples_file"] for r in eval_rows]
    # TensorBoard, read as its web page reads it: the resumed event file hides the killed run's, samples
    # included, and replays them.
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    assert [(t.step, make_ndarray(t.tensor_proto).item()) for t in events.Tensors("train/loss")] == losses
    assert [t.step for t in events.Tensors("eval/samples/text_summary")] == eval_steps


@pytest.mark.slow
def test_a_run_writes_nothing_in_the_home_folder(tmp_path, offline, monkeypatch):
    """W&B's service log and artifact staging, MLflow's telemetry id: in the run folder or nowhere. A fresh
    process, as the libraries write some of these when first imported or started."""
    pytest.importorskip("mlflow")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "MLFLOW_DISABLE_TELEMETRY",
                 "DO_NOT_TRACK", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    out_dir = tmp_path / "run"
    params = run_params(out_dir, max_steps=3, eval_every_steps=3, exact_match_limit=2, log_samples=1,
                        report_to=["tensorboard", "mlflow", "wandb"])
    scoped = ["MLFLOW_DISABLE_TELEMETRY", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"]
    code = ("import json, os, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False); "
            f"print(json.dumps([name for name in {scoped} if name in os.environ]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(params)], capture_output=True, text=True,
                          timeout=300, check=True, env=own_wandb_service())
    assert sorted(str(path.relative_to(home)) for path in home.rglob("*")) == []
    assert (out_dir / "COMPLETE").is_file() and read_tracking(out_dir)["wandb"]["error"] is None
    assert list((out_dir / "wandb" / "cache").rglob("core-debug-*.log"))  # W&B's service log, in the run folder
    assert json.loads(done.stdout.splitlines()[-1]) == []  # set for the run only: the notebook's environment after


@pytest.mark.slow
def test_the_history_reader_finds_the_steps_wandbs_own_reader_finds_and_stops_where_a_kill_cut(offline):
    import wandb

    from cflib.train.wandb_history import wandb_history_steps

    run = wandb.init(project="cflib-tests", dir=str(offline), reinit="create_new")
    for step in (0, 1, 2, 5, 9):
        run.log({"train/loss": float(step)}, step=step)
    run.finish()
    (log,) = (offline / "wandb").glob("offline-run-*/run-*.wandb")
    # On a loaded machine the service may still be writing the file when finish() returns: wait until wandb's
    # own reader finds every row, then read the same bytes with ours.
    deadline = time.monotonic() + 120
    while (theirs := [step for step, _ in history(offline_runs(offline)[0], "train/loss")]) != [0, 1, 2, 5, 9]:
        assert time.monotonic() < deadline, f"wandb's reader found {theirs} in {log}"
        time.sleep(1)
    assert list(wandb_history_steps(log)) == theirs
    cut_after_step(log, 2)
    assert list(wandb_history_steps(log)) == [0, 1, 2]
    log.write_bytes(log.read_bytes()[:-3])  # its last chunk cut short: read up to it, no error
    assert list(wandb_history_steps(log)) in ([0, 1], [0, 1, 2])


@pytest.mark.slow
def test_each_run_of_a_process_keeps_wandbs_service_log_in_its_own_folder(tmp_path, offline, monkeypatch):
    """Two runs in one process (a sweep's points, two runs in a notebook): W&B's service starts with the first run's
    environment and would log the second run too in the first's folder; each run's service is its own. A W&B run the
    user has open keeps its service through a run. A fresh process: W&B's service is per process."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # each run's files in its own folder
        monkeypatch.delenv(name, raising=False)
    runs = [tmp_path / "first", tmp_path / "second", tmp_path / "beside_the_users"]
    params = [run_params(out_dir, max_steps=2, eval_every_steps=2, exact_match_limit=0) for out_dir in runs]
    code = ("import json, os, sys, wandb; from cflib.train import train\n"
            "first, second, third = json.loads(sys.argv[1])\n"
            "train(first, progress=False); train(second, progress=False)\n"
            f"os.environ['WANDB_CACHE_DIR'] = {str(tmp_path / 'users_cache')!r}\n"
            f"users = wandb.init(project='cflib-tests', dir={str(tmp_path)!r}, reinit='create_new')\n"
            "service = os.environ['WANDB_SERVICE']; train(third, progress=False)\n"
            "users.log({'x': 1.0}, step=0); users.finish(); print(os.environ.get('WANDB_SERVICE') == service)")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(params)], capture_output=True, text=True,
                          timeout=300, check=True, env=own_wandb_service())
    ids = [read_tracking(out_dir)["wandb"]["run_id"] for out_dir in runs]
    assert all(read_tracking(out_dir)["wandb"]["error"] is None for out_dir in runs)
    for out_dir, own, other in zip(runs[:2], ids, reversed(ids[:2])):
        (log,) = (out_dir / "wandb" / "cache").rglob("core-debug-*.log")
        assert own in log.read_text() and other not in log.read_text()
    assert not (runs[2] / "wandb" / "cache").exists()  # the user's service logs in the user's WANDB_CACHE_DIR
    assert done.stdout.splitlines()[-1] == "True"  # and still runs after the run beside it
