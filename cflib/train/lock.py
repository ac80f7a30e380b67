"""One writer per run folder: an OS file lock (`fcntl.flock`, cflib.locks) on `out_dir/.cflib-run.lock`.

The process that writes a run (the single process, or torchrun's rank 0)
holds the lock from before `params.json` until it returns or dies: the
kernel drops a flock with its last descriptor, so a killed run leaves no
stale lock, only a file another run may take. A second run into the same
folder is refused, naming the holder's pid and host. The descriptor is not
inherited by child processes, started or forked, so torchrun workers,
data loader workers or a notebook's other subprocesses never keep a dead
run's folder locked. A lock file that is a symbolic link (to a file someone
wants overwritten) is refused, never followed.
"""
from __future__ import annotations

from pathlib import Path

from cflib.errors import ParamError
from cflib.locks import FileLock, check_free

LOCK_FILE = ".cflib-run.lock"


class RunLockedError(ParamError):
    """Another process (or this kernel) is writing the run folder."""


def _refuser(out_dir: Path):
    def refusal(holder: str) -> RunLockedError:
        return RunLockedError(f"out_dir {out_dir} is being written by another run: {holder}. Wait for it to end, or "
                              "choose another out_dir; a run that was killed releases the folder by itself")
    return refusal


def _bad_lock_file(message: str) -> ParamError:
    return ParamError(f"out_dir: {message}")


class RunLock(FileLock):
    """The exclusive lock on a run folder; `with RunLock(out_dir):` or acquire()/release()."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir).resolve()
        super().__init__(self.out_dir / LOCK_FILE, _refuser(self.out_dir), _bad_lock_file)


def check_not_locked(out_dir: str | Path) -> None:
    """RunLockedError when a live run holds `out_dir`, ParamError when its lock file is a link or not a plain file;
    writes nothing (prepare's early check)."""
    out_dir = Path(out_dir).resolve()
    check_free(out_dir / LOCK_FILE, _refuser(out_dir), _bad_lock_file)
