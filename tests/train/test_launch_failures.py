"""A multi-process job that fails names the rank that ended it, and a launch leaves nothing behind in the run folder:
real torchrun processes on CPU (gloo), a rank made to fail at a chosen step through Python's startup hook."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cflib.train import launch_failures, train
from cflib.train.launch_failures import LaunchError
from cflib.train.run_folder import remove_dead_launch_dirs

try:
    from processes import train_and_kill, wait_until_gone
except ImportError:  # run from the repository root as a package
    from tests.processes import train_and_kill, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 0, "device": "cpu", "eval_at_start": False}

# sitecustomize runs as every Python process starts: in the worker of the rank named, step N's train_step ends the
# process as the OOM killer would (SIGKILL) or raises, as a bad batch would. Other processes run untouched.
FAULT_HOOK = '''
import os

if os.environ.get("FAIL_RANK") is not None and os.environ.get("RANK") == os.environ["FAIL_RANK"]:
    import signal

    from cflib.train import trainer

    train_step, at_step = trainer.Trainer.train_step, int(os.environ["FAIL_AT_STEP"])

    def failing_train_step(self, *args, **kwargs):
        if self.step + 1 == at_step:
            if os.environ["FAIL_HOW"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"rank {os.environ['RANK']} found a bad batch at step {at_step}")
        return train_step(self, *args, **kwargs)

    trainer.Trainer.train_step = failing_train_step
'''


@pytest.fixture
def fault(tmp_path, monkeypatch):
    """fault(how, rank, step): the next torchrun job's rank fails so at that step."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))

    def arm(how: str, rank: int, step: int) -> None:
        monkeypatch.setenv("FAIL_HOW", how)
        monkeypatch.setenv("FAIL_RANK", str(rank))
        monkeypatch.setenv("FAIL_AT_STEP", str(step))
    return arm


@pytest.mark.slow
@pytest.mark.parametrize("how, opening", [
    ("sigkill", "rank 1 died: SIGKILL (signal 9) — killed from outside, often the out-of-memory killer"),
    ("exception", "rank 1 failed: ValueError: rank 1 found a bad batch at step 6\nTraceback (most recent call last)"),
], ids=["sigkill", "exception"])
def test_a_failed_job_opens_with_the_rank_that_ended_it_and_cites_no_removed_file(tmp_path, fault, how, opening):
    """Rank 1 dies at step 6 while rank 0 waits in the step's all-reduce: rank 0 then fails on the lost connection
    and torchrun stops it with SIGTERM, which torchrun's own summary may name as the root cause. The error opens
    with rank 1's end, says how rank 0 ended after it, and names no file of the launch folder, which is gone."""
    out_dir = tmp_path / "run"
    fault(how, rank=1, step=6)
    with pytest.raises(LaunchError) as failed:
        train({**BASE, "out_dir": str(out_dir), "nproc_per_node": 2, "max_steps": 100_000,
               "save_checkpoints": False}, progress=False)
    message = str(failed.value)
    assert message.startswith(opening), message[:2000]
    assert "rank 0 ended after it: " in message, message[:2000]
    if how == "exception":
        assert "in failing_train_step" in message  # rank 1's traceback, from its error file
    assert "torchrun exited with code 1; its last lines:" in message
    assert ".torchrun-node" not in message and "error.json" not in message, message
    assert not list(out_dir.glob(".torchrun-*"))
    assert wait_until_gone(out_dir), "orphan workers left behind"


# torchrun's summary of the review's job, rank 0 named as its root cause: its error file (the lost connection)
# was stamped in an earlier whole second than rank 1's SIGKILL, which leaves no error file.
SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
cflib.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-07_07:51:49
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 27363)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 27363
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_07:51:48
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27362)  (SIGTERM)
  error_file: {error_file}
  traceback : Traceback (most recent call last):
    File "cflib/train/step.py", line 255, in forward_backward
  RuntimeError: Read error [127.0.0.1]:48256: Connection reset by peer.
