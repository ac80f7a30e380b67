"""The training loop end to end on CPU: records, schedule, accumulation, bad input."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sft_shard_helpers import write_shard

from cflib.data.mixture import recorded_held_out
from cflib.data.packing import PackedWindows, collate_packed, pack_examples
from cflib.data.shards import Example, ShardError, write_partition
from cflib.data.tasks import generate
from cflib.data.tokenizer import ByteTokenizer
from cflib.lab.report import summary
from cflib.model.checkpoint import load_checkpoint
from cflib.ops.attention import pack_documents
from cflib.ops.loss import chunked_cross_entropy_sum
from cflib.train import prepare, train
from cflib.train.distributed import epoch_stream
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics
from cflib.train.run import never_trained
from cflib.train.step import TrainingStep
from cflib.train.trainer import Trainer

FAST = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 24, "device": "cpu"}


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory) -> Path:
    """40 train / 24 eval embedded-style examples: epochs end within a few steps."""
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:40], eval_examples[:12] + eval_examples[-12:],
                       max_seq_len=64)


def run(tmp_path: Path, shard: Path, name: str = "run", **overrides) -> dict:
    params = {**FAST, "data": str(shard), "out_dir": str(tmp_path / name), **overrides}
    return train(params, progress=False)


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_record_holds_protocol_fields_and_results(tmp_path, small_shard):
    record = run(tmp_path, small_shard, max_steps=4)
    out = tmp_path / "run"
    assert json.loads((out / "record.json").read_text()) == json.loads(json.dumps(record, default=str))
    for key in ("framework", "device", "kernel_path", "params_total", "params_trainable", "vocab_size", "seq_len",
                "micro_batch_per_rank", "precision", "loss_precision", "grad_ckpt", "loss_chunk_tokens",
                "telemetry", "compiled", "timing_protocol", "throughput", "world_size"):
        assert key in record, key
    assert record["params_total"] == record["params_trainable"] == 115_328
    assert record["kernel_path"]["moe"] == "torch_dense"
    assert record["framework"]["torch"] == torch.__version__
    assert record["timing_protocol"]["includes_eval"] is False
    assert set(record["eval"]["final"]["exact_match"]) == {"addition", "uppercase", "overall"}
    assert record["eval"]["at_start"]["step"] == 0 and record["eval"]["final"]["step"] == 4
    assert record["eval"]["final"]["loss"] < record["eval"]["at_start"]["loss"]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["event"] == "train"] == [1, 2, 3, 4]
    # max_steps ended the run mid-epoch 2: its final weights land in "last"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["best", "epoch-1", "last"]


def test_epochs_evaluate_and_checkpoint_at_each_boundary(tmp_path, small_shard):
    record = run(tmp_path, small_shard, max_steps=None, epochs=2, eval_every_steps=2)
    assert record["schedule"]["steps_per_epoch"] == 3  # 40 examples, 16 per step
    tags = [(e["tag"], e["step"]) for e in record["eval"]["history"]]
    assert tags == [("start", 0), ("periodic", 2), ("epoch-1", 3), ("periodic", 4), ("epoch-2", 6)]
    assert record["eval"]["final"]["tag"] == "epoch-2"
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["best", "epoch-1", "epoch-2"]
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"]
    # every example is consumed once per epoch: the last step of each epoch is the remainder
    assert [r["supervised_tokens"] > 0 for r in rows] == [True] * 6


def test_gradient_accumulation_matches_one_big_microbatch(tmp_path, small_shard):
    common = {"max_steps": 2, "eval_at_start": False, "exact_match_limit": 0, "global_batch": 16}
    whole = run(tmp_path, small_shard, "whole", micro_batch_per_rank=16, **common)
    split = run(tmp_path, small_shard, "split", micro_batch_per_rank=4, **common)
    assert split["grad_accum"] == 4 and whole["grad_accum"] == 1
    losses = [[r["loss"] for r in read_metrics(tmp_path / n / "metrics.jsonl") if r["event"] == "train"]
              for n in ("whole", "split")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=0, atol=1e-5)
    a = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last").state_dict()
    b = load_checkpoint(tmp_path / "split" / "checkpoints" / "last").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


def test_a_step_staged_during_the_one_before_trains_as_one_collated_in_its_own(tmp_path, small_shard):
    """fit() stages each next step's host work (collation) while the current one runs. Staged steps train
    bitwise as unstaged ones, and a staged step for other units than the next one asks for is not used."""
    common = {**FAST, "data": str(small_shard), "max_steps": 4, "eval_at_start": False, "exact_match_limit": 0,
              "micro_batch_per_rank": 4}
    trainers = [Trainer(prepare(TrainParams.from_dict({**common, "out_dir": str(tmp_path / name)})), progress=False)
                for name in ("staged", "unstaged")]
    order = np.random.default_rng(0).permutation(len(trainers[0].run.train_data))
    steps = [order[0:16], order[16:32], order[8:24]]
    staged = [trainers[0].train_step(steps[0], steps[1]), trainers[0].train_step(steps[1], order[24:40]),
              trainers[0].train_step(steps[2])]  # staged order[24:40], then asked for other units
    assert trainers[0].training_step.staged is None
    unstaged = [trainers[1].train_step(units) for units in steps]
    for ahead, own in zip(staged, unstaged):
        assert (ahead["loss"], ahead["grad_norm"], ahead["tokens"]) == (own["loss"], own["grad_norm"], own["tokens"])
    for (name, a), b in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
        assert torch.equal(a, b), name


def test_max_steps_zero_only_evaluates(tmp_path, small_shard):
    record = run(tmp_path, small_shard, max_steps=0, eval_at_start=False)
    assert record["schedule"]["steps_done"] == 0
    assert record["eval"]["final"] == record["eval"]["at_start"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_examples_longer_than_seq_len_stop_the_run_or_are_left_out_of_training_and_evaluation(tmp_path, small_shard):
    """seq_len 16 holds the additions (15 tokens), not the upper-casings (21): by default the run stops, naming the
    parameter that leaves them out; overlong_examples: drop trains and evaluates on the rest, each partition's drop
    counted in the description, the record and its summary; a partition left with none stops the run, naming it."""
    short = {**FAST, "data": str(small_shard), "seq_len": 16, "out_dir": str(tmp_path / "refused")}
    with pytest.raises(ShardError, match=r"train/examples\.jsonl: 19 example\(s\) exceed seq_len 16, .* with 21 "
                                         r"tokens; .*raise seq_len to 21 or set overlong_examples: drop"):
        prepare(TrainParams.from_dict(short))
    record = run(tmp_path, small_shard, seq_len=16, overlong_examples="drop", max_steps=0, eval_at_start=False)
    assert record["data"]["overlong"] == {"seq_len": 16, "partitions": {
        "train": {"examples": 40, "dropped": 19, "kept": 21, "longest": 21},
        "eval": {"examples": 24, "dropped": 12, "kept": 12, "longest": 21}}}
    assert record["data"]["train_examples"] == 21 and record["eval"]["final"]["examples"] == 12
    assert len(recorded_held_out(record["data"])) == 12  # the report's answers come from the set evaluated
    assert ("overlong           examples longer than seq_len 16 left out: train 19 of 40, eval 12 of 24 (the "
            "longest: 21 tokens)") in summary(record)
    with pytest.raises(ShardError, match=r"train: overlong_examples: drop would leave no train example: all 40 are "
                                         r"longer than seq_len 14 \(the shortest has 15 tokens\); raise seq_len to at "
                                         "least 15"):
        prepare(TrainParams.from_dict({**short, "seq_len": 14, "overlong_examples": "drop"}))
    train_examples, eval_examples = generate(seed=1)
    long_held_out = write_shard(tmp_path / "long_held_out", train_examples[:40],
                                [e for e in eval_examples if e.meta["task"] == "uppercase"][:4], max_seq_len=64)
    with pytest.raises(ShardError, match=r"long_held_out/eval: overlong_examples: drop would leave no eval example"):
        prepare(TrainParams.from_dict({**short, "data": str(long_held_out), "overlong_examples": "drop"}))
    with pytest.raises(ParamError, match="overlong_examples must be one of error, drop .*got 'truncate'"):
        TrainParams.from_dict({**short, "overlong_examples": "truncate"})


def test_where_every_example_fits_seq_len_dropping_leaves_out_none_and_the_default_records_nothing(tmp_path,
                                                                                                  small_shard):
    default = prepare(TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "a")}))
    dropping = prepare(TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "b"),
                                              "overlong_examples": "drop"}))
    assert TrainParams().overlong_examples == "error"
    assert default.overlong is None and default.data_record(0)["overlong"] is None
    assert "overlong" not in default.describe() and "overlong" in dropping.describe()
    assert (len(default.train_data), len(default.eval_data)) == (len(dropping.train_data), len(dropping.eval_data)) \
        == (40, 24)
    assert [c["dropped"] for c in dropping.overlong["partitions"].values()] == [0, 0]


def test_init_checkpoint_reproduces_the_trained_model(tmp_path, small_shard):
    first = run(tmp_path, small_shard, "first", max_steps=2)
    again = run(tmp_path, small_shard, "again", max_steps=0,
                init_checkpoint=str(tmp_path / "first" / "checkpoints" / "last"))
    assert again["eval"]["final"]["loss"] == pytest.approx(first["eval"]["final"]["loss"], abs=1e-6)
    assert again["model_source"].startswith("checkpoint")


def test_bf16_and_activation_checkpointing_run_on_cpu(tmp_path, small_shard):
    record = run(tmp_path, small_shard, max_steps=2, bf16=True, grad_ckpt=True, fp32_loss=False)
    assert record["precision"] == "bf16-autocast" and record["grad_ckpt"] is True
    assert record["kernel_path"]["residual"] == "float32"
    assert np.isfinite(record["eval"]["final"]["loss"])


def misaligned_shard(root: Path) -> Path:
    tokenizer = ByteTokenizer()
    ids, labels = tokenizer.encode_chat("1+1=", "2")
    unshifted = [-100] * 6 + ids[6:]  # labels equal to the inputs: not causally aligned
    for name in ("train", "eval"):
        write_partition(root / name, [Example(ids, unshifted, {"task": "addition"})],
                        vocab_size=tokenizer.vocab_size, eos_token_id=0, max_seq_len=64)
    return root


@pytest.mark.parametrize("bad, error, words", [
    ({"lrr": 0.1}, ParamError, ["lrr", "lr"]),
    ({"global_batch": 20}, ParamError, ["global_batch", "micro_batch_per_rank"]),
    ({"full_parameter": False}, ParamError, ["full_parameter"]),
    ({"model": "gpt5"}, ParamError, ["gpt5"]),
    ({"seq_len": 4096}, ParamError, ["seq_len", "max_position_embeddings"]),
    ({"data": "MISALIGNED"}, ShardError, ["labels.bin", "row 0", "causally aligned"]),
    ({"data": "does/not/exist"}, ShardError, ["does/not/exist"]),
    ({"init_checkpoint": "no/such/checkpoint"}, ValueError, ["no/such/checkpoint"]),
    ({"seq_len": 8}, ShardError, ["seq_len 8"]),
])
def test_bad_input_stops_before_training_and_keeps_out_dir(tmp_path, small_shard, bad, error, words):
    out = tmp_path / "previous"
    (out / "checkpoints" / "epoch-1").mkdir(parents=True)
    (out / "checkpoints" / "epoch-1" / "model.safetensors").write_bytes(b"weights of an earlier run")
    (out / "record.json").write_text('{"earlier": true}')
    before = tree_digest(out)
    if bad.get("data") == "MISALIGNED":
        bad = {**bad, "data": str(misaligned_shard(tmp_path / "bad"))}
    params = {**FAST, "data": str(small_shard), "out_dir": str(out), "resume": None, **bad}
    with pytest.raises(error) as caught:
        train(params, progress=False)
    for word in words:
        assert word in str(caught.value)
    assert tree_digest(out) == before


def test_an_existing_run_is_never_replaced(tmp_path, small_shard):
    run(tmp_path, small_shard, max_steps=1)
    before = tree_digest(tmp_path / "run")
    with pytest.raises(ParamError, match="already holds a run"):
        run(tmp_path, small_shard, max_steps=1)
    assert tree_digest(tmp_path / "run") == before


def test_a_run_that_stopped_before_step_1_leaves_its_out_dir_free(tmp_path, small_shard, monkeypatch):
    def out_of_memory(trainer, units, next_units=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (the first step)")

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "train_step", out_of_memory)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            run(tmp_path, small_shard, max_steps=2, eval_at_start=True)
    out = tmp_path / "run"
    assert (out / "params.json").is_file() and [row["event"] for row in read_metrics(out / "metrics.jsonl")] == [
        "eval"]
    record = run(tmp_path, small_shard, max_steps=2, eval_at_start=False)
    assert record["schedule"]["steps_done"] == 2 and (out / "COMPLETE").is_file()
    # The stopped run's evaluation at start is gone with it: the rows are this run's alone.
    assert [row["event"] for row in read_metrics(out / "metrics.jsonl")] == ["train", "train", "eval"]


def test_a_run_that_trained_a_step_keeps_its_out_dir(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "params.json").write_text('{"out_dir": "run", "lr": 0.001}')
    assert never_trained(out)
    evaluated = '{"event": "eval", "step": 0, "loss": 5.5}\n'
    (out / "metrics.jsonl").write_text(evaluated)
    assert never_trained(out)
    (out / "metrics.jsonl").write_text(evaluated + '{"event": "train", "step": 1, "loss": 5.0, "tokens": 64}\n')
    assert not never_trained(out)
    (out / "metrics.jsonl").unlink()
    (out / "checkpoints" / "epoch-1").mkdir(parents=True)
    assert not never_trained(out)


def test_another_tool_s_files_and_a_linked_out_dir_are_never_written_over(tmp_path, small_shard):
    """A metrics.jsonl or params.json a run did not write is refused, never replaced; an out_dir that is a link
    would have the run write (and prune) where it points."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (out / "params.json").write_text('{"learning_rate": 0.1}')
    before = {entry.name: entry.read_bytes() for entry in out.iterdir()}
    with pytest.raises(ParamError, match=rf"out_dir {out} already holds a run \(metrics.jsonl, params.json\)"):
        run(tmp_path, small_shard, out_dir=str(out), max_steps=1)
    assert {entry.name: entry.read_bytes() for entry in out.iterdir()} == before
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ParamError, match=rf"out_dir {tmp_path / 'link'} is a symbolic link \(to {out}\)"):
        run(tmp_path, small_shard, out_dir=str(tmp_path / "link"), max_steps=1)
    assert {entry.name: entry.read_bytes() for entry in out.iterdir()} == before


