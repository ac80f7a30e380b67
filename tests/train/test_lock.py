"""One writer per run folder: a second run into a folder being written is refused, naming the holder; a killed
run leaves no stale lock; a notebook kernel that re-runs its cells is not locked out by its own earlier run."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sft_shard_helpers import task_shard

import cflib.train.trainer
from cflib.train import TrainParams, prepare, train
from cflib.errors import ParamError
from cflib.train.lock import LOCK_FILE, RunLock, RunLockedError, check_not_locked

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 16, 4)


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 8, "max_steps": 4, "lr": 3e-3, "exact_match_limit": 0, "device": "cpu",
            "eval_at_start": False, "save_every_steps": 1, **overrides}


def start(run_params: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, json.dumps(run_params)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_holder(out_dir: Path, child: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while True:
        try:
            info = json.loads((out_dir / LOCK_FILE).read_text())
            if info.get("pid") == child.pid:
                return info
        except (OSError, ValueError):
            pass
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the run never took its folder"
        time.sleep(0.02)


@pytest.mark.slow
def test_a_second_run_into_a_folder_being_written_is_refused_naming_the_holder(tmp_path, shard):
    out_dir = tmp_path / "run"
    # A long run (many steps, each checkpointed) that holds the folder while this test tries to enter it.
    first = start(params(shard, out_dir, max_steps=400, save_every_steps=1))
    try:
        wait_for_holder(out_dir, first)
        for second in (params(shard, out_dir), params(shard, out_dir, resume="latest")):
            with pytest.raises(RunLockedError) as caught:
                train(second, progress=False)
            message = str(caught.value)
            assert f"pid {first.pid}" in message and f"host {socket.gethostname()}" in message, message
            assert str(out_dir) in message
        deadline = time.monotonic() + 120
        while not (out_dir / "checkpoints" / "step-2").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        os.killpg(first.pid, signal.SIGKILL)  # killed mid-run: the kernel drops its lock with it
        first.wait()
        assert (out_dir / LOCK_FILE).is_file()
        check_not_locked(out_dir)  # no stale lock: the folder is free for the resume
        run = prepare(TrainParams.from_dict(params(shard, out_dir, max_steps=400, save_every_steps=1,
                                                   resume="latest")))
        assert run.resume_state is not None
        RunLock(out_dir).acquire().release()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_trains_the_other_is_refused(tmp_path, shard):
    out_dir = tmp_path / "run"
    runs = [start(params(shard, out_dir, max_steps=40)) for _ in range(2)]
    results = [run.communicate(timeout=300) + (run.returncode,) for run in runs]
    codes = sorted(code for _, _, code in results)
    assert codes[0] == 0 and codes[1] != 0, results
    refused = next(err for _, err, code in results if code != 0)
    # Whichever came second was refused by the lock, or (once the first had finished) by its finished run.
    assert ("being written by another run" in refused and "pid" in refused) or "already holds a run" in refused, refused
    assert json.loads((out_dir / "COMPLETE").read_text())["steps"] == 40


def test_a_notebook_kernel_is_not_locked_out_by_its_own_interrupted_run(tmp_path, shard, monkeypatch):
    out_dir = tmp_path / "run"
    real_step = cflib.train.trainer.Trainer.train_step

    def interrupted(self, units, next_units=None):
        if self.step == 2:
            raise KeyboardInterrupt  # the user pressed stop in JupyterLab
        return real_step(self, units, next_units)

    monkeypatch.setattr(cflib.train.trainer.Trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(params(shard, out_dir), progress=False)
    monkeypatch.undo()
    check_not_locked(out_dir)  # the cell's exception released it
    record = train(params(shard, out_dir, resume="latest"), progress=False)  # the cell re-run
    assert record["schedule"]["steps_done"] == 4


def test_this_kernel_holding_a_folder_is_named_as_the_holder(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunLockedError, match=f"this kernel .*pid {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()
        with pytest.raises(RunLockedError, match="this kernel"):
            check_not_locked(tmp_path / "run")
    RunLock(tmp_path / "run").acquire().release()


@pytest.mark.slow
def test_the_lock_is_not_inherited_by_child_processes(tmp_path):
    """A subprocess outliving its parent (a torchrun worker, a notebook's helper) must not keep the folder."""
    lock = RunLock(tmp_path / "run").acquire()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        lock.release()
        RunLock(tmp_path / "run").acquire().release()
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_lock_is_not_kept_by_a_forked_child(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # a data loader worker, say, that outlives the run
        os.write(started, b"1")  # the fork handlers have run by now
        time.sleep(30)
        os._exit(0)
    try:
        os.read(ready, 1)
        lock.release()
        RunLock(tmp_path / "run").acquire().release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(started)


def test_a_lock_file_that_is_a_symlink_is_refused_and_never_written_through(tmp_path, shard):
    """A run folder handed over with `.cflib-run.lock -> ~/victim.txt`: neither a run nor a resume into it writes
    the victim, and each is refused naming the link, before anything is written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the user's")
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / LOCK_FILE).symlink_to(victim)
    for resume in (None, "latest"):
        with pytest.raises(ParamError, match=rf"{LOCK_FILE} is a symbolic link \(to {victim}\)"):
            train(params(shard, out_dir, resume=resume), progress=False)
    with pytest.raises(ParamError, match="is a symbolic link"):
        RunLock(out_dir).acquire()  # the lock itself, should anything get past the early check
    assert victim.read_text() == "a file of the user's"
    assert sorted(p.name for p in out_dir.iterdir()) == [LOCK_FILE]


def test_a_lock_file_holding_someone_s_text_is_refused_and_kept(tmp_path):
    """A run folder handed over with a `.cflib-run.lock` that is a file of theirs: neither truncated nor written."""
    (tmp_path / LOCK_FILE).write_text("not a lock note")
    with pytest.raises(ParamError, match=rf"{tmp_path / LOCK_FILE} holds something other than a lock holder's note"):
        RunLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == "not a lock note"
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "?"}) + "\n")
    RunLock(tmp_path).acquire().release()  # a note a killed holder left: taken
