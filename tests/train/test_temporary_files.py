"""A run writes inside its own folder only: nothing of its lm-eval scoring or of its multi-process launch lands in the
system's temporary folder (TMPDIR, here an empty folder of the test's), whether the run ends, its scoring fails or
its launcher is killed mid-run."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sft_shard_helpers import write_shard

from cflib.data.tasks import generate
from cflib.train import train
from cflib.train.lock import RunLockedError, check_not_locked
from cflib.train.task_scores import TaskScorer

try:
    from processes import wait_until_gone
except ImportError:  # run from the repository root as a package
    from tests.processes import wait_until_gone

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed (the eval extra)")

ROOT = Path(__file__).resolve().parents[2]
FAST = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 0, "device": "cpu", "eval_at_start": False}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    """40 train / 8 eval embedded examples, the byte tokenizer named: three steps an epoch."""
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:40], eval_examples[:8], max_seq_len=64)


@pytest.fixture
def temporary(tmp_path, monkeypatch) -> Path:
    """The system's temporary folder, for this process and the ones it starts: an empty folder of the test's."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    # torch's compile cache, shared by every run on purpose, defaults to TMPDIR/torchinductor_<user>; once anything
    # in this process has asked torch for it, torch exports the place to the workers. Named here, so the test does
    # not depend on what ran before it.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-compile-cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.slow  # lm-eval's task registry
@needs_lm_eval
def test_eval_tasks_write_nothing_outside_the_run_even_when_scoring_fails(tmp_path, shard, temporary, monkeypatch):
    import lm_eval

    TaskScorer(("embedded_choice", "embedded_exact"), 2, "byte", None, "cpu")  # what a run holds before step 1
    assert list(temporary.iterdir()) == []  # a run stopped (or killed) before it ends leaves nothing there

    def failing(*args, **kwargs):
        raise RuntimeError("lm-eval stopped mid-scoring")

    monkeypatch.setattr(lm_eval, "simple_evaluate", failing)
    with pytest.raises(RuntimeError, match="lm-eval stopped mid-scoring"):
        train({**FAST, "data": str(shard), "out_dir": str(tmp_path / "run"), "max_steps": None, "epochs": 1,
               "eval_tasks": "embedded_exact", "eval_tasks_every": "epoch", "eval_tasks_limit": 2}, progress=False)
    assert list(temporary.iterdir()) == []
    # the checkpoint's bundle, exported for lm-eval into the run's folder, went with the failure
    assert list((tmp_path / "run" / "eval_tasks" / "epoch-1").iterdir()) == []


def launch_and_kill(params: dict, out_dir: Path) -> None:
    """Train on two ranks from a child process (a notebook's kernel) and SIGKILL it mid-training."""
    code = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(params)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out_dir / "metrics.jsonl").exists():  # mid-training, not mid-start-up
        assert child.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)  # the launcher alone: its torchrun is stopped because its parent died
    child.wait()
    assert wait_until_gone(out_dir), "torchrun workers outlived the killed launcher"
    # A worker leaves /proc's listing as it starts exiting, and holds the run's lock until it has: on a loaded
    # machine that takes longer than the grace a new run gives an exiting holder.
    deadline = time.monotonic() + 60
    while True:
        try:
            check_not_locked(out_dir)
            break
        except RunLockedError:
            assert time.monotonic() < deadline, "the killed run's lock was never released"
            time.sleep(0.2)


@pytest.mark.slow  # torchrun, twice
def test_a_killed_launcher_leaves_nothing_in_the_temporary_folder_and_the_next_launch_replaces_its_own(tmp_path,
                                                                                                       temporary):
    out_dir = tmp_path / "run"
    params = {**FAST, "out_dir": str(out_dir), "nproc_per_node": 2, "max_steps": 100_000, "save_checkpoints": False}
    launch_and_kill(params, out_dir)
    assert list(temporary.iterdir()) == []  # neither the workers' parameters nor torchrun's logs
    [left] = out_dir.glob(".torchrun-node0-*")  # the killed launcher's, named by its host and pid
    assert json.loads((left / "params.json").read_text())["out_dir"] == str(out_dir)  # in the run's folder
    (left / "stale").write_text("what the killed launch left")

    record = train({**params, "max_steps": 2, "resume": "latest"}, progress=False)  # starts the killed run over
    assert record["schedule"]["steps_done"] == 2
    assert list(temporary.iterdir()) == []
    assert not left.exists() and not list(out_dir.glob(".torchrun-*"))  # removed by the next launch, which
    # removed its own when it ended
