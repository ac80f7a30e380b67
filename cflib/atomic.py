"""Atomic writes: a reader sees the old file or folder or the new one, never half of either."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, TextIO


def _default_mode(is_dir: bool) -> int:
    # mkstemp/mkdtemp create private (0600/0700) entries; published ones follow the umask like open().
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if is_dir else 0o666) & ~umask


def follow_umask(file: str | Path) -> None:
    """Give `file` the mode open() would have: a library that writes through a private temporary file
    (safetensors' save_file) leaves it 0600, unreadable to the others a shared model folder is meant for."""
    os.chmod(file, _default_mode(is_dir=False))


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


STAGING, RETIRED = "staging", "old"  # hidden names beside a target: `.{target}.{kind}-{suffix}`


# What this module leaves beside a target, and nothing else: `.{target}.staging-{tempfile's 8 random letters}` and
# `.{target}.old-{pid}`. A user's `.{target}.keep/` or an editor's `.{target}.swp` is never taken for a leftover.
LEFTOVER = re.compile(rf"\.(?P<target>.+)\.(?P<suffix>{STAGING}-[a-z0-9_]{{8}}|{RETIRED}-[0-9]+)")


def copy_beside(name: str) -> str | None:
    """The target whose staging or retired copy is called `name` (LEFTOVER), None for any other name."""
    match = LEFTOVER.fullmatch(name)
    return None if match is None else match["target"]


def _hidden(path: Path, kind: str) -> str:
    return f".{path.name}.{kind}-"


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing entries in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc < 2.28, musl)
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # a filesystem that cannot swap
        return False
    raise OSError(error, os.strerror(error), str(a))


def _publish(staging: Path, path: Path) -> None:
    """Put the complete `staging` at `path`, so that at every instant `path`, or its retired copy, is whole."""
    if not path.exists():
        os.replace(staging, path)
        return
    if _exchange(staging, path):  # one step: `path` goes from old to new, the old one now sits at `staging`
        shutil.rmtree(staging, ignore_errors=True)
        return
    # Two renames: in between, only the retired copy exists; `live_path` and `clean_leftovers` bring it back.
    retired = path.with_name(_hidden(path, RETIRED) + str(os.getpid()))
    os.replace(path, retired)
    try:
        os.replace(staging, path)
    except BaseException:
        os.replace(retired, path)
        raise
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a staging folder beside `path`; when the block succeeds it replaces `path`.

    The previous folder is given up only once the new one is complete and on
    disk; when anything fails, `path` is left as it was and the staging folder
    is removed. A kill may leave a hidden `.{name}.staging-*` folder (removed by
    `clean_leftovers`), never a missing `path` without its retired copy.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_hidden(path, STAGING), dir=path.parent))
    try:
        os.chmod(staging, _default_mode(is_dir=True))
        yield staging
        _fsync_tree(staging)  # on disk before the rename makes it visible: a crash leaves old or new
        _publish(staging, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def scratch_folder(path: str | Path) -> Iterator[Path]:
    """A private folder for a command's scratch files, removed when the block ends: hidden beside `path`, named as
    its staging copy, so it stays inside the folder the command writes and what a kill leaves is a leftover
    `clean_leftovers` removes (never the system's temporary folder, which may be small or in memory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=_hidden(path, STAGING), dir=path.parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _retired_copies(path: Path) -> list[Path]:
    return sorted(path.parent.glob(glob.escape(_hidden(path, RETIRED)) + "*")) if path.parent.is_dir() else []


def live_path(path: str | Path) -> Path:
    """`path`, or where a replacement interrupted between its two renames left the previous folder."""
    path = Path(path)
    if path.exists():
        return path
    retired = _retired_copies(path)
    return retired[-1] if retired else path


def clean_leftovers(folder: str | Path, targets: Collection[str] | None = None) -> list[str]:
    """Finish what interrupted replacements in `folder` left: a retired folder whose target is missing goes
    back; staging folders and files, and retired copies whose target exists, are removed. Returns their names.
    Only this module's own hidden names (LEFTOVER) are touched. `targets`: only leftovers of these names (None:
    of any).

    Only for a folder its caller alone writes (a run's, under its lock): a live writer's staging would go too.
    """
    folder = Path(folder)
    removed: list[str] = []
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        match = LEFTOVER.fullmatch(entry.name)
        if match is None or entry.is_symlink():  # anything else beside the target is someone else's
            continue
        target, suffix = match["target"], match["suffix"]
        if targets is not None and target not in targets:
            continue
        if suffix.startswith(RETIRED + "-") and not (folder / target).exists():
            os.replace(entry, folder / target)
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def first_free_name(numbered: Callable[[int], Path]) -> Path:
    """The first of numbered(1), numbered(2), ... that names nothing, not even a dangling link."""
    index = 1
    while os.path.lexists(numbered(index)):
        index += 1
    return numbered(index)


def set_aside(folder: str | Path) -> Path:
    """A folder that will not be continued, renamed beside itself to `NAME.set-aside-N` (never deleted)."""
    folder = Path(folder)
    target = first_free_name(lambda index: folder.with_name(f"{folder.name}.set-aside-{index}"))
    folder.rename(target)
    return target


def check_writable_folder(path: str | Path, what: str, error: type[Exception] = ValueError) -> None:
    """`error` naming `what` unless `path` is, or can be created as, a folder this process may write in.
    Reads only: the nearest existing ancestor must be a writable folder on a filesystem mounted read-write."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise error(f"{what} {path}: {existing} is a file, not a folder, so nothing can be written under it")
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY) if hasattr(os, "statvfs") else False
    if read_only or not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
        raise error(f"{what} {path}: {existing} {why}; choose a folder you can write to")


