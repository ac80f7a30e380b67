"""A disk that fills up while a checkpoint is written: a clear error, every checkpoint left loadable, and a
resume that ends with the weights of an uninterrupted run.

The disk is real where the tests may mount a small tmpfs (as root); elsewhere ENOSPC is raised at the write
call, as safetensors raises it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from sft_shard_helpers import task_shard

import cflib.model.checkpoint
import cflib.train.trainer
from cflib.atomic import is_out_of_space
from cflib.model.checkpoint import (
    CheckpointError,
    latest_resumable,
    load_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.train import train

try:
    from small_disk import fill, small_disk
except ImportError:  # run from the repository root as a package
    from tests.small_disk import fill, small_disk


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 16, 4)


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    # 16 examples, 8 per step: every 2 steps an epoch ends (evaluation, best/, epoch-N) and step-N is saved.
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 8, "epochs": 5, "max_steps": 9, "lr": 3e-3, "exact_match_limit": 0, "device": "cpu",
            "eval_at_start": False, "save_every_steps": 2, **overrides}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder).state_dict()


def assert_every_checkpoint_loads(out_dir: Path) -> list[str]:
    checkpoints = out_dir / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert not [n for n in names if n.startswith(".")], f"a failed save left staging behind: {names}"
    for name in names:
        load_checkpoint(checkpoints / name)
    # Every checkpoint the newest resumable one lists (what a resume restores) exists and loads.
    state = load_trainer_state(latest_resumable(checkpoints))
    for name, path in state["checkpoints"].items():
        if name != "best_step":
            assert Path(path).name in names, f"{name} is listed but missing"
    return names


@pytest.fixture
def disk(tmp_path):
    with small_disk(tmp_path / "disk", "24m") as mounted:
        yield mounted


def fail_at(monkeypatch, disk: Path | None, name: str, occurrence: int = 1) -> list[str]:
    """The `occurrence`-th save of checkpoint `name` finds the disk full; returns the names saved so far."""
    real = cflib.train.trainer.save_checkpoint
    calls: list[str] = []

    def save_checkpoint(model, target, *args, **kwargs):
        calls.append(Path(target).name)
        if calls.count(name) == occurrence and Path(target).name == name:
            if disk is not None:
                fill(disk, leave=64 * 1024)  # far less than the checkpoint: the real write runs out
            else:
                def full(*_, **__):
                    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
                monkeypatch.setattr(cflib.model.checkpoint, "save_file", full)
        return real(model, target, *args, **kwargs)

    monkeypatch.setattr(cflib.train.trainer, "save_checkpoint", save_checkpoint)
    return calls


@pytest.mark.parametrize("name, occurrence", [("step-4", 1), ("best", 2)], ids=["step-checkpoint", "best-replaced"])
def test_a_full_disk_stops_clearly_keeps_every_checkpoint_and_resumes_to_the_same_weights(
        tmp_path, shard, disk, monkeypatch, name, occurrence):
    whole = tmp_path / "whole"
    train(params(shard, whole), progress=False)
    out_dir = (disk or tmp_path) / "run"
    calls = fail_at(monkeypatch, disk, name, occurrence)
    with pytest.raises(CheckpointError) as caught:
        train(params(shard, out_dir), progress=False)
    message = str(caught.value)
    assert f"out of disk space writing checkpoint {out_dir / 'checkpoints' / name}" in message, message
    assert "earlier checkpoints are intact" in message
    assert is_out_of_space(caught.value.__cause__)
    assert calls.count(name) == occurrence
    names = assert_every_checkpoint_loads(out_dir)
    assert "best" in names and "step-2" in names
    if name == "best":  # the replacement that failed left the previous best/ whole
        assert names.count("best") == 1
    monkeypatch.undo()
    if disk is not None:
        (disk / "ballast").unlink()
    record = train(params(shard, out_dir, resume="latest"), progress=False)
    assert record["schedule"]["steps_done"] == 9
    assert_every_checkpoint_loads(out_dir)
    for checkpoint in ("last", "best", "epoch-4"):
        mine, reference = weights(out_dir / "checkpoints" / checkpoint), weights(whole / "checkpoints" / checkpoint)
        for tensor in reference:
            torch.testing.assert_close(mine[tensor], reference[tensor], rtol=0, atol=1e-6, msg=f"{checkpoint} {tensor}")


def test_out_of_space_is_recognised_through_every_layer(tmp_path, disk):
    """safetensors raises SafetensorError, torch.save a RuntimeError: neither is an OSError, both are a full disk."""
    if disk is None:
        pytest.skip("needs a small tmpfs (root) for a real full disk")
    model = TRMoEModel(preset("smoke"))
    weights_size = (save_checkpoint(model, tmp_path / "measure") / "model.safetensors").stat().st_size
    fill(disk, leave=16 * 1024)
    with pytest.raises(SafetensorError) as weights_error:
        save_checkpoint(model, disk / "a")
    assert is_out_of_space(weights_error.value)
    (disk / "ballast").unlink()
    fill(disk, leave=weights_size + 128 * 1024)  # the weights fit, the optimizer state does not
    state = {"optimizer": {name: torch.zeros_like(p) for name, p in model.named_parameters()}}
    with pytest.raises(Exception) as state_error:
        save_checkpoint(model, disk / "b", trainer_state=state)
    assert is_out_of_space(state_error.value), repr(state_error.value)
    assert sorted(p.name for p in disk.iterdir()) == ["ballast"]  # no staging left behind
