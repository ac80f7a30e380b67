"""A longer context in fine-tuning: rope_scaling (and rope_theta, max_position_embeddings) on the starting checkpoint,
training past its positions, the scaling in every checkpoint and record, what is refused before step 1."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from sft_shard_helpers import TOKENIZER, write_shard

from cflib.data.shards import Example
from cflib.export.peft import peft_base
from cflib.model import TRMoEModel, load_checkpoint, preset, save_checkpoint
from cflib.train import prepare, train
from cflib.train.params import ParamError, TrainParams
from cflib.train.positions import run_config

LINEAR_2 = {"rope_type": "linear", "factor": 2.0}
# As every checkpoint of a run that sets LINEAR_2 on the smoke model carries it: the positions before scaling named.
LINEAR_2_OF_256 = {**LINEAR_2, "original_max_position_embeddings": 256}


def long_example(index: int, length: int) -> Example:
    """A reverse-the-string chat of about 2 x `length` tokens."""
    text = "".join(random.Random(index).choice("abcdefghij") for _ in range(length))
    input_ids, labels = TOKENIZER.encode_chat(f"reverse {text}", text[::-1])
    return Example(input_ids, labels, {"example_id": f"long-{index:03d}", "task": "reverse"})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The smoke model's checkpoint: 256 positions."""
    torch.manual_seed(0)
    return save_checkpoint(TRMoEModel(preset("smoke")), tmp_path_factory.mktemp("base") / "ckpt")


@pytest.fixture(scope="module")
def long_shard(tmp_path_factory) -> Path:
    """Examples of 300 to 400 tokens: every one longer than the base's positions."""
    examples = [long_example(i, 140 + 6 * i) for i in range(10)]
    return write_shard(tmp_path_factory.mktemp("long"), examples[:8], examples[8:], max_seq_len=512)


def params(base: Path, shard: Path, out_dir: Path, **overrides) -> dict:
    return {"init_checkpoint": str(base), "data": str(shard), "out_dir": str(out_dir), "seq_len": 512,
            "micro_batch_per_rank": 2, "global_batch": 4, "max_steps": 3, "lr": 3e-3, "exact_match_limit": 0,
            "eval_at_start": False, "save_every_steps": 2, "device": "cpu", **overrides}


