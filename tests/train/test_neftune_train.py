"""NEFTune in real runs on CPU: the plan and the record name it, training steps see the noise and evaluation does not,
each batch carries its examples' own lengths, a resume draws the noise the uninterrupted run drew, bad values stop
the run before step 1."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sft_shard_helpers import task_shard

from cflib.model.checkpoint import save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.neftune import attach_noise
from cflib.train import prepare, train
from cflib.train.held_out import eval_loss
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics
from cflib.train.step import TrainingStep

FAST = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 8, "max_steps": 2, "lr": 3e-3,
        "exact_match_limit": 0, "device": "cpu", "save_checkpoints": False}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 32, 8, seed=3)


def run(tmp_path: Path, shard: Path, name: str, **overrides) -> dict:
    return train({**FAST, "data": str(shard), "out_dir": str(tmp_path / name), **overrides}, progress=False)


def train_losses(out_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train"]


def test_the_record_names_neftune_and_only_training_steps_see_its_noise(tmp_path, shard):
    """The same seed with and without noise: the same held-out loss at step 0 (the same weights, evaluated without
    noise), another training loss from step 1 on; the plan, the run's description and the record name NEFTune and
    its alpha, and the kernel path reads back that the noise ran."""
    plain = run(tmp_path, shard, "plain")
    noisy = run(tmp_path, shard, "noisy", neftune_noise_alpha=5.0)
    assert noisy["eval"]["at_start"]["loss"] == plain["eval"]["at_start"]["loss"]
    assert all(a != b for a, b in zip(train_losses(tmp_path / "noisy"), train_losses(tmp_path / "plain")))
    assert noisy["execution_plan"]["neftune"]["alpha"] == 5.0 and plain["execution_plan"]["neftune"] is None
    assert noisy["kernel_path"]["embedding_noise"] == "neftune" and "embedding_noise" not in plain["kernel_path"]
    assert noisy["params"]["neftune_noise_alpha"] == 5.0
    prepared = prepare(TrainParams.from_dict({**FAST, "data": str(shard), "out_dir": str(tmp_path / "described"),
                                              "neftune_noise_alpha": 5}))
    assert "NEFTune noise alpha 5" in prepared.plan.describe() and prepared.plan.describe() in prepared.describe()


def test_held_out_loss_and_a_second_run_ignore_the_noise(tmp_path, shard):
    """After training, the model still carries its noise module: the held-out loss is the same as with the module
    taken off, and training with the same seed again draws the same noise (the same losses)."""
    params = {**FAST, "data": str(shard), "neftune_noise_alpha": 5.0}
    prepared = prepare(TrainParams.from_dict({**params, "out_dir": str(tmp_path / "a")}))
    step = TrainingStep(prepared)
    model = prepared.model.train()
    order = np.arange(8)
    first = step(order).loss
    scored = eval_loss(model, prepared.eval_data, 4, "cpu")
    assert model.training and model.embedding_noise is not None  # evaluation put the training mode back
    assert scored == eval_loss(attach_noise(model, None), prepared.eval_data, 4, "cpu")
    again = prepare(TrainParams.from_dict({**params, "out_dir": str(tmp_path / "b")}))
    assert TrainingStep(again)(order).loss == first


@pytest.mark.parametrize("pack", [False, True], ids=["dense", "packed"])
def test_each_token_s_length_is_its_example_s_never_the_padded_row_s(tmp_path, shard, pack):
    """L is each example's token count: a dense row's for all its positions (its padding too, unseen by its
    tokens), a packed document's for its tokens and its separator, the window's length for the window's padding."""
    prepared = prepare(TrainParams.from_dict({**FAST, "data": str(shard), "out_dir": str(tmp_path / "run"),
                                              "neftune_noise_alpha": 5.0, "pack_sequences": pack}))
    step, data = TrainingStep(prepared), prepared.train_data
    # The shortest and longest examples (dense), or the first windows (packed)
    units = np.argsort(data.lengths, kind="stable")[[0, 1, -2, -1]] if not pack else np.arange(4)
    batch = step.host_batch(units)
    lengths = batch.example_lengths
    assert lengths.dtype == torch.int32 and lengths.shape == batch.input_ids.shape
    if not pack:
        expected = torch.as_tensor(data.lengths[units], dtype=torch.int32)[:, None].expand_as(lengths)
        assert torch.equal(lengths, expected)
        assert int(lengths.min()) < batch.input_ids.shape[1]  # shorter rows than the padded length
        return
    windows = [prepared.packed.window(int(unit)) for unit in units]
    for row, members in enumerate(windows):
        document_ids = batch.documents.document_ids[row]
        for document, member in enumerate(members):
            assert set(lengths[row][document_ids == document].tolist()) == {int(data.lengths[member])}
        padding = document_ids == len(members)
        assert bool((lengths[row][padding] == 64).all())


