"""One writer at a time: an OS file lock (`fcntl.flock`) on a lock file, gone with the process that holds it.

The kernel drops a flock with its holder's last descriptor, so a killed holder
leaves no stale lock, only a file the next writer takes. The descriptor is not
inherited by child processes, started or forked. A lock file is opened
without following a symbolic link and must be a plain file, empty or holding
a holder's note: a lock file that someone replaced by a link to a file of
theirs, or a file of theirs that bears its name, is refused, never truncated,
written or removed. `FileLock` is the primitive (cflib.train.lock holds run
folders with it, cflib.lab.sweep sweep folders); `exclusive_output` makes a
command the one writer of the output folder it was given (convert, export,
merge).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from cflib.atomic import atomic_directory, clean_leftovers, is_out_of_space

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder checks made before writing still refuse what they see
    fcntl = None

# A killed process keeps its descriptors until the kernel has torn it down (seconds, for one holding a GPU).
EXIT_GRACE_S = 15.0
HOLDER_BYTES = 4096  # a holder's note is one line of JSON: no more of the file is read

# Lock files this process holds: a second acquire from this process (a notebook cell re-run while another still
# trains in a thread) is told who holds it.
_HELD: dict[Path, "FileLock"] = {}
_GUARD = threading.Lock()


def _open(path: Path, flags: int, error: Callable[[str], Exception]) -> int:
    """A descriptor of the plain file `path`, opened without following a symbolic link."""
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise error(f"{path} is a symbolic link (to {os.readlink(path)}); a lock file is a plain file, and "
                        "cflib never writes through a link: remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise error(f"{path} is not a plain file; a lock file is one: remove it")
    return descriptor


def holder(path: Path) -> str:
    """Who holds the lock, from the note its holder wrote in the file."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            info = json.loads(os.pread(descriptor, HOLDER_BYTES, 0) or b"{}")
        finally:
            os.close(descriptor)
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that is starting (its pid is not written yet)"
    mine = info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()
    where = f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('since', '?')}"
    return f"this kernel ({where}), which is still writing it" if mine else where