@pytest.fixture(scope="module")
def scaled_run(base, long_shard, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("scaled") / "run"
    train(params(base, long_shard, out_dir, rope_scaling=LINEAR_2), progress=False)
    (out_dir / "COMPLETE").unlink()  # as if killed after its last checkpoint: its step-2 checkpoint resumes
    return out_dir


def test_a_run_extends_its_checkpoint_s_context_and_every_checkpoint_carries_the_scaling(scaled_run, base):
    record = json.loads((scaled_run / "record.json").read_text())
    assert record["data"]["max_seq_len"] > 256  # trained past the base's positions
    assert record["model_config"]["rope_scaling"] == LINEAR_2_OF_256  # the positions before scaling filled in
    assert record["model_config"]["max_position_embeddings"] == 512  # 256 x factor 2
    assert json.loads((scaled_run / "params.json").read_text())["rope_scaling"] == LINEAR_2
    losses = [row["loss"] for row in map(json.loads, (scaled_run / "metrics.jsonl").read_text().splitlines())
              if row.get("event") == "train"]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    for checkpoint in ("step-2", "last"):
        config = json.loads((scaled_run / "checkpoints" / checkpoint / "config.json").read_text())
        assert (config["rope_scaling"], config["max_position_embeddings"]) == (LINEAR_2_OF_256, 512)
    trained = load_checkpoint(scaled_run / "checkpoints" / "last")
    assert trained.config.rope_scaling == LINEAR_2_OF_256
    torch.testing.assert_close(trained.inv_freq, load_checkpoint(base).inv_freq / 2, rtol=0, atol=0)


def test_a_new_run_from_the_scaled_checkpoint_keeps_its_scaling_and_says_so(scaled_run, long_shard, tmp_path):
    run = prepare(TrainParams.from_dict(params(scaled_run / "checkpoints" / "last", long_shard, tmp_path / "next")))
    assert run.model.config.rope_scaling == LINEAR_2_OF_256 and run.model.config.max_position_embeddings == 512
    assert ("positions    512 positions, rope_scaling rope_type linear, factor 2.0, original_max_position_embeddings "
            "256, rope_theta 10000") in run.describe()


def test_a_resume_keeps_the_scaling_and_refuses_another_unless_allowed(scaled_run, base, long_shard):
    resumed = params(base, long_shard, scaled_run, resume=str(scaled_run / "checkpoints" / "step-2"))
    # unset: the checkpoint's; named as the run first named it, the same
    assert prepare(TrainParams.from_dict(resumed)).model.config.rope_scaling == LINEAR_2_OF_256
    assert prepare(TrainParams.from_dict({**resumed, "rope_scaling": LINEAR_2})).model.config.rope_scaling == \
        LINEAR_2_OF_256
    with pytest.raises(ParamError, match=r"written with rope_scaling \{'rope_type': 'linear', 'factor': 2.0, "
                                         r"'original_max_position_embeddings': 256\}, this run has \{'rope_type': "
                                         r"'linear', 'factor': 4.0, 'original_max_position_embeddings': 256\}.*"
                                         r"allow_resume_changes: rope_scaling"):
        prepare(TrainParams.from_dict({**resumed, "rope_scaling": {"rope_type": "linear", "factor": 4}}))
    run = prepare(TrainParams.from_dict({**resumed, "rope_scaling": {"rope_type": "linear", "factor": 4},
                                         "allow_resume_changes": "rope_scaling"}))
    assert run.model.config.rope_scaling["factor"] == 4.0 and run.model.config.max_position_embeddings == 1024


@pytest.mark.parametrize("overrides, message", [
    ({}, "seq_len 512 exceeds the model's max_position_embeddings 256: to train on longer sequences, extend its "
         "context with rope_scaling, e.g. rope_scaling: {rope_type: linear, factor: 2} (512 positions)"),
    ({"seq_len": 768, "max_steps": 1, "rope_scaling": LINEAR_2},
     "seq_len 768 exceeds the 512 positions of the model this run trains (max_position_embeddings; rope_scaling "
     "covers 256 positions before scaling x factor 2): raise rope_scaling's factor to 3 or more"),
    ({"rope_scaling": LINEAR_2, "max_position_embeddings": 1024},
     "max_position_embeddings 1,024 is more than the 512 positions rope_scaling covers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096}, "seq_len": 8192},
     "rope_scaling.original_max_position_embeddings 4,096 is not the 256 positions the starting model took before "
     "any RoPE scaling (its max_position_embeddings): leave it unset, which fills in 256, or set 256"),
    ({"rope_scaling": LINEAR_2, "full_parameter": False},
     "rope_scaling, max_position_embeddings would change the positions of the frozen base"),
], ids=["no-scaling", "factor-too-small", "more-positions-than-covered", "yarn-original-not-the-start-s", "lora"])
def test_settings_that_cannot_train_are_refused_before_anything_is_written(base, long_shard, tmp_path, overrides,
                                                                           message):
    with pytest.raises(ParamError) as caught:
        prepare(TrainParams.from_dict(params(base, long_shard, tmp_path / "run", **overrides)))
    assert message in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_a_curriculum_extends_the_context_stage_by_stage(base, long_shard, tmp_path):
    """Each stage starts from the one before it: a later stage's larger factor scales the base's positions."""
    curriculum = tmp_path / "c.yaml"
    curriculum.write_text(yaml.safe_dump({"version": 1, "stages": [
        {"name": "twice", "rope_scaling": LINEAR_2},
        {"name": "four-times", "rope_scaling": {"rope_type": "linear", "factor": 4}, "seq_len": 1024},
        {"name": "too-long", "seq_len": 2048}]}))
    record = train(params(base, long_shard, tmp_path / "dry", curriculum=str(curriculum), dry_run=True),
                   progress=False)
    rows = {row["stage"]: row for row in record["stages"]}
    assert rows["twice"]["max_position_embeddings"] == 512 and rows["four-times"]["max_position_embeddings"] == 1024
    assert "seq_len 2,048 exceeds the model's max_position_embeddings 1,024" in rows["too-long"]["error"]


def test_lora_adapters_on_a_scaled_checkpoint_name_it_as_their_base(scaled_run, long_shard, tmp_path):
    """Adapters train on a checkpoint that carries the scaling (naming the same scaling changes nothing), and name
    that checkpoint as their base: PEFT loads it with its config.json, rope_scaling included."""
    scaled = scaled_run / "checkpoints" / "last"
    run = prepare(TrainParams.from_dict(params(scaled, long_shard, tmp_path / "lora", full_parameter=False,
                                               rope_scaling=LINEAR_2)))
    base_model, _ = peft_base(run.lora.base)
    assert Path(base_model) == scaled.resolve() and run.lora.base["config"]["rope_scaling"] == LINEAR_2_OF_256
    assert run.model.config.rope_scaling == LINEAR_2_OF_256 and run.model.config.max_position_embeddings == 512


def positions(start, **overrides):
    """The config a run of `overrides` on `start` trains (cflib.train.positions.run_config): nothing loaded."""
    return run_config(start, TrainParams.from_dict({"model": "smoke", "seq_len": 64, **overrides}))


def test_yarn_s_original_positions_are_filled_in_from_the_start_and_any_other_is_refused():
    """YaRN's ramp is computed around original_max_position_embeddings: a run leaving it unset gets the starting
    model's positions; naming another length is refused, not trained on a ramp around the wrong length."""
    smoke = preset("smoke")
    config = positions(smoke, rope_scaling={"rope_type": "yarn", "factor": 4}, seq_len=1024)
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert config.max_position_embeddings == 1024
    named = {"rope_type": "llama3", "factor": 4, "original_max_position_embeddings": 256, "low_freq_factor": 1,
             "high_freq_factor": 4}
    assert positions(smoke, rope_scaling=named, seq_len=1024).max_position_embeddings == 1024
    with pytest.raises(ParamError, match=r"rope_scaling\.original_max_position_embeddings 4,096 is not the 256 "):
        positions(smoke, rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096},
                  seq_len=8192)
    # on a scaled start, the positions it took before its scaling, as a checkpoint names them
    scaled = positions(smoke, rope_scaling=LINEAR_2, seq_len=512)
    assert positions(scaled, rope_scaling={"rope_type": "yarn", "factor": 4}, seq_len=1024).rope_scaling[
        "original_max_position_embeddings"] == 256
    with pytest.raises(ParamError, match=r"not the 256 positions .* \(its rope_scaling's "
                                         r"original_max_position_embeddings\)"):
        positions(scaled, rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512})