def test_prepare_writes_nothing(tmp_path, small_shard):
    params = TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "fresh")})
    prepared = prepare(params)
    assert prepared.params.grad_accum == 2 and prepared.total_steps == 30
    assert not (tmp_path / "fresh").exists()


def poisoned(tmp_path: Path, shard: Path, name: str = "run", optimizer: str | None = None,
             **overrides) -> "Trainer":
    """A prepared run whose weights turned non-finite (a checkpoint holding them is refused at load); `optimizer`:
    the plan's, where given."""
    prepared = prepare(TrainParams.from_dict({**FAST, "data": str(shard), "out_dir": str(tmp_path / name),
                                              **overrides}))
    if optimizer is not None:
        prepared.plan = dataclasses.replace(prepared.plan, optimizer=optimizer)
    with torch.no_grad():
        prepared.model.layers[0].mlp["engine"].expert_up.fill_(float("inf"))
    return Trainer(prepared, progress=False)


def test_a_non_finite_step_stops_before_the_optimizer_and_writes_no_checkpoint(tmp_path, small_shard):
    with pytest.raises(FloatingPointError, match=r"step 1: loss nan.*Batch examples \(first 8\): \['(addition|uppercase)-"):
        poisoned(tmp_path, small_shard, max_steps=2, eval_at_start=False).fit()
    assert not (tmp_path / "run" / "checkpoints").exists()
    # With patience the bad steps are skipped (no update) until the patience runs out.
    with pytest.raises(FloatingPointError, match="step 3: .* after 3 non-finite step"):
        poisoned(tmp_path, small_shard, "patient", max_steps=5, eval_at_start=False, nan_patience=2).fit()
    rows = [r for r in read_metrics(tmp_path / "patient" / "metrics.jsonl") if r["event"] == "train"]
    assert [r["skipped"] for r in rows] == [True, True]


