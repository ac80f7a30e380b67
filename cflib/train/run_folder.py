"""A run folder as a run writes it, and read back: nothing in it leads outside, nothing of another run's kind is
mixed in, and what it records points into it, wherever the folder has been copied.

A run writes its entries (RUN_ENTRIES) inside its `out_dir` and never through
a symbolic link: a folder whose `checkpoints/` links into another run's would
have a resume prune that run's checkpoints. A folder holds one kind of run:
a single run (params.json, metrics.jsonl, checkpoints/) or a curriculum
(curriculum.json, stages/), never both. A record's paths were written where
the run was: a copied run folder is read with them re-rooted in the copy, and a
path into the original that the copy lacks is refused, never followed. A run
killed before its first resumable checkpoint, continued with `resume: latest`,
starts over with its files set aside in `out_dir/set-aside-N/`.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from cflib.atomic import first_free_name
from cflib.errors import ParamError
from cflib.jobs import refuse_links
from cflib.jsonio import read_json
from cflib.locks import pid_gone
from cflib.model.checkpoint import CheckpointError, latest_resumable
from cflib.train.lock import check_not_locked

# What a single run writes in its out_dir (report_to's trackers and the notebook's bundle and merge included).
SINGLE_RUN_FILES = ("params.json", "metrics.jsonl", "checkpoints", "loss_weighting.json", "trackers.json",
                    "tensorboard", "mlruns")
CURRICULUM_FILES = ("curriculum.json", "stages", "one_stage", "dry_run.json")
# What a run writes in its out_dir besides: its record, the notebook's bundle, merge and evaluation, lm-eval's
# scores of each checkpoint (eval_tasks), log_samples' answers, and W&B's own folder.
RUN_ENTRIES = (*SINGLE_RUN_FILES, *CURRICULUM_FILES, "record.json", "COMPLETE", "hub", "merged", "eval",
               "eval_tasks", "samples", "wandb")
SET_ASIDE = "set-aside"
LAUNCH_DIR = ".torchrun"  # out_dir/.torchrun-node<N>-<host>-<pid>: what a launcher hands torchrun, while the job runs


def check_entries_inside(out_dir: Path) -> None:
    """ParamError naming the first entry a run would write through that is a symbolic link: written or pruned
    through it, a run would change files outside its own folder (a copy's checkpoints/ linking to the original's)."""
    refuse_links(out_dir, RUN_ENTRIES)


def check_run_folder(out_dir: Path, kind: str = "single run") -> None:
    """prepare's first look at out_dir, before anything is read from it: no live run holds it, no entry leads out
    of it, and it holds no run of another kind than `kind`."""
    check_not_locked(out_dir)
    check_entries_inside(out_dir)
    refuse_mixing(out_dir, kind)


def holds_single_run(out_dir: Path) -> bool:
    return any((out_dir / name).exists() for name in SINGLE_RUN_FILES)


def holds_curriculum(out_dir: Path) -> bool:
    return any((out_dir / name).exists() for name in CURRICULUM_FILES)


def refuse_mixing(out_dir: Path, kind: str) -> None:
    """ParamError when `out_dir` holds a run of the other kind than `kind` ("curriculum" or "single run"): the
    second would write its COMPLETE over the first and strand it."""
    if kind == "curriculum" and holds_single_run(out_dir):
        found = next(name for name in SINGLE_RUN_FILES if (out_dir / name).exists())
        raise ParamError(f"out_dir {out_dir} holds a single run ({found}), not a curriculum: a curriculum runs in a "
                         "folder of its own; choose another out_dir, or continue that run without curriculum")
    if kind == "single run" and holds_curriculum(out_dir):
        found = next(name for name in CURRICULUM_FILES if (out_dir / name).exists())
        raise ParamError(f"out_dir {out_dir} holds a curriculum run ({found}): continue it with its curriculum "
                         "(curriculum: FILE, resume: latest), or choose another out_dir")


def starts_over(out_dir: Path) -> bool:
    """Whether `resume: latest` on out_dir starts the run over: it holds a run (not finished) that was killed
    before it wrote a checkpoint it could continue from."""
    if (out_dir / "COMPLETE").exists() or not holds_single_run(out_dir):
        return False
    try:
        latest_resumable(out_dir / "checkpoints")
    except CheckpointError:
        return True
    return False


def set_aside_run(out_dir: Path) -> Path:
    """Move the entries a killed run left in out_dir into a new `out_dir/set-aside-N/` (never deleted)."""
    target = first_free_name(lambda index: out_dir / f"{SET_ASIDE}-{index}")
    target.mkdir()
    for name in RUN_ENTRIES:
        if (out_dir / name).exists() or (out_dir / name).is_symlink():
            os.replace(out_dir / name, target / name)
    return target


def read_run_record(folder: Path, what: str = "run") -> dict[str, Any]:
    """folder/record.json with every path under the out_dir it records re-rooted in `folder`: a copied or moved run
    folder reads as itself, never as the folder it was copied from. A recorded path into the original that the
    copy lacks is refused, naming it."""
    path = folder / "record.json"
    record = read_json(path, ParamError, f"{what} record")
    if not isinstance(record, dict) or not isinstance(record.get("out_dir", ""), str):
        raise ParamError(f"{path}: a {what} record is a JSON object with its out_dir")
    recorded = Path(record.get("out_dir") or folder)
    if recorded.resolve() == folder.resolve():
        return record
    return _rerooted(record, recorded, folder, path)


def _rerooted(value: Any, recorded: Path, folder: Path, source: Path) -> Any:
    if isinstance(value, dict):
        return {key: _rerooted(item, recorded, folder, source) for key, item in value.items()}
    if isinstance(value, list):
        return [_rerooted(item, recorded, folder, source) for item in value]
    if not isinstance(value, str) or not value.startswith(str(recorded)):
        return value
    inside = Path(value)
    if inside != recorded and recorded not in inside.parents:
        return value  # a sibling whose name starts alike (run-2 beside run)
    moved = folder / inside.relative_to(recorded)
    if inside != recorded and not (moved.exists() or moved.is_symlink()) and inside.exists():
        raise ParamError(f"{source} names {inside}, inside the folder this run was copied from ({recorded}), and "
                         f"{moved} is missing here; cflib reads a copied run only inside the copy")
    return str(moved)


def launch_dir_pattern() -> re.Pattern[str]:
    """The name of a launch folder of this host's launchers, any node rank; its pid the group."""
    return re.compile(rf"{re.escape(LAUNCH_DIR)}-node\d+-{re.escape(socket.gethostname())}-(\d+)")


def remove_dead_launch_dirs(out_dir: Path) -> list[str]:
    """Remove the launch folders in out_dir that launchers of this host left when killed, their process gone; the
    names removed. A launch runs this as it starts, and so should a run that resumes on one process, which starts
    no torchrun that would. A running launcher's folder is never touched (its pid is alive, so no lock is needed);
    a link in a folder's place is unlinked, never followed."""
    pattern, removed = launch_dir_pattern(), []
    for left in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        found = pattern.fullmatch(left.name)
        if found and pid_gone(int(found.group(1))):
            left.unlink() if left.is_symlink() or left.is_file() else shutil.rmtree(left, ignore_errors=True)
            removed.append(left.name)
    return removed
