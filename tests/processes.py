"""Finding a run's torchrun workers among the machine's processes (for kill tests)."""
from __future__ import annotations

import json
import time
from pathlib import Path


def worker_pids(out_dir: Path) -> dict[int, int]:
    """rank -> pid of the live torchrun workers of the run writing to out_dir."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode().split("\0")
            if "cflib.launch" not in cmdline or not cmdline[-2].endswith(".json"):
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