============================================================
"""


def lost_connection_error_file(folder: Path) -> Path:
    """Rank 0's error file as torchrun's @record writes it."""
    error_file = folder / "logs" / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    error = "RuntimeError: Read error [127.0.0.1]:48256: Connection reset by peer."
    error_file.write_text(json.dumps({"message": {"message": error, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  ...\n{error}\n", "timestamp": "1796629908"}}}))
    return error_file


def test_the_error_opens_with_the_rank_that_died_not_the_one_torchrun_names_root_cause(tmp_path):
    launch_dir = tmp_path / "run" / ".torchrun-node0-host-1"
    error_file = lost_connection_error_file(launch_dir)
    summary = SUMMARY.format(error_file=error_file).splitlines(keepends=True)
    failures = launch_failures.read_failures(summary)  # while the launch folder exists
    assert [(f.rank, f.exitcode) for f in failures] == [(1, -9), (0, -15)]
    assert failures[1].error == "RuntimeError: Read error [127.0.0.1]:48256: Connection reset by peer."
    tail = [f"torchrun's log folder: {launch_dir / 'logs'}\n"]
    message = str(launch_failures.launch_error(1, [launch_failures.forget_launch_dir(line, launch_dir) for line in tail], failures))
    assert message.splitlines()[:3] == [
        "rank 1 died: SIGKILL (signal 9) — killed from outside, often the out-of-memory killer (see `dmesg` or the "
        "job's memory limit)",
        "rank 0 ended after it: SIGTERM (signal 15), torchrun stopping the other ranks once one has failed; it had "
        "raised RuntimeError: Read error [127.0.0.1]:48256: Connection reset by peer.",
        "torchrun exited with code 1; its last lines:"]
    assert str(launch_dir) not in message and "log folder: (in the launch folder, removed" in message


def test_a_ranks_own_exception_comes_before_the_lost_connections_it_caused(tmp_path):
    """Both ranks raised; the one whose collective lost its peer raised because of the other, even when its error
    file was written first (the failing rank closes its connections before it records its exception)."""
    lost = lost_connection_error_file(tmp_path / "zero")
    own = tmp_path / "error.json"
    own.write_text(json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\nValueError: bad batch\n", "timestamp": "0"}}}))
    os.utime(lost, (time.time() - 5, time.time() - 5))
    failures = [launch_failures.rank_failure(0, 1, lost), launch_failures.rank_failure(1, 1, own)]
    assert launch_failures.first_cause(failures) is failures[1]
    message = str(launch_failures.launch_error(1, [], failures))
    assert message.startswith("rank 1 failed: ValueError: bad batch\nTraceback (most recent call last):")
    assert launch_failures.first_cause([]) is None and str(launch_failures.launch_error(2, ["last\n"], [])) == (
        "torchrun exited with code 2; its last lines:\nlast\n")  # torchrun failed before any rank did


def ended_pid() -> int:
    """The pid of a process that has ended and been reaped: no process of this host has it (until reused)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.slow  # a child process, to have a pid that ended
def test_remove_dead_launch_dirs_removes_the_folders_of_this_hosts_ended_launchers_only(tmp_path):
    out_dir, host, gone = tmp_path / "run", socket.gethostname(), ended_pid()
    names = {"ended": f".torchrun-node0-{host}-{gone}", "ended, node 1": f".torchrun-node1-{host}-{gone}",
             "running": f".torchrun-node0-{host}-{os.getpid()}", "another host's": f".torchrun-node0-elsewhere-{gone}",
             "not a launcher's": f".torchrun-node0-{host}-{gone}-copy", "the run's": "checkpoints"}
    for name in names.values():
        (out_dir / name / "logs").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("a link in a launch folder's place is unlinked, never followed")
    (out_dir / f".torchrun-node2-{host}-{gone}").symlink_to(outside, target_is_directory=True)

    removed = remove_dead_launch_dirs(out_dir)
    assert removed == sorted([names["ended"], names["ended, node 1"], f".torchrun-node2-{host}-{gone}"])
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        names[k] for k in ("running", "another host's", "not a launcher's", "the run's"))
    assert (outside / "kept").is_file()
    assert remove_dead_launch_dirs(out_dir) == [] and remove_dead_launch_dirs(tmp_path / "none") == []


@pytest.mark.slow  # torchrun, then one process
def test_a_killed_two_process_run_resumed_on_one_process_leaves_no_launch_folder(tmp_path):
    """No torchrun starts when the run resumes on one process, so the run itself removes the killed launcher's
    folder (Trainer._open_run_folder, under the run's lock)."""
    out_dir = tmp_path / "run"
    params = {**BASE, "out_dir": str(out_dir), "nproc_per_node": 2, "max_steps": 30, "save_every_steps": 2}
    train_and_kill(params, out_dir, after_checkpoint="step-2", whole_group=False)
    [left] = out_dir.glob(".torchrun-node0-*")  # the workers' parameters and torchrun's logs
    record = train({**params, "nproc_per_node": 1, "allow_world_size_change": True, "resume": "latest"},
                   progress=False)
    assert record["world_size"] == 1 and record["schedule"]["steps_done"] == 30
    assert record["model_source"].startswith("resumed from")
    assert not left.exists() and not list(out_dir.glob(".torchrun-*"))
