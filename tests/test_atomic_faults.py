"""A process killed (os._exit, no cleanup runs) before each step of a folder's replacement: the folder, or
the copy a loader falls back to, is always whole; the next start cleans what the kill left."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cflib.atomic import _exchange, clean_leftovers, live_path
from cflib.model.checkpoint import latest_resumable, load_checkpoint, save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel

ROOT = Path(__file__).resolve().parents[1]

# Replaces `target` (a folder of two files, "old") with "new", dying before the `kill_at`-th step of the
# publication: each rename, the exchange, and the removal of what was replaced.
KILLED_REPLACEMENT = """
import os, shutil, sys
from pathlib import Path
import cflib.atomic as atomic

target, kill_at, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
steps = []

def step(fn):
    def wrapped(*args, **kwargs):
        steps.append(fn.__name__)
        if len(steps) == kill_at:
            os._exit(9)
        return fn(*args, **kwargs)
    return wrapped

if mode == "two-renames":
    atomic._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
else:
    atomic._exchange = step(atomic._exchange)
atomic.os.replace = step(os.replace)
atomic.shutil.rmtree = step(shutil.rmtree)
if sys.argv[4] == "checkpoint":
    import torch
    from cflib.model.checkpoint import save_checkpoint
    from cflib.model.config import preset
    from cflib.model.decoder import TRMoEModel
    torch.manual_seed(2)
    save_checkpoint(TRMoEModel(preset("smoke")), target, trainer_state={"step": 2}, progress={"step": 2})
else:
    with atomic.atomic_directory(target) as staging:
        (staging / "a").write_text("new")
        (staging / "b").write_text("new")
print(len(steps))
"""


def replace_and_kill(target: Path, kill_at: int, mode: str, kind: str = "folder") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_REPLACEMENT, str(target), str(kill_at), mode, kind],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def steps_of(mode: str, tmp_path: Path, kind: str = "folder") -> int:
    folder = tmp_path / f"count-{kind}" / "target"
    folder.mkdir(parents=True)
    done = replace_and_kill(folder, 0, mode, kind)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


MODES = ["exchange", "two-renames"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_kill_before_any_step_of_a_replacement_leaves_a_whole_folder(tmp_path, mode):
    if mode == "exchange" and not _exchange_supported(tmp_path):
        pytest.skip("this filesystem cannot exchange two entries in one step")
    steps = steps_of(mode, tmp_path)
    assert steps == (2 if mode == "exchange" else 3)  # exchange + removal; or rename, rename, removal
    for kill_at in range(1, steps + 1):
        parent = tmp_path / f"kill-{kill_at}"
        target = parent / "target"
        target.mkdir(parents=True)
        (target / "a").write_text("old")
        (target / "b").write_text("old")
        killed = replace_and_kill(target, kill_at, mode)
        assert killed.returncode == 9, killed.stderr
        found = live_path(target)
        contents = {(found / "a").read_text(), (found / "b").read_text()}
        assert contents in ({"old"}, {"new"}), f"kill before step {kill_at}: {contents}"
        clean_leftovers(parent)
        assert sorted(p.name for p in parent.iterdir()) == ["target"], f"kill before step {kill_at}"
        assert {(target / "a").read_text(), (target / "b").read_text()} == contents


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_killed_mid_replacement_still_loads_and_resumes(tmp_path, mode):
    if mode == "exchange" and not _exchange_supported(tmp_path):
        pytest.skip("this filesystem cannot exchange two entries in one step")
    old_model = TRMoEModel(preset("smoke"))
    # The same publication as a plain folder's (counted there without importing torch, which is slow to start).
    steps = steps_of(mode, tmp_path)
    for kill_at in range(1, steps + 1):
        checkpoints = tmp_path / f"kill-{kill_at}" / "checkpoints"
        save_checkpoint(old_model, checkpoints / "step-2", trainer_state={"step": 2}, progress={"step": 2})
        killed = replace_and_kill(checkpoints / "step-2", kill_at, mode, "checkpoint")
        assert killed.returncode == 9, killed.stderr
        loaded = load_checkpoint(checkpoints / "step-2")  # the old weights or the new, never none
        assert latest_resumable(checkpoints).name.lstrip(".").startswith("step-2")
        clean_leftovers(checkpoints)
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
        again = load_checkpoint(checkpoints / "step-2").state_dict()
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(again[name], tensor), name


def test_leftovers_of_other_names_are_left_alone(tmp_path):
    (tmp_path / ".record.json.staging-abc12_yz").write_text("{")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".notes.txt").write_text("mine")
    removed = clean_leftovers(tmp_path, targets=("record.json",))
    assert removed == [".record.json.staging-abc12_yz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ipynb_checkpoints", ".notes.txt"]


def _exchange_supported(tmp_path: Path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return _exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


@pytest.mark.slow
def test_a_best_checkpoint_killed_between_its_renames_is_what_export_chat_and_resume_take(tmp_path):
    from cflib.export.hub import resolve_checkpoint
    from cflib.lab.chat import find_checkpoint
    from cflib.train.adapters import checkpoint_config
    from cflib.train.params import TrainParams
    from cflib.train.run import resume_dir

    checkpoints = tmp_path / "run" / "checkpoints"
    save_checkpoint(TRMoEModel(preset("smoke")), checkpoints / "last", trainer_state={"step": 4}, progress={"step": 4})
    save_checkpoint(TRMoEModel(preset("smoke")), checkpoints / "best", trainer_state={"step": 2}, progress={"step": 2})
    # A filesystem without RENAME_EXCHANGE, killed after best/ went aside and before the new one came in.
    killed = replace_and_kill(checkpoints / "best", 2, "two-renames", "checkpoint")
    assert killed.returncode == 9, killed.stderr
    assert not (checkpoints / "best").exists()
    retired = live_path(checkpoints / "best")
    assert retired.name.startswith(".best.old-")
    chosen, why = resolve_checkpoint(tmp_path / "run")
    assert chosen == retired and "best evaluation loss" in why  # not last/: best/ is only aside
    assert find_checkpoint(tmp_path / "run") == retired
    params = TrainParams.from_dict({"model": "smoke", "device": "cpu", "out_dir": str(tmp_path / "run"),
                                    "resume": str(checkpoints / "best")})
    assert resume_dir(params) == retired
    assert checkpoint_config(checkpoints / "best") == preset("smoke")  # what init_checkpoint and the plan read
    clean_leftovers(checkpoints)  # the next run's start puts it back
    assert resolve_checkpoint(tmp_path / "run")[0] == checkpoints / "best"