def test_no_checkpoint_holds_a_non_finite_tensor_whatever_nan_patience_says(tmp_path, small_shard):
    from cflib.model.checkpoint import CheckpointError

    trainer = poisoned(tmp_path, small_shard, max_steps=3, eval_at_start=False, nan_patience=100)
    with pytest.raises(CheckpointError, match=r"not written: tensor 'layers.0.mlp.engine.expert_up' \(4096 of 4096"):
        trainer.fit()  # every step skipped, the weights still non-finite at the end: the save refuses them
    out_dir = tmp_path / "run"
    assert not (out_dir / "COMPLETE").exists() and not (out_dir / "record.json").exists()
    assert not list(out_dir.glob("checkpoints/**/*.safetensors"))  # none written, no staging left behind


@pytest.mark.parametrize("fused", [False, True], ids=["host_skip", "device_skip"])
def test_a_non_finite_step_moves_no_weight_and_no_optimizer_state(tmp_path, small_shard, fused):
    """The foreach AdamW is skipped on the host; the fused one (CUDA's) skips on the device through found_inf.

    CPU AdamW has a fused kernel too, so the device-side skip runs here, with a plan naming it."""
    trainer = poisoned(tmp_path, small_shard, optimizer="torch_fused" if fused else "torch", nan_patience=5)
    optimizer = trainer.training_step.optimizer
    assert all(bool(group["fused"]) == fused for group in optimizer.param_groups)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    rows = [trainer.train_step(np.arange(i * 16, (i + 1) * 16) % 40) for i in range(2)]
    assert [r["skipped"] for r in rows] == [True, True]
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name  # the broken weights' inf compare equal; a NaN would not
    steps = [state["step"] for state in optimizer.state.values()]
    assert all(float(step) == 0 for step in steps)  # a skipped step does not count in Adam's bias correction
    assert trainer.training_step.scheduler.last_epoch == 2  # but it consumes its place in the schedule