def check_output_folder(out: str | Path, inputs: dict[str, str | Path | None], error: type[Exception],
                        owned: Callable[[Path], bool] | None = None, overwrite: bool = False,
                        what: str = "out") -> None:
    """`error` unless a command may (re)write the folder `out`: it must not be, contain or lie inside any of
    `inputs` (name -> path); an existing `out` is replaced only with `overwrite` and only when every entry in
    it is one the command wrote itself (`owned`, recognised by the command's own manifest)."""
    out = Path(out)
    target = out.resolve()
    for name, given in inputs.items():
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source:
            raise error(f"{what} {out} is the {name} input itself; write to another folder")
        if source.is_relative_to(target):
            raise error(f"{what} {out} contains the {name} input {given}: replacing the folder would delete it; "
                        "write to another folder")
        if target.is_relative_to(source):
            raise error(f"{what} {out} lies inside the {name} input {given}; write outside it")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise error(f"{what} {out} exists and is not a folder; nothing was changed")
    if out.exists():
        if not overwrite or owned is None:
            hint = " (--overwrite replaces a folder this command wrote)" if owned is not None else ""
            raise error(f"{what} {out} already exists; choose another folder{hint}; nothing was changed")
        foreign = [entry.name for entry in sorted(out.iterdir()) if not owned(entry)]
        if foreign:
            raise error(f"{what} {out} holds {foreign[0]!r}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1
                                                                 else "")
                        + ", which this command did not write: it only replaces a folder of its own output; "
                        "choose another folder; nothing was changed")
    check_writable_folder(out, what, error)


def is_out_of_space(err: BaseException) -> bool:
    """A write that failed for want of disk space or quota, whichever layer raised it: an OSError, or a
    library's own error (safetensors' SafetensorError, torch.save's RuntimeError) carrying the OS message."""
    for link in _chain(err):
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(link)
        if any(sign in text for sign in ("No space left on device", "Disk quota exceeded", "ENOSPC",
                                         "os error 28", "error code: 28")):
            return True
    return False


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


@contextlib.contextmanager
def atomic_file(path: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield a staging file beside `path` for the block to write; when the block succeeds it becomes `path`.

    A reader sees the old file or the new one; a failed or out-of-space write leaves the old one and removes
    the staging file. What is at `path` is replaced, never written through: a symbolic link there is itself
    replaced, so nothing outside the folder changes. `replace=False` publishes only where nothing is at `path`
    yet (FileExistsError otherwise, a dangling link included): a second writer never silently replaces the first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=_hidden(path, STAGING), dir=path.parent)
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
        with open(staging, "rb") as written:  # on disk before the rename makes it visible
            os.fsync(written.fileno())
        os.chmod(staging, _default_mode(is_dir=False))
        if replace:
            os.replace(staging, path)
        else:
            try:
                os.link(staging, path, follow_symlinks=False)  # EEXIST for anything at `path`, a link too
            except FileExistsError:
                raise FileExistsError(errno.EEXIST, f"{path} already exists; it was left as it was") from None
            staging.unlink()
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str, replace: bool = True) -> Path:
    """`text` written to `path` in UTF-8 through `atomic_file`."""
    with atomic_file(path, replace) as staging:
        staging.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(figure: Any, path: str | Path, dpi: int = 120) -> Path:
    """A matplotlib figure saved to `path` through `atomic_file`, in the format its suffix names."""
    path = Path(path)
    with atomic_file(path) as staging:
        figure.savefig(staging, dpi=dpi, format=path.suffix.lstrip(".") or None)
    return path


def write_json_atomic(path: str | Path, document: Any) -> Path:
    """`document` as indented JSON, written to `path` through `atomic_file`."""
    return write_text_atomic(path, json.dumps(document, indent=2, default=str) + "\n")


def open_append(path: str | Path) -> TextIO:
    """`path` opened to append text, created if missing; a symbolic link there is refused (an OSError naming
    it), never followed out of the folder."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link; nothing is written through it") from None
        raise
    return os.fdopen(descriptor, "a")
