"""One writer per run folder: an OS file lock (`fcntl.flock`) on `out_dir/.cflib-run.lock`.

The process that writes a run (the single process, or torchrun's rank 0)
holds the lock from before `params.json` until it returns or dies: the
kernel drops a flock with its last descriptor, so a killed run leaves no
stale lock, only a file another run may take. A second run into the same
folder is refused, naming the holder's pid and host. The descriptor is not
inherited by child processes, started or forked, so torchrun workers,
data loader workers or a notebook's other subprocesses never keep a dead
run's folder locked.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from cflib.errors import ParamError
from cflib.jobs import utc_now

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder check of prepare() still refuses a finished run
    fcntl = None

LOCK_FILE = ".cflib-run.lock"

# Folders this process holds: a notebook cell re-run while another still trains (a thread) is told so.
_HELD: dict[Path, "RunLock"] = {}
_GUARD = threading.Lock()


class RunLockedError(ParamError):
    """Another process (or this kernel) is writing the run folder."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that is starting (its pid is not written yet)"
    mine = info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()
    where = f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('since', '?')}"
    return f"this kernel ({where}), which is still running a fit into it" if mine else where


# A killed process keeps its descriptors until the kernel has torn it down (seconds, for one holding a GPU).
EXIT_GRACE_S = 15.0


def _holder_exiting(path: Path) -> bool:
    """True when the recorded holder runs on this host and is gone or on its way out: its memory is released
    (an empty /proc cmdline) before its files are, so its lock is about to go."""
    try:
        info = json.loads(path.read_text() or "{}")
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if info.get("host") != socket.gethostname() or pid == os.getpid():
        return False
    if not Path("/proc/self").is_dir():  # no procfs (macOS): only a pid that no longer exists tells
        return _pid_gone(pid)
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():  # gone, yet the lock is held: by another process sharing its descriptor
        return False
    try:
        return not (proc / "cmdline").read_bytes() or (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _flock_waiting_out_an_exit(descriptor: int, mode: int, path: Path) -> None:
    """flock(mode | LOCK_NB), waiting up to EXIT_GRACE_S while the holder is a process that is exiting."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while True:
        try:
            fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline or not _holder_exiting(path):
                raise
            time.sleep(0.05)


def _refusal(out_dir: Path, holder: str) -> RunLockedError:
    return RunLockedError(f"out_dir {out_dir} is being written by another run: {holder}. Wait for it to end, or "
                          "choose another out_dir; a run that was killed releases the folder by itself")


class RunLock:
    """The exclusive lock on a run folder; `with RunLock(out_dir):` or acquire()/release()."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir).resolve()
        self.path = self.out_dir / LOCK_FILE
        self._descriptor: int | None = None

    def acquire(self) -> "RunLock":
        if fcntl is None:
            return self
        with _GUARD:
            if self.out_dir in _HELD:
                raise _refusal(self.out_dir, _holder(self.path))
            self.out_dir.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                _flock_waiting_out_an_exit(descriptor, fcntl.LOCK_EX, self.path)
            except BlockingIOError:
                os.close(descriptor)
                raise _refusal(self.out_dir, _holder(self.path)) from None
            except BaseException:
                os.close(descriptor)
                raise
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "since": utc_now()}
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(info) + "\n").encode(), 0)
            self._descriptor = descriptor
            _HELD[self.out_dir] = self
        return self

    def release(self) -> None:
        with _GUARD:
            if self._descriptor is None:
                return
            _HELD.pop(self.out_dir, None)
            descriptor, self._descriptor = self._descriptor, None
            os.close(descriptor)  # closing drops the flock; the file stays, free for the next run

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _close_in_forked_child() -> None:
    # A forked child (a data loader worker, a helper) shares the parent's descriptor, and with it the lock:
    # it closes its copy, so the lock ends with the run and not with the last of its children.
    for lock in list(_HELD.values()):
        if lock._descriptor is not None:
            try:
                os.close(lock._descriptor)
            except OSError:
                pass
            lock._descriptor = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


def check_not_locked(out_dir: str | Path) -> None:
    """RunLockedError when a live run holds `out_dir`; writes nothing (prepare's early check)."""
    path = Path(out_dir).resolve() / LOCK_FILE
    if fcntl is None or not path.is_file():
        return
    if path.parent in _HELD:
        raise _refusal(path.parent, _holder(path))
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # unreadable: the exclusive lock taken before the first write decides
    try:
        _flock_waiting_out_an_exit(descriptor, fcntl.LOCK_SH, path)
    except BlockingIOError:
        raise _refusal(path.parent, _holder(path)) from None
    finally:
        os.close(descriptor)
