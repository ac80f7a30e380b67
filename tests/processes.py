"""Finding processes: a run's torchrun workers (kill tests), a test's descendants (nothing left behind)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker_pids(out_dir: Path) -> dict[int, int]:
    """rank -> pid of the live torchrun workers of the run writing to out_dir."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode().split("\0")
            if "cflib.train" not in cmdline or not cmdline[-2].endswith(".json"):
                continue
            if json.loads(Path(cmdline[-2]).read_text())["out_dir"] != str(out_dir):
                continue
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0")
                           if "=" in item)
            found[int(environ["RANK"])] = int(proc.name)
        except (OSError, ValueError, KeyError):
            continue  # not a process of ours, or one that just ended
    return found


def wait_until_gone(out_dir: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while worker_pids(out_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def children_of() -> dict[int, list[int]]:
    """ppid -> pids of the machine's live processes (zombies excluded: they run nothing)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # Fields after the command name, which may hold spaces and parentheses: state, ppid, ...
            state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # not a process, or one that just ended
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(proc.name))
    return children


def descendants(pid: int) -> set[int]:
    """Every live process below pid."""
    children, found, todo = children_of(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def still_running(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    """The pids among `pids` still running (not zombies) after waiting up to timeout_s for them to end."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = {pid for pids_of in children_of().values() for pid in pids_of} & pids
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def train_and_kill(params: dict, out_dir: Path, after_checkpoint: str, whole_group: bool = True) -> None:
    """Train in a child process, as a notebook's kernel would, and SIGKILL it once the checkpoint
    `after_checkpoint` exists: its whole process group, or the launcher alone (`whole_group=False`: its torchrun and
    workers then stop by themselves, its launch folder stays)."""
    code = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(params)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out_dir / "checkpoints" / after_checkpoint).is_dir():
        assert child.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL) if whole_group else os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert wait_until_gone(out_dir), "torchrun workers outlived the killed launcher"
    assert not (out_dir / "record.json").exists(), "killed too late: the run had finished"