def test_a_finished_run_is_marked_complete_last(tmp_path, small_shard):
    run(tmp_path, small_shard, max_steps=1)
    marker = json.loads((tmp_path / "run" / "COMPLETE").read_text())
    assert marker["steps"] == 1
    assert (tmp_path / "run" / "COMPLETE").stat().st_mtime_ns >= (tmp_path / "run" / "record.json").stat().st_mtime_ns
    with pytest.raises(ParamError, match="completed run: nothing to resume"):
        run(tmp_path, small_shard, max_steps=1, resume="latest")


def test_out_of_disk_while_saving_stops_clearly_and_keeps_earlier_checkpoints(tmp_path, small_shard, monkeypatch):
    import errno

    import cflib.model.checkpoint
    from cflib.model.checkpoint import CheckpointError

    real_save_file = cflib.model.checkpoint.save_file
    calls = []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 1:  # the first checkpoint fits, the second finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(cflib.model.checkpoint, "save_file", save_file)
    with pytest.raises(CheckpointError, match="out of disk space writing checkpoint .*earlier checkpoints are intact"):
        run(tmp_path, small_shard, max_steps=None, epochs=2, eval_at_start=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    # epoch-1's checkpoint is written before best/ (lm-eval may score it first); best/'s save failed, nothing
    # half-written
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-1"]
    load_checkpoint(checkpoints / "epoch-1")


def test_save_total_limit_keeps_the_newest_and_the_best(tmp_path, small_shard):
    record = run(tmp_path, small_shard, max_steps=None, epochs=3, save_every_steps=1, save_total_limit=2)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["best", "epoch-3", "step-8"]  # step 9 ends epoch 3, whose own checkpoint it is
    assert set(record["checkpoints"]) == {"best", "best_step", "epoch-3", "step-8"}


def test_a_packed_step_takes_its_documents_and_supervised_positions_from_the_host(tmp_path, small_shard):
    """The trainer builds cu_seqlens, positions and the supervised positions with the batch, on the host, and the
    step's loss is the model's on the windows' document ids, each example attending only to itself."""
    params = TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "run"),
                                    "pack_sequences": True, "micro_batch_per_rank": 2, "global_batch": 2})
    prepared = prepare(params)
    trainer = Trainer(prepared, progress=False)
    windows = np.arange(2)
    batch = trainer.training_step.host_batch(windows)
    input_ids, labels, document_ids, _ = collate_packed(prepared.train_data, prepared.packed, windows)
    documents = pack_documents(document_ids)
    assert torch.equal(batch.documents.cu_seqlens, documents.cu_seqlens)
    assert torch.equal(batch.documents.positions, documents.positions)
    assert batch.documents.max_seqlen == documents.max_seqlen
    assert batch.supervised.tolist() == torch.nonzero(labels.reshape(-1) != -100).squeeze(1).tolist()
    model = prepared.model
    with torch.no_grad():
        loss, count = chunked_cross_entropy_sum(model(input_ids, document_ids), model.head_weight, labels,
                                                params.loss_chunk_tokens)
    row = trainer.train_step(windows)
    assert row["loss"] == pytest.approx(loss.item() / count, rel=1e-6)
    assert trainer.training_step.kernel_path["attention"] == "sdpa_mask"


