"""What every job shares: the folder it writes, the refusal of another job's output there, its record's header
(the measurement protocol's fields), sections whose failure becomes their result instead of the job's end, and a
command line's bad input ending in one line.

torch is imported where a record or a section needs it, not on import: a command line that only reads its
arguments and files (`python -m cflib.lab.nbclean`) starts without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import subprocess
import sys
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator

from cflib import __version__
from cflib.errors import KernelUnavailable, ParamError
from cflib.paths import project_root, resolve_path

if TYPE_CHECKING:
    import torch

FOLDER_STAMP = "%Y%m%d-%H%M%S-%f"  # local time: a person finds today's folders by the clock on the wall
ANYTHING = None  # `holds=ANYTHING`: the job writes only into an empty or new folder


def utc_now() -> str:
    """The moment in UTC, to the second, as every record writes it: `YYYY-MM-DDTHH:MM:SS+00:00`."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_out_dir(kind: str, name: str = "") -> Path:
    """A fresh folder name for a job that was given none: outputs/<kind>/<local time>[-<name>]."""
    stamp = datetime.now().strftime(FOLDER_STAMP)
    return resolve_path(f"outputs/{kind}/{stamp}{'-' + name if name else ''}")


def refuse_existing(folder: Path, holds: Collection[str] | None, what: str,
                    hint: str = "choose another out_dir", label: str = "out_dir") -> None:
    """ParamError when `folder` (the parameter `label`) is a file, or already holds any of `holds` (ANYTHING:
    any entry), which the message calls `what`: no job writes over another's output."""
    if folder.exists() and not folder.is_dir():
        raise ParamError(f"{label} {folder} exists and is not a directory")
    if not folder.is_dir():
        return
    found = sorted(entry.name for entry in folder.iterdir()) if holds is ANYTHING else [
        name for name in holds if os.path.lexists(folder / name)]  # a dangling link would be written through
    if found:
        named = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ParamError(f"{label} {folder} already holds {what} ({named}); {hint}")


def refuse_links(folder: Path, names: Collection[str], label: str = "out_dir") -> None:
    """ParamError naming the first of `names` in `folder` that is a symbolic link: a job writes and deletes only
    inside its own folder, and through such an entry it would change files outside it."""
    for name in names:
        entry = folder / name
        if entry.is_symlink():
            raise ParamError(f"{label} {folder}: {name} is a symbolic link (to {os.readlink(entry)}); a job writes "
                             "and deletes only inside its own folder: replace the link by a copy of what it points "
                             f"to, or choose another {label}")


def job_out_dir(out_dir: str | Path | None, kind: str, holds: Collection[str] | None, what: str,
                name: str = "", hint: str = "choose another out_dir") -> Path:
    """`out_dir` resolved and checked by `refuse_existing`, or `new_out_dir(kind, name)` when None."""
    if out_dir is None:
        return new_out_dir(kind, name)
    folder = resolve_path(out_dir)
    if folder.is_symlink():  # written through, the job would write (and prune) wherever the link points
        raise ParamError(f"out_dir {folder} is a symbolic link (to {os.readlink(folder)}); give the folder itself")
    refuse_existing(folder, holds, what, hint)
    return folder


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def framework_versions() -> dict[str, Any]:
    import torch

    # A copied working tree (a GPU box's) names its commit in CFLIB_COMMIT: its .git, if any, may be stale.
    named = os.environ.get("CFLIB_COMMIT")
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "cflib_commit": named or _git("rev-parse", "HEAD"),
        "cflib_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda_runtime": torch.version.cuda,
        "triton": package_version("triton"),
        "liger_kernel": package_version("liger-kernel"),
        "safetensors": package_version("safetensors"),
        "platform": platform.platform(),
    }


def device_info(device: torch.device, count: int = 1) -> dict[str, Any]:
    """The device model, and how many of them the job used (one per rank)."""
    import torch

    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": count,
                "capability": list(torch.cuda.get_device_capability(device)),
                "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2)}
    return {"type": device.type, "name": platform.processor() or platform.machine(), "count": count,
            "threads": torch.get_num_threads()}


def record_header(job: str, device: torch.device | None = None, out_dir: str | Path | None = None,
                  device_count: int = 1, packages: Collection[str] = (), params: Any = None) -> dict[str, Any]:
    """The fields every record opens with (docs/measuring.md): the job, when (UTC), where it wrote, cflib's
    commit and the software versions (and those of `packages`), the device, and the parameters it ran with."""
    header: dict[str, Any] = {"job": job, "created_utc": utc_now()}
    if out_dir is not None:
        header["out_dir"] = str(out_dir)
    header["framework"] = {"cflib": __version__, **framework_versions(),
                           **{name.replace("-", "_"): package_version(name) for name in packages}}
    if device is not None:
        header["device"] = device_info(device, count=device_count)
    if params is not None:
        header["params"] = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params)
    return header


def error_line(err: BaseException) -> str:
    """The error's type and first line, short enough for a table cell."""
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}"[:500]


def guarded(part: Callable[[], dict]) -> dict:
    """`part()` under `status: ok`, or what stopped it (`skipped`: a kernel this machine cannot run, `oom`,
    `failed`): one section's failure is its result, and the job goes on with the next."""
    import torch

    try:
        return {"status": "ok", **part()}
    except KernelUnavailable as err:
        return {"status": "skipped", "reason": str(err)}
    except torch.cuda.OutOfMemoryError as err:
        return {"status": "oom", "reason": error_line(err)}
    except Exception as err:  # noqa: BLE001 - the section's failure is its result; the others go on
        return {"status": "failed", "reason": error_line(err),
                "traceback_tail": traceback.format_exc(limit=-3)[-2000:]}


@contextlib.contextmanager
def one_line_errors(prog: str, *errors: type[BaseException]) -> Iterator[None]:
    """A command line's body: a ParamError, an OSError or one of `errors` (each message names its culprit) ends
    the process with the one line `prog: message` and exit status 1, not a traceback."""
    try:
        yield
    except (ParamError, OSError, *errors) as err:
        raise SystemExit(f"{prog}: {err}") from None
