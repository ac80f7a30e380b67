"""Sweeps: every point checked before the first runs, and a real papermill sweep killed mid-point and resumed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from cflib.lab.compare import CompareParams, compare, comparison_table, save_comparison
from cflib.lab.sweep import SweepParams, expand_sweep
from cflib.train.params import ParamError, load_params_file
from cflib.train.records import read_metrics

try:
    from processes import descendants, still_running
    from test_readers import refused_without_waiting
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests.processes import descendants, still_running
    from tests.test_readers import refused_without_waiting

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "notebooks" / "sweep.ipynb"
COMMITTED_SWEEP = ROOT / "outputs" / "records" / "sweep_lr_seeds_cpu"


@pytest.mark.parametrize("raw, message", [
    ({"grid": {"lrr": [1e-3]}}, "grid: unknown parameter 'lrr' (did you mean 'lr'?)"),
    ({"grid": {"lr": 1e-3}}, "grid: lr must be a non-empty list of values, got 0.001"),
    ({"grid": {"out_dir": ["a", "b"]}}, "grid: out_dir is set by the sweep"),
    ({"grid": {"lr": [1e-3]}, "points": [{"lr": 1e-3}]}, "give grid (every combination) or points"),
    ({"points": [{"seed": 1}], "repeats": 2}, "seed is swept and repeats gives several seeds"),
    ({"points": [{"resume": "latest"}]}, "points[0]: resume is set by the sweep"),
    ({"gpus": "0,0"}, "gpus names a device twice"),
    ({"gpus": "first"}, "gpus must be 'cpu' or a list of device indices"),
    ({"repeats": 0}, "repeats must be a number of seeds in [1, 10,000]"),
    ({"repeats": 100_000_000}, "repeats must be a number of seeds in [1, 10,000]"),
    ({"repeats": "9" * 5000}, "repeats must be a number of seeds or a list of at most 10,000 seeds"),
    ({"grid": {"lr": [1e-3] * 100, "seed": list(range(101))}}, "10,100 runs, more than 10,000"),
    ({"base": "params/no_such.yaml"}, "no_such.yaml: no such parameter file"),
    ({"grid": "params/no_such_grid.yaml"}, "is neither a YAML file"),
    ({"metric": "loss"}, "metric 'loss' is not compared"),
    ({"gird": {}}, "unknown parameter 'gird' (did you mean 'grid'?)"),
])
def test_a_bad_sweep_is_refused_naming_the_culprit(raw, message):
    with pytest.raises(ParamError) as caught:
        SweepParams.from_dict(raw)
    assert message in str(caught.value)


def test_every_point_is_checked_before_any_runs_and_a_bad_one_fails_alone(tmp_path):
    out_dir = tmp_path / "sweep"
    sweep = expand_sweep(SweepParams.from_dict({"grid": {"lr": [1e-3, -1.0], "max_steps": [4]}, "repeats": [3, 4],
                                              "out_dir": str(out_dir)}))
    assert [p.name for p in sweep.points] == ["lr-0.001_seed-3", "lr-0.001_seed-4", "lr--1_seed-3", "lr--1_seed-4"]
    assert [p.status for p in sweep.points] == ["queued", "queued", "failed", "failed"]
    assert sweep.points[2].error == "point lr--1_seed-3: lr must be positive and at most 10, got -1.0"
    assert sweep.points[0].params["max_steps"] == 4 and sweep.points[0].params["seed"] == 3
    assert sweep.points[0].overrides == {"lr": 0.001, "max_steps": 4, "seed": 3}
    assert sweep.swept == ["lr", "seed"] and sweep.points[0].total_steps == 4
    assert not out_dir.exists()  # planning writes nothing


def test_grid_from_a_yaml_file_and_points(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("lr: [0.001, 0.002]\nseq_len: [64, 96]\n")
    sweep = expand_sweep(SweepParams.from_dict({"grid": str(grid), "out_dir": str(tmp_path / "a")}))
    assert [p.name for p in sweep.points] == ["lr-0.001_seq_len-64", "lr-0.001_seq_len-96", "lr-0.002_seq_len-64",
                                              "lr-0.002_seq_len-96"]
    listed = expand_sweep(SweepParams.from_dict({"points": [{"lr": 0.001}, {"lr": 0.001, "warmup_ratio": 0.1}],
                                               "out_dir": str(tmp_path / "b")}))
    assert [p.name for p in listed.points] == ["base", "warmup_ratio-0.1"]


def test_a_sweep_varies_the_learning_rate_schedule_like_any_parameter(tmp_path):
    sweep = expand_sweep(SweepParams.from_dict({"points": [
        {"lr_schedule": "cosine", "min_lr_ratio": 0.1}, {"lr_schedule": "wsd", "lr_decay_ratio": 0.2},
        {"lr_schedule": "constant", "min_lr_ratio": 0.1}, {"warmup_steps": 3}], "out_dir": str(tmp_path / "s")}))
    assert [p.name for p in sweep.points] == [
        "lr_schedule-cosine_min_lr_ratio-0.1", "lr_schedule-wsd_lr_decay_ratio-0.2",
        "lr_schedule-constant_min_lr_ratio-0.1", "warmup_steps-3"]
    assert [p.error for p in sweep.points][:2] == [None, None] and sweep.points[3].error is None
    assert "constant never decays" in sweep.points[2].error  # refused before any point runs, alone


def test_a_sweep_over_warmup_steps_on_a_base_with_a_warmup_ratio_takes_the_steps(tmp_path):
    # quickstart.yaml sets warmup_ratio 0.05: each point's warmup_steps wins over it
    sweep = expand_sweep(SweepParams.from_dict({"base": "params/quickstart.yaml", "grid": {"warmup_steps": [2, 5]},
                                                "out_dir": str(tmp_path / "s")}))
    assert [p.name for p in sweep.points] == ["warmup_steps-2", "warmup_steps-5"]
    assert [p.error for p in sweep.points] == [None, None]


# A sweep's base (train_sft's parameters) is validated with every params file (tests/train/test_params.py).
SWEEP_FILES = [path for path in sorted((ROOT / "params").glob("sweep_*.yaml"))
               if {"grid", "points"} & set(load_params_file(path))]


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_params_files_for_the_sweep_notebook_plan_their_points(path):
    sweep = expand_sweep(SweepParams.from_dict({**load_params_file(path), "out_dir": None}, source=str(path)))
    assert sweep.points and all(point.status == "queued" for point in sweep.points)


# Three points of 24 steps, a resumable checkpoint every 4 (the second point is killed once it has saved step 8);
# exact match over 4 prompts.
KILLED_SWEEP_STEPS = 24
KILLED_SWEEP_GRID = {"lr": [0.001, 0.002, 0.003], "max_steps": [KILLED_SWEEP_STEPS], "save_every_steps": [4],
                     "eval_every_steps": [12], "exact_match_limit": [4]}


def _papermill(out_dir: Path, executed: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "papermill", str(SWEEP), str(executed), "-p", "out_dir", str(out_dir),
               "-y", json.dumps({"grid": KILLED_SWEEP_GRID}), "--cwd", str(ROOT / "notebooks"), "--no-progress-bar"]
    with open(log, "w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _stream_text(executed: Path) -> str:
    return "".join(o.get("text", "") for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")


@pytest.mark.slow
def test_a_sweep_killed_in_its_second_point_resumes_to_the_end(tmp_path):
    out_dir = tmp_path / "sweep"
    second = out_dir / "runs" / "lr-0.002"
    process = _papermill(out_dir, tmp_path / "killed.ipynb", tmp_path / "killed.log")
    deadline = time.monotonic() + 400
    while not (second / "checkpoints" / "step-8").is_dir():
        assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the second point never reached its second checkpoint"
        time.sleep(0.05)
    tree = descendants(process.pid) | {process.pid}  # papermill, the sweep's kernel, the point and its kernel
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    assert not still_running(tree), "a process of the killed sweep is still running"
    assert (out_dir / "runs" / "lr-0.001" / "COMPLETE").is_file() and not (second / "COMPLETE").exists()
    assert not (out_dir / "runs" / "lr-0.003").exists()
    killed_at = max(r["step"] for r in read_metrics(second / "metrics.jsonl") if r["event"] == "train")
    assert 8 <= killed_at < KILLED_SWEEP_STEPS
    first_record = (out_dir / "runs" / "lr-0.001" / "record.json").read_text()

    resumed = _papermill(out_dir, tmp_path / "resumed.ipynb", tmp_path / "resumed.log")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    text = _stream_text(tmp_path / "resumed.ipynb")
    assert "lr-0.001: skip: finished before" in text
    assert "lr-0.002: started on cpu (resume from step-" in text and "lr-0.003: started on cpu\n" in text
    assert (out_dir / "runs" / "lr-0.001" / "record.json").read_text() == first_record  # never re-run
    record = json.loads((second / "record.json").read_text())
    assert record["model_source"].startswith(f"resumed from {second / 'checkpoints' / 'step-'}")
    steps = [r["step"] for r in read_metrics(second / "metrics.jsonl") if r["event"] == "train"]
    assert steps == list(range(1, KILLED_SWEEP_STEPS + 1))  # every step once: nothing lost, nothing doubled
    state = json.loads((out_dir / "sweep.json").read_text())
    assert [p["status"] for p in state["points"]] == ["done"] * 3
    assert [a["resumed"] for a in state["points"][1]["attempts"]] == [False, True]
    saved = json.loads((out_dir / "comparison" / "comparison.json").read_text())
    assert [row["run"] for row in saved["rows"]] == ["lr-0.001", "lr-0.002", "lr-0.003"]
    assert saved["differing"] == ["lr"] and saved["swept"] == ["lr"]
    assert {"comparison.csv", "loss_curves.png", "exact_match.png", "sweep.png"} <= {
        p.name for p in (out_dir / "comparison").iterdir()}
    # A third run finds nothing to do.
    again = expand_sweep(SweepParams.from_dict({"out_dir": str(out_dir), "grid": KILLED_SWEEP_GRID}))
    assert [p.action for p in again.points] == ["skip: finished before"] * 3


def test_compare_refuses_an_incomplete_run_by_name(tmp_path):
    run = tmp_path / "killed-run"
    run.mkdir()
    (run / "params.json").write_text(json.dumps({"lr": 0.001}))
    (run / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": 5.0, "tokens": 10}) + "\n"
                                       + json.dumps({"event": "eval", "step": 0, "loss": 5.5}) + "\n")
    out_dir = tmp_path / "comparison"
    with pytest.raises(ParamError, match="run killed-run .* has no complete record: no COMPLETE marker"):
        compare(CompareParams.from_dict({"runs": [str(COMMITTED_SWEEP / "runs" / "lr-0.01_seed-0"), str(run)],
                                         "out_dir": str(out_dir)}))
    assert not out_dir.exists()
    shown = compare(CompareParams.from_dict({"runs": [str(run)], "include_incomplete": "true"}))
    assert shown.rows[0]["complete"] is False and shown.rows[0]["final_eval_loss"] is None  # step 0 is no result
    assert shown.rows[0]["steps"] == 1 and shown.rows[0]["tokens_per_s"] is None
    with pytest.raises(ParamError, match="matches no run folder"):
        compare(CompareParams.from_dict({"runs": str(tmp_path / "nothing-*")}))


def test_a_comparison_refuses_links_in_its_folder_never_writing_through_them(tmp_path):
    out_dir, victim = tmp_path / "comparison", tmp_path / "precious.csv"
    victim.write_text("keep me")
    out_dir.mkdir()
    for name in ("comparison.csv", "comparison.json", "loss_curves.png"):
        (out_dir / name).symlink_to(victim)
    runs = [str(COMMITTED_SWEEP / "runs" / name) for name in ("lr-0.01_seed-0", "lr-0.01_seed-1")]
    with pytest.raises(ParamError, match=r"comparison.csv is a symbolic link \(to .*precious.csv"):
        save_comparison(compare(CompareParams.from_dict({"runs": runs, "out_dir": str(out_dir)})))
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("row, message", [
    ({"event": "train", "loss": 5.0, "tokens": 10}, r"metrics.jsonl:2: this train row's 'step' must be a number, got None"),
    ({"event": "train", "step": 2, "loss": 5.0}, r"metrics.jsonl:2: this train row's 'tokens' must be a number"),
    ({"event": "eval", "step": 2, "loss": "low"}, r"metrics.jsonl:2: this eval row's 'loss' must be a number, got 'low'"),
    ({"event": "eval", "step": True, "loss": 1.0}, r"metrics.jsonl:2: this eval row's 'step' must be a number, got True"),
], ids=["train-without-step", "train-without-tokens", "eval-loss-text", "eval-step-bool"])
def test_compare_refuses_a_metrics_row_without_what_it_reads_naming_file_line_and_key(tmp_path, row, message):
    run = tmp_path / "killed-run"
    run.mkdir()
    (run / "params.json").write_text(json.dumps({"lr": 0.001}))
    (run / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": 5.0, "tokens": 10}) + "\n"
                                       + json.dumps(row) + "\n")
    with pytest.raises(ParamError, match=f"runs: {run / message}"):
        compare(CompareParams.from_dict({"runs": [str(run)], "include_incomplete": "true"}))


@pytest.mark.parametrize("record, message", [
    ("{not json", r"record.json: not valid JSON"),
    ("[" * 50_000 + "]" * 50_000, r"record.json: JSON nested deeper than 64 levels"),
    ("[1, 2]", r"record.json: a run record is a JSON object, got list"),
], ids=["corrupt", "nested-deep", "a-list"])
def test_compare_refuses_a_corrupt_record_by_its_file(tmp_path, record, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "record.json").write_text(record)
    (run / "COMPLETE").write_text("{}")
    with pytest.raises(ParamError, match=message):
        compare(CompareParams.from_dict({"runs": str(run), "out_dir": str(tmp_path / "comparison")}))
    assert not (tmp_path / "comparison").exists()


def test_a_sweep_of_a_hundred_million_repeats_is_refused_before_any_point_is_built():
    start = time.monotonic()
    with pytest.raises(ParamError, match="repeats must be a number of seeds in"):
        expand_sweep(SweepParams.from_dict({"repeats": 100_000_000, "out_dir": None}))
    with pytest.raises(ParamError, match="more than 10,000"):
        expand_sweep(SweepParams.from_dict({"grid": {"lr": [1e-3] * 1000, "seed": list(range(1000))}, "out_dir": None}))
    assert time.monotonic() - start < 10  # generous: the points are counted, not listed


def test_a_folder_holding_only_the_lock_file_is_planned_as_empty_and_another_file_is_refused(tmp_path):
    """A sweep starting beside this one has taken its lock and is writing sweep.json (its staging copy, not yet
    renamed): the plan goes ahead, and the lock refuses it when it runs (below). Any other file is someone's
    output."""
    from cflib.lab.sweep import LOCK_FILE

    out_dir = tmp_path / "sweep"
    out_dir.mkdir()
    (out_dir / LOCK_FILE).write_text("")
    (out_dir / ".sweep.json.staging-k3x9a_2q").write_text("{")
    sweep = expand_sweep(SweepParams.from_dict({"out_dir": str(out_dir), "grid": {"lr": [0.001]}}))
    assert [p.action for p in sweep.points] == ["run"]
    (out_dir / "notes.txt").write_text("mine")
    with pytest.raises(ParamError, match="holds files but no sweep.json"):
        expand_sweep(SweepParams.from_dict({"out_dir": str(out_dir), "grid": {"lr": [0.001]}}))


@pytest.mark.parametrize("planted", ["runs", "point-folder", "point.yaml", "papermill.log", "train_sft.ipynb"])
def test_a_sweep_folder_whose_entries_link_outside_is_refused_before_anything_runs(tmp_path, planted):
    """The sweep writes each point's parameters and log, papermill its notebook, the run its files: a link among
    them would carry those writes out of the sweep's folder."""
    out_dir, outside = tmp_path / "sweep", tmp_path / "outside"
    outside.mkdir()
    params = SweepParams.from_dict({"out_dir": str(out_dir), "grid": {"lr": [0.001]}})
    first = expand_sweep(params)
    first.save()
    point = out_dir / "runs" / first.points[0].name
    if planted == "runs":
        (out_dir / "runs").symlink_to(outside)
    elif planted == "point-folder":
        point.parent.mkdir()
        point.symlink_to(outside)
    else:
        point.mkdir(parents=True)
        (point / planted).symlink_to(outside / planted)  # dangling: a plain open() would create it out there
    with pytest.raises(ParamError, match=r"is a symbolic link \(to .*outside"):
        expand_sweep(params)
    assert list(outside.iterdir()) == []