def test_one_shard_packs_once_per_run_and_shuffles_its_windows_each_epoch(tmp_path, small_shard):
    """A single shard packs as it did before mixtures could be packed: one plan for the whole run, its windows
    shuffled each epoch by epoch_stream, every epoch the same number of steps."""
    params = TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "run"),
                                    "pack_sequences": True, "micro_batch_per_rank": 2, "global_batch": 4})
    prepared = prepare(params)
    plan = pack_examples(prepared.train_data.lengths, params.seq_len)
    assert isinstance(prepared.packed, PackedWindows)
    np.testing.assert_array_equal(prepared.packed.members, plan.members)
    np.testing.assert_array_equal(prepared.packed.offsets, plan.offsets)
    for epoch in (1, 2, 3):
        order, fill_ins = prepared.epoch_order(epoch)
        want, want_fill_ins = epoch_stream(len(plan), params.seed, epoch, params.global_batch)
        np.testing.assert_array_equal(order, want)
        assert fill_ins == want_fill_ins and prepared.steps_in_epoch(epoch) == prepared.steps_per_epoch
    assert prepared.steps_per_epoch == -(-len(plan) // 4) and prepared.epoch_steps() is None


def test_the_sft_step_computes_its_last_layer_on_the_supervised_rows_alone(tmp_path, small_shard):
    """The built-in loss reads the supervised rows only, so the trainer hands the model their positions and the
    last layer's TR-MoE block sees those rows alone; the loss and every gradient are those of the step over
    every row, which a loss reading every position gets."""
    params = TrainParams.from_dict({**FAST, "data": str(small_shard), "out_dir": str(tmp_path / "run"),
                                    "micro_batch_per_rank": 4, "global_batch": 4})
    step = TrainingStep(prepare(params))
    batch = step.host_batch(np.arange(4))
    seen: list[int] = []
    step.model.layers[-1].mlp["engine"].register_forward_hook(
        lambda m, args, out: seen.append(args[0].numel() // args[0].shape[-1]))
    steps = []
    for rows_only in (True, False):
        step.supervised_rows_only = rows_only  # False: as for a loss without reads_supervised_rows_only
        step.model.zero_grad(set_to_none=True)
        loss = step.forward_backward(batch, 1.0)
        steps.append((loss.item(), {name: p.grad.clone() for name, p in step.model.named_parameters()}))
    assert seen == [batch.supervised.numel(), batch.input_ids.numel()]
    assert steps[0][0] == pytest.approx(steps[1][0], rel=1e-6)
    for name, grad in steps[1][1].items():
        torch.testing.assert_close(steps[0][1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_record_names_the_data_by_its_hashes_and_its_conversion(tmp_path):
    """A data folder may be converted again in place: the record keeps what identifies the shard it trained on."""
    from cflib.data.convert import ConvertSpec, convert

    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(24)]
    for name, part in (("train", rows[:20]), ("eval", rows[20:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    indexes = convert(ConvertSpec(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "eval.jsonl"),
                                  out=str(tmp_path / "shard"), max_seq_len=64))
    record = train({**FAST, "data": str(tmp_path / "shard"), "out_dir": str(tmp_path / "run"), "max_steps": 1,
                    "exact_match_limit": 0, "eval_at_start": False}, progress=False)
    data = record["data"]
    assert data["sha256"] == {name: indexes[name]["sha256"] for name in ("train", "eval")}
    conversion = data["conversion"]
    assert conversion["tokenizer"] == indexes["train"]["conversion"]["tokenizer"]
    assert conversion["supervise"] == indexes["train"]["conversion"]["supervise"]
    assert conversion["stats"]["sources"][0]["files"] == 1  # counted: a folder of thousands stays small