def test_off_by_default_and_at_zero(tmp_path, shard):
    for extra in ({}, {"neftune_noise_alpha": 0}, {"neftune_noise_alpha": "None"}):
        prepared = prepare(TrainParams.from_dict({**FAST, "data": str(shard), "out_dir": str(tmp_path / "r"),
                                                  **extra}))
        assert prepared.plan.neftune is None and prepared.model.embedding_noise is None
        assert TrainingStep(prepared).host_batch(np.arange(2)).example_lengths is None


@pytest.mark.parametrize("value, words", [
    (-1.0, "neftune_noise_alpha must be None (off), 0 (off) or a positive number up to 1000"),
    ("nan", "neftune_noise_alpha must be a finite number, got nan"),
    ("inf", "neftune_noise_alpha must be a finite number, got inf"),
    (1e4, "got 10000.0"),
    ("five", "neftune_noise_alpha must be a number"),
], ids=["negative", "nan", "inf", "too-large", "not-a-number"])
def test_a_bad_alpha_stops_the_run_before_anything_is_written(tmp_path, shard, value, words):
    with pytest.raises(ParamError, match="neftune_noise_alpha") as caught:
        run(tmp_path, shard, "bad", neftune_noise_alpha=value)
    assert words in str(caught.value)
    assert not (tmp_path / "bad").exists()


def test_a_killed_run_resumes_to_the_noise_and_weights_of_the_uninterrupted_one(tmp_path, shard):
    """Killed after its step-2 checkpoint, the run resumes with its noise generator's state: its step 3 draws the
    noise the uninterrupted run drew (the same loss), and it ends with the same weights. Another alpha is refused by
    name, unless allow_resume_changes names it."""
    settings = {"neftune_noise_alpha": 5.0, "max_steps": 3, "save_every_steps": 2, "save_checkpoints": True,
                "eval_at_start": False}
    whole = run(tmp_path, shard, "whole", **settings)
    assert whole["schedule"]["steps_done"] == 3
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "whole", killed)
    for name in ("COMPLETE", "record.json"):
        (killed / name).unlink()  # as if killed after the last checkpoint: resume latest continues step-2's
    with pytest.raises(ParamError, match="neftune_noise_alpha 5.0, this run has 2.0.*allow_resume_changes: "
                                         "neftune_noise_alpha"):
        run(tmp_path, shard, "killed", **{**settings, "neftune_noise_alpha": 2.0, "resume": "latest"})
    record = run(tmp_path, shard, "killed", **settings, resume="latest")
    assert "step-2" in record["model_source"]
    assert train_losses(killed) == train_losses(tmp_path / "whole")
    final = {folder: load_file(str(folder / "checkpoints" / "last" / "model.safetensors"))
             for folder in (tmp_path / "whole", killed)}
    for key, tensor in final[tmp_path / "whole"].items():
        torch.testing.assert_close(final[killed][key], tensor, rtol=0, atol=0, msg=key)


def test_a_lora_run_trains_its_adapters_through_the_noise(tmp_path, shard):
    torch.manual_seed(3)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    lora = {"init_checkpoint": str(base), "full_parameter": False, "lora_rank": 4, "lora_trainable_tokens": "65-70",
            "lr": 1e-2}
    plain = run(tmp_path, shard, "plain", **lora)
    noisy = run(tmp_path, shard, "noisy", neftune_noise_alpha=5.0, **lora)
    assert noisy["execution_plan"]["neftune"]["alpha"] == 5.0 and noisy["kernel_path"]["embedding_noise"] == "neftune"
    assert noisy["eval"]["at_start"]["loss"] == plain["eval"]["at_start"]["loss"]
    assert noisy["eval"]["final"]["loss"] != plain["eval"]["final"]["loss"]
    assert train_losses(tmp_path / "noisy")[0] != train_losses(tmp_path / "plain")[0]