def _holder_exiting(path: Path) -> bool:
    """True when the recorded holder runs on this host and is gone or on its way out: its memory is released
    (an empty /proc cmdline) before its files are, so its lock is about to go."""
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as handle:
            info = json.loads(handle.read(HOLDER_BYTES) or b"{}")
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if info.get("host") != socket.gethostname() or pid == os.getpid():
        return False
    if not Path("/proc/self").is_dir():  # no procfs (macOS): only a pid that no longer exists tells
        return pid_gone(pid)
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():  # gone, yet the lock is held: by another process sharing its descriptor
        return False
    try:
        return not (proc / "cmdline").read_bytes() or (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def pid_gone(pid: int) -> bool:
    """Whether no process of this host has `pid` (one of another user's still counts as there)."""
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


class FileLock:
    """The exclusive lock on `path`; `with FileLock(...):` or acquire()/release().

    `refusal(holder)` is the error raised while another holds it, `error` the one for a lock file that is a
    link or not a plain file. `remove`: the file goes with the lock (a lock beside a command's output); else it
    stays, free for the next holder (a run folder's)."""

    def __init__(self, path: str | Path, refusal: Callable[[str], Exception], error: Callable[[str], Exception],
                 remove: bool = False) -> None:
        self.path = Path(path).absolute()
        self.refusal, self.error, self.remove = refusal, error, remove
        self._descriptor: int | None = None

    def acquire(self) -> "FileLock":
        if fcntl is None:
            return self
        with _GUARD:
            if self.path in _HELD:
                raise self.refusal(holder(self.path))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = self._locked_descriptor()
            if not _holds_a_note(descriptor):
                os.close(descriptor)
                raise self.error(f"{self.path} holds something other than a lock holder's note: it may be someone's "
                                 "file, which taking the lock would overwrite; move it, or write elsewhere")
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(info) + "\n").encode(), 0)
            self._descriptor = descriptor
            _HELD[self.path] = self
        return self

    def _locked_descriptor(self) -> int:
        """A descriptor of the lock file with the lock taken; with `remove`, of the file that is still at `path`
        (a holder that removed it on release leaves a lock on a file no name reaches: taken again)."""
        while True:
            descriptor = _open(self.path, os.O_RDWR | os.O_CREAT, self.error)
            try:
                _flock_waiting_out_an_exit(descriptor, fcntl.LOCK_EX, self.path)
                if not self.remove or _same_file(descriptor, self.path):
                    return descriptor
            except BlockingIOError:
                os.close(descriptor)
                raise self.refusal(holder(self.path)) from None
            except BaseException:
                os.close(descriptor)
                raise
            os.close(descriptor)

    def release(self) -> None:
        with _GUARD:
            if self._descriptor is None:
                return
            _HELD.pop(self.path, None)
            descriptor, self._descriptor = self._descriptor, None
            if self.remove:  # while still held: the next holder checks it locked the file at `path`
                with contextlib.suppress(OSError):
                    self.path.unlink()
            os.close(descriptor)  # closing drops the flock

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holds_a_note(descriptor: int) -> bool:
    """Whether the lock file is empty or holds a holder's note (what acquire writes): anything else is a file of
    someone's that happens to bear the lock's name."""
    content = os.pread(descriptor, HOLDER_BYTES + 1, 0)
    if not content:
        return True
    try:
        info = json.loads(content) if len(content) <= HOLDER_BYTES else None
    except ValueError:
        return False
    return isinstance(info, dict) and "pid" in info


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        here, there = os.fstat(descriptor), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def check_free(path: str | Path, refusal: Callable[[str], Exception], error: Callable[[str], Exception]) -> None:
    """`refusal` when a live holder has the lock on `path`, `error` when the lock file is a link or not a plain
    file; reads only (a shared lock taken and dropped at once)."""
    path = Path(path).absolute()
    if fcntl is None or not (path.exists() or path.is_symlink()):
        return
    if path in _HELD:
        raise refusal(holder(path))
    try:
        descriptor = _open(path, os.O_RDONLY, error)
    except PermissionError:
        return  # unreadable: the exclusive lock taken before the first write decides
    try:
        _flock_waiting_out_an_exit(descriptor, fcntl.LOCK_SH, path)
    except BlockingIOError:
        raise refusal(holder(path)) from None
    finally:
        os.close(descriptor)


def _close_in_forked_child() -> None:
    # A forked child (a data loader worker, a helper) shares the parent's descriptor, and with it the lock:
    # it closes its copy, so the lock ends with its holder and not with the last of its children.
    for lock in list(_HELD.values()):
        if lock._descriptor is not None:
            with contextlib.suppress(OSError):
                os.close(lock._descriptor)
            lock._descriptor = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


def output_lock_path(out: Path) -> Path:
    """The lock a command holds while it writes the folder `out`: a hidden file beside it, gone when it ends."""
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def exclusive_output(out: str | Path, check: Callable[[], None], error: type[Exception],
                     what: str = "out") -> Iterator[Path]:
    """A staging folder that replaces `out` when the block succeeds, written as `out`'s only writer.

    Under the lock beside `out`, `check()` gives the verdict on `out` again (another command may have written
    it since it was first checked: it refuses, never silently replaces it), the leftovers of an earlier writer
    killed mid-write are cleaned (only its own hidden staging and retired folders), and the folder is written
    (cflib.atomic.atomic_directory). A second writer while the first holds the lock is refused, naming it; a
    full disk is `error` naming `out`. Nothing else beside `out` is touched."""
    out = Path(out)
    lock = FileLock(output_lock_path(out), error=error, remove=True, refusal=lambda who: error(
        f"{what} {out} is being written by another command ({who}); wait for it to end, or write elsewhere; "
        "nothing was changed"))
    with lock:
        check()
        clean_leftovers(out.parent, targets=(out.name,))  # an earlier writer into `out` killed mid-write
        try:
            with atomic_directory(out) as staging:
                yield staging
        except Exception as err:
            if not is_out_of_space(err):
                raise
            raise error(f"out of disk space writing {out}: nothing was written there (the partial copy was "
                        "removed); free some space and run the command again") from err
