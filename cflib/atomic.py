"""Atomic writes: a reader sees the old file or folder or the new one, never half of either."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _default_mode(is_dir: bool) -> int:
    # mkstemp/mkdtemp create private (0600/0700) entries; published ones follow the umask like open().
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if is_dir else 0o666) & ~umask


def _fsync_tree(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_file():
            with open(item, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a staging folder beside `path`; when the block succeeds it replaces `path`.

    The previous folder is removed only after the new one is in place; when
    anything fails, `path` is left as it was and the staging folder is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        os.chmod(staging, _default_mode(is_dir=True))
        yield staging
        _fsync_tree(staging)  # on disk before the rename makes it visible: a crash leaves old or new
        retired = None
        if path.exists():
            retired = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, retired)
        try:
            os.replace(staging, path)
        except BaseException:
            if retired is not None:
                os.replace(retired, path)
            raise
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_json_atomic(path: str | Path, document: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(document, out, indent=2, default=str)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(staging, _default_mode(is_dir=False))
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path
