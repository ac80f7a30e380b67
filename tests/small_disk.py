"""A real small filesystem for fault tests: a tmpfs of a few MiB, mounted where the test runs as root.

`small_disk(folder, size)` yields the mounted folder, or None where mounting is
not allowed (then the tests inject ENOSPC at the write call instead).
`fill(folder, leave)` writes a ballast file until at most `leave` bytes are free.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[Path | None]:
    """`folder` as a tmpfs mounted with `options`; None where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True).returncode == 0 if shutil.which("mount") else False
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def small_disk(folder: Path, size: str = "16m") -> contextlib.AbstractContextManager[Path | None]:
    return _tmpfs(folder, f"size={size}")


def read_only_folder(folder: Path) -> contextlib.AbstractContextManager[Path | None]:
    """An empty folder on a filesystem mounted read-only; None where mounting is not allowed."""
    return _tmpfs(folder, "ro,size=1m")


def fill(folder: Path, leave: int = 0) -> Path:
    """Take the free space of folder's filesystem, but `leave` bytes."""
    ballast = folder / "ballast"
    free = shutil.disk_usage(folder).free
    with open(ballast, "ab") as handle:
        remaining = max(free - leave, 0)
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while remaining > 0:
                written = handle.write(chunk[:min(remaining, len(chunk))])
                remaining -= written
            handle.flush()
            os.fsync(handle.fileno())
    return ballast
