"""report_to wandb: an offline W&B run read back by wandb's own transaction-log reader (`wandb leet inspect`)."""
from __future__ import annotations

import json
import subprocess
import sys
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
    losses = {r["step"]: r["loss"] for r in rows(out_dir, "train")}
    assert history(resumed, "train/loss") == [(step, pytest.approx(losses[step])) for step in (4, 5, 6)]


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