def test_a_linear_checkpoint_names_its_positions_before_scaling_and_a_later_factor_scales_those():
    """A run's linear scaling carries original_max_position_embeddings, so a checkpoint trained at fewer positions
    than its factor covers still says how many it had before scaling; one that names none is read as
    max_position_embeddings / factor, and a run may say otherwise."""
    smoke = preset("smoke")
    four = positions(smoke, rope_scaling={"rope_type": "linear", "factor": 4}, max_position_embeddings=512,
                     seq_len=512)
    assert four.rope_scaling == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 256}
    eight = positions(four, rope_scaling={"rope_type": "linear", "factor": 8}, seq_len=2048)
    assert (eight.max_position_embeddings, eight.rope_scaling["original_max_position_embeddings"]) == (2048, 256)
    # A checkpoint from elsewhere whose linear scaling keeps max_position_embeddings at its original length
    elsewhere = dataclasses.replace(smoke, rope_scaling={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(ParamError, match=r"rope_scaling covers 64 positions before scaling x factor 8.*read as its "
                                         r"max_position_embeddings / factor.*original_max_position_embeddings"):
        positions(elsewhere, rope_scaling={"rope_type": "linear", "factor": 8}, seq_len=2048)
    named = positions(elsewhere, rope_scaling={"rope_type": "linear", "factor": 8,
                                               "original_max_position_embeddings": 256}, seq_len=2048)
    assert named.max_position_embeddings == 2048


def test_more_positions_than_the_rope_covers_is_refused_whatever_set_the_scaling():
    """A scaling the start carries bounds max_position_embeddings as one the run sets does; plain RoPE takes no
    more than the start's positions unless the run raises rope_theta."""
    smoke = preset("smoke")
    four = positions(smoke, rope_scaling={"rope_type": "linear", "factor": 4}, seq_len=1024)
    with pytest.raises(ParamError, match=r"max_position_embeddings 100,000 is more than the 1,024 positions "
                                         r"rope_scaling covers \(256 positions before scaling x factor 4"):
        positions(four, max_position_embeddings=100_000, seq_len=100_000)
    with pytest.raises(ParamError, match=r"max_position_embeddings 4,096 is more than the starting model's 256 "
                                         r"positions.*rope_scaling.*rope_theta"):
        positions(smoke, max_position_embeddings=4096, seq_len=4096)
    assert positions(smoke, max_position_embeddings=4096, seq_len=4096, rope_theta=1e6).max_position_embeddings \
        == 4096
    with pytest.raises(ParamError, match=r"rope_theta 10000 does not raise the starting model's 10000"):
        positions(smoke, max_position_embeddings=4096, seq_len=4096, rope_theta=1e4)
    # a start trained at fewer positions than its scaling covers: seq_len up to them, naming max_position_embeddings
    short = positions(smoke, rope_scaling={"rope_type": "linear", "factor": 4}, max_position_embeddings=512,
                      seq_len=512)
    with pytest.raises(ParamError, match=r"seq_len 1,024 exceeds the model's max_position_embeddings 512: its "
                                         r"rope_scaling covers 1,024 positions.*set max_position_embeddings: 1024"):
        positions(short, seq_len=1024)
    assert positions(short, seq_len=1024, max_position_embeddings=1024).max_position_embeddings == 1024


def test_an_init_teacher_takes_the_run_s_positions_and_a_short_named_one_says_what_to_do(base, long_shard,
                                                                                         tmp_path):
    """teacher_checkpoint: init is the starting model with the positions the run gives it, so KL to the start
    trains while the context is extended (0 at the first step, where the two are one model)."""
    record = train(params(base, long_shard, tmp_path / "run", rope_scaling=LINEAR_2, teacher_checkpoint="init",
                          distill_ratio=0.5, max_steps=2, save_every_steps=None, save_checkpoints=False),
                   progress=False)
    rows = [row for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if row.get("event") == "train"]
    assert rows[0]["kl_loss"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl_loss"] > rows[0]["kl_loss"]
    assert record["execution_plan"]["distill"]["teacher"]["checkpoint"] == str(base)
    run = prepare(TrainParams.from_dict(params(base, long_shard, tmp_path / "again", rope_scaling=LINEAR_2,
                                               teacher_checkpoint="init")))
    assert run.teacher.model.config == run.model.config and run.model.config.rope_scaling == LINEAR_2_OF_256
    assert torch.equal(run.teacher.model.inv_freq, run.model.inv_freq)
    with pytest.raises(ParamError, match=r"teacher_checkpoint .*max_position_embeddings 256, fewer than seq_len 512: "
                                         r".*teacher_checkpoint: init.*"):
        prepare(TrainParams.from_dict(params(base, long_shard, tmp_path / "named", rope_scaling=LINEAR_2,
                                             teacher_checkpoint=str(base))))