def test_a_sweep_folder_is_swept_by_one_process_at_a_time(tmp_path):
    """The lock is taken atomically before the first write: a second sweep is refused naming the first, and a plan
    made before another sweep changed the folder is not run on it."""
    from cflib.lab.sweep import sweep_lock
    from cflib.lab.sweep_run import run_sweep

    out_dir = tmp_path / "sweep"
    raw = {"grid": {"lr": [1e-3, -1.0]}, "out_dir": str(out_dir)}  # -1.0 fails its checks: nothing to train
    stale = expand_sweep(SweepParams.from_dict(raw))
    with sweep_lock(out_dir):
        with pytest.raises(ParamError, match=f"out_dir {out_dir} is being swept by another process"):
            expand_sweep(SweepParams.from_dict(raw))
        with pytest.raises(ParamError, match="is being swept by another process"):
            run_sweep(stale)
    sweep = expand_sweep(SweepParams.from_dict({**raw, "grid": {"lr": [-1.0, -2.0]}}))
    run_sweep(sweep)  # both points failed their checks: it writes sweep.json, runs nothing
    assert json.loads((out_dir / "sweep.json").read_text())["points"][0]["status"] == "failed"
    with pytest.raises(ParamError, match="sweep.json changed since this sweep was planned"):
        run_sweep(stale)
    assert sorted(p.name for p in out_dir.iterdir()) == ["sweep.json"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_sweep_json_is_hashed_as_every_json_cflib_reads_bounded_and_from_a_regular_file(tmp_path):
    """run_sweep hashes sweep.json to see that the folder is as it was planned: one past the bound is refused by
    name without being read whole, a FIFO in its place refused rather than waited on or taken for no file."""
    from cflib.jsonio import MAX_BYTES
    from cflib.lab.sweep_run import run_sweep

    out_dir = tmp_path / "sweep"
    plan = expand_sweep(SweepParams.from_dict({"grid": {"lr": [-1.0]}, "out_dir": str(out_dir)}))  # an empty folder
    out_dir.mkdir()
    sweep_file = out_dir / "sweep.json"
    with open(sweep_file, "wb") as big:
        big.truncate(MAX_BYTES + 1)  # sparse: no disk written
    with pytest.raises(ParamError, match=f"{sweep_file}: larger than the {MAX_BYTES:,} bytes cflib reads in a sweep "
                                         "file"):
        run_sweep(plan)
    sweep_file.unlink()
    os.mkfifo(sweep_file)
    assert str(refused_without_waiting(lambda: run_sweep(plan), sweep_file)).startswith(
        f"{sweep_file}: not a regular file (a FIFO)")


@pytest.mark.slow
def test_two_sweeps_started_together_on_one_folder_one_runs_its_points_side_by_side_the_other_is_refused(tmp_path):
    """One sweep in a process of its own, one in this one, released at the same moment: whichever takes the
    folder's lock runs both points at once, one per device slot (gpus: [0, 1], each point with its own
    CUDA_VISIBLE_DEVICES; on this CPU-only machine the base's device: cpu trains them on the CPU); the other is
    refused naming the folder."""
    from cflib.lab.sweep_run import run_sweep

    out_dir, ready, go = tmp_path / "sweep", tmp_path / "ready", tmp_path / "go"
    code = ("import json, sys, time, pathlib\n"
            "from cflib.lab.sweep import SweepParams, expand_sweep\nfrom cflib.lab.sweep_run import run_sweep\n"
            "pathlib.Path(sys.argv[1]).write_text('')\n"
            "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.001)\n"
            "run_sweep(expand_sweep(SweepParams.from_dict(json.loads(sys.argv[3]))), poll_s=0.1)")
    raw = {"grid": {"lr": [0.001, 0.002], "max_steps": [4], "save_every_steps": [None], "eval_every_steps": [None]},
           "gpus": [0, 1], "out_dir": str(out_dir)}
    child = subprocess.Popen([sys.executable, "-c", code, str(ready), str(go), json.dumps(raw)], cwd=ROOT, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():  # its interpreter up, cflib imported
        assert child.poll() is None, child.stderr.read()
        assert time.monotonic() < deadline, "the other sweep's process never got ready"
        time.sleep(0.01)
    go.write_text("")
    try:
        run_sweep(expand_sweep(SweepParams.from_dict(raw)), poll_s=0.1)
        refused_here = None
    except ParamError as err:
        refused_here = str(err)
    code, stderr = child.wait(timeout=600), child.stderr.read()
    refusals = [line for line in (refused_here, stderr.strip().splitlines()[-1] if code else None) if line]
    assert len(refusals) == 1 and code in (0, 1), (refused_here, code, stderr)
    assert "is being swept by another process" in refusals[0], refusals
    state = json.loads((out_dir / "sweep.json").read_text())
    assert [p["status"] for p in state["points"]] == ["done", "done"]
    assert [len(p["attempts"]) for p in state["points"]] == [1, 1]
    first, second = (p["attempts"][0] for p in state["points"])
    assert (first["device"], second["device"]) == ("cuda:0", "cuda:1")
    assert second["started_utc"] <= first["finished_utc"]  # both ran at once
    assert all((out_dir / p["run_dir"] / "COMPLETE").is_file() for p in state["points"])
    assert not (out_dir / "sweep.lock").exists()


BEST_METRIC_RUNS = ROOT / "outputs" / "records" / "best_metric_quickstart_cpu" / "runs"


def test_the_committed_quickstart_keeps_the_checkpoint_with_the_highest_addition_exact_match():
    """The committed quickstart runs: best/ chosen by exact_match/addition (lm-eval scoring every epoch's checkpoint)
    beside the same run choosing by held-out loss; the comparison shows both."""
    comparison = compare(CompareParams.from_dict({"runs": str(BEST_METRIC_RUNS / "*")}))
    rows = {row["run"]: row for row in comparison.rows}
    records = {run.name: run.record for run in comparison.runs}
    by_addition, by_loss = records["best-addition"], records["best-loss"]
    trained = [e for e in by_addition["eval"]["history"] if e["step"] > 0]
    highest = max(trained, key=lambda e: e["exact_match"]["addition"])  # the first of equals, as the run keeps it
    assert by_addition["best_metric"] == {"name": "exact_match/addition", "greater_is_better": True,
                                          "value": highest["exact_match"]["addition"], "step": highest["step"]}
    assert by_addition["checkpoints"]["best_step"] == str(highest["step"])
    lowest = min((e for e in by_loss["eval"]["history"] if e["step"] > 0), key=lambda e: e["loss"])
    assert by_loss["best_metric"]["name"] == "eval_loss" and by_loss["best_metric"]["step"] == lowest["step"]
    assert highest["step"] != lowest["step"]  # where the two choices differ, best/ followed the metric
    assert [e["tag"] for e in trained if "lm_eval" in e] == ["epoch-1", "epoch-2", "epoch-3"]
    assert rows["best-addition"]["best_step"] == highest["step"] and rows["best-loss"]["best_step"] == lowest["step"]
    columns = comparison_table(comparison).splitlines()[0]
    for column in ("best_metric", "best_step", "exact_match/addition", "lm_eval/embedded_exact/exact_match"):
        assert f" {column} " in columns


def test_a_sweep_whose_grid_drops_a_point_is_refused_and_one_that_adds_points_keeps_every_earlier_one(tmp_path):
    out_dir = tmp_path / "sweep"
    first = expand_sweep(SweepParams.from_dict({"grid": {"lr": [0.001, 0.003, 0.01]}, "out_dir": str(out_dir)}))
    first.points[2].attempts.append({"started_utc": "2026-01-01T00:00:00+00:00", "device": "cpu", "resumed": False,
                                     "finished_utc": "2026-01-01T00:00:09+00:00", "seconds": 9.0, "returncode": 0})
    first.save()
    with pytest.raises(ParamError, match=r"sweep.json holds point\(s\) lr-0.01 that this grid .* no longer makes.*"
                                         "new out_dir"):
        expand_sweep(SweepParams.from_dict({"grid": {"lr": [0.001, 0.003, 0.02]}, "out_dir": str(out_dir)}))
    extended = expand_sweep(SweepParams.from_dict({"grid": {"lr": [0.001, 0.003, 0.01, 0.02]},
                                                   "out_dir": str(out_dir)}))
    assert [p.name for p in extended.points] == ["lr-0.001", "lr-0.003", "lr-0.01", "lr-0.02"]
    assert extended.points[2].attempts == first.points[2].attempts


FINISH_GRID = {"lr": [0.01], "max_steps": [2], "eval_every_steps": [None], "save_every_steps": [None],
               "exact_match_limit": [4]}


def _completed_point_whose_notebook_stopped(out_dir: Path):
    """What a sweep killed as its point's run ends leaves: the run COMPLETE (trained here), its executed notebook
    stopped at the training cell (papermill's end_time still null), the attempt open in sweep.json."""
    import yaml

    from cflib.train import train

    sweep = expand_sweep(SweepParams.from_dict({"grid": FINISH_GRID, "out_dir": str(out_dir)}))
    point = sweep.points[0]
    point.run_dir.mkdir(parents=True)
    (point.run_dir / "point.yaml").write_text(yaml.safe_dump(point.params, sort_keys=False))
    point.attempts.append({"started_utc": "2026-01-01T00:00:00+00:00", "device": "cpu", "resumed": False})
    sweep.save()
    train(point.params, progress=False)
    stopped = nbformat.read(ROOT / "notebooks" / "train_sft.ipynb", as_version=4)
    stopped.metadata["papermill"] = {"start_time": "2026-01-01T00:00:01+00:00", "end_time": None, "exception": None}
    nbformat.write(stopped, point.run_dir / "train_sft.ipynb")
    return point.run_dir


def test_a_point_whose_run_completed_but_whose_notebook_stopped_is_finished_not_skipped(tmp_path):
    out_dir = tmp_path / "sweep"
    run_dir = _completed_point_whose_notebook_stopped(out_dir)
    again = expand_sweep(SweepParams.from_dict({"grid": FINISH_GRID, "out_dir": str(out_dir)}))
    point = again.points[0]
    assert point.status == "queued" and point.action.startswith(
        "finish: its run trained to the end (COMPLETE) but its train_sft.ipynb stopped before its last cells")
    assert "resume" not in point.params
    attempt = point.attempts[0]  # closed when the run last wrote its metrics
    assert attempt["interrupted"] is True and attempt["seconds"] > 0
    assert attempt["finished_utc"] > attempt["started_utc"]
    executed = nbformat.read(run_dir / "train_sft.ipynb", as_version=4)
    executed.metadata["papermill"]["end_time"] = "2026-01-01T00:00:09+00:00"  # papermill ran it to the end
    nbformat.write(executed, run_dir / "train_sft.ipynb")
    finished = expand_sweep(SweepParams.from_dict({"grid": FINISH_GRID, "out_dir": str(out_dir)}))
    assert [(p.status, p.action) for p in finished.points] == [("done", "skip: finished before")]


@pytest.mark.slow
def test_a_completed_point_whose_notebook_stopped_runs_only_the_cells_after_training(tmp_path):
    from cflib.lab.sweep_run import run_sweep

    out_dir = tmp_path / "sweep"
    run_dir = _completed_point_whose_notebook_stopped(out_dir)
    record = (run_dir / "record.json").read_text()
    metrics = (run_dir / "metrics.jsonl").read_text()
    sweep = run_sweep(expand_sweep(SweepParams.from_dict({"grid": FINISH_GRID, "out_dir": str(out_dir)})), poll_s=0.1)
    assert [p.status for p in sweep.points] == ["done"], sweep.points[0].error
    assert (run_dir / "hub" / "config.json").is_file() and (run_dir / "loss_curves.png").is_file()
    assert (run_dir / "record.json").read_text() == record and (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "train_sft.stopped-1.ipynb").is_file()  # the training's notebook, kept
    executed = nbformat.read(run_dir / "train_sft.ipynb", as_version=4)
    assert executed.metadata["papermill"]["end_time"] and not executed.metadata["papermill"]["exception"]
    attempts = json.loads((out_dir / "sweep.json").read_text())["points"][0]["attempts"]
    assert [a.get("finished_cells_only", False) for a in attempts] == [False, True]
    assert attempts[0]["interrupted"] and attempts[1]["returncode"] == 0
