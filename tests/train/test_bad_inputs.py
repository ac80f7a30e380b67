"""The bad-input battery: every public entry point fed what users get wrong.

Each case must end in a clear error that names the culprit, before any
optimizer step, and leave every file already in out_dir untouched.
"""
from __future__ import annotations

import functools
import hashlib
import time
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cflib.data.shards import Example, write_partition
from cflib.data.tasks import generate
from cflib.data.tokenizer import ByteTokenizer
from cflib.model.checkpoint import save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.train import train
from cflib.train.sizing import SizingError, validate_cluster_layout

TOKENIZER = ByteTokenizer()
# The embedded tasks, generated once for the whole battery (the cases slice them, never change them).
embedded = functools.cache(generate)
GOOD = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 8, "max_steps": 2,
        "exact_match_limit": 0, "device": "cpu"}


def shard(root: Path, edit: Callable[[Path], None] | None = None, examples: list[Example] | None = None,
          vocab_size: int = TOKENIZER.vocab_size) -> Path:
    train_examples, eval_examples = embedded(seed=3)
    for name, chosen in (("train", examples or train_examples[:16]), ("eval", eval_examples[:4])):
        write_partition(root / name, chosen, vocab_size=vocab_size, eos_token_id=0, max_seq_len=64)
    if edit is not None:
        edit(root / "train")
    return root


def rewrite(path: Path, dtype: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    change(np.fromfile(path, dtype=dtype)).astype(dtype).tofile(path)


def edit_json(path: Path, change: Callable[[dict], dict]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def edit_rows(partition: Path, change: Callable[[list[dict]], list[dict]]) -> None:
    rows = [json.loads(line) for line in (partition / "examples.jsonl").read_text().splitlines()]
    (partition / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in change(rows)))


def checkpoint(root: Path, edit: Callable[[Path], None] | None = None) -> Path:
    path = save_checkpoint(TRMoEModel(preset("smoke")), root)
    if edit is not None:
        edit(path)
    return path


def edit_tensors(path: Path, change: Callable[[dict], dict]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    save_file(change(tensors), str(path / "model.safetensors"))


def no_supervision(partition: Path) -> None:
    rewrite(partition / "labels.bin", "<i4", lambda a: np.where(np.arange(a.size) < 20, -100, a))
    edit_rows(partition, lambda rows: [{k: v for k, v in r.items() if k != "supervised_tokens"} for r in rows])


def unshifted(partition: Path) -> None:
    ids = np.fromfile(partition / "input_ids.bin", dtype="<u4").astype(np.int64)
    rewrite(partition / "labels.bin", "<i4", lambda a: np.where(a != -100, ids, a))


def unended(partition: Path) -> None:
    """Rewrite the partition with each example's final EOS cut off: it looks truncated."""
    examples = []
    for example in embedded(seed=3)[0][:16]:
        labels = list(example.labels[:-1])
        labels[-1] = -100
        examples.append(Example(example.input_ids[:-1], labels, example.meta))
    write_partition(partition, examples, vocab_size=TOKENIZER.vocab_size, eos_token_id=0, max_seq_len=64)


def label_past_the_end(partition: Path) -> None:
    """Supervise each example's last position, whose target (the next token) lies beyond the example."""
    examples = [Example(e.input_ids, list(e.labels[:-1]) + [0], e.meta) for e in embedded(seed=3)[0][:16]]
    write_partition(partition, examples, vocab_size=TOKENIZER.vocab_size, eos_token_id=0, max_seq_len=64)


def loss_groups(addition: float = 0.5, uppercase: float = 0.5, cells: dict | None = None) -> dict:
    return {"arithmetic": {"target_share": addition, "tasks": list(cells or {"addition": 1.0}),
                           "task_target_shares": cells or {"addition": 1.0}},
            "text": {"target_share": uppercase, "tasks": ["uppercase"], "task_target_shares": {"uppercase": 1.0}}}


# (id, build(tmp) -> parameter overrides, expected error type, words the message must contain)
CASES = [
    # --- notebook parameters -----------------------------------------------------------------------------
    ("unknown-name", lambda t: {"learning_rate": 1e-3}, ValueError, ["learning_rate"]),
    ("lr-not-a-number", lambda t: {"lr": "fast"}, ValueError, ["lr", "fast"]),
    ("lr-nan", lambda t: {"lr": "nan"}, ValueError, ["lr"]),
    ("lr-negative", lambda t: {"lr": -1e-3}, ValueError, ["lr"]),
    ("beta1-one", lambda t: {"beta1": 1.0}, ValueError, ["beta1"]),
    ("warmup-whole-run", lambda t: {"warmup_ratio": 1.0}, ValueError, ["warmup_ratio"]),
    ("micro-batch-zero", lambda t: {"micro_batch_per_rank": 0}, ValueError, ["micro_batch_per_rank"]),
    ("global-batch-negative", lambda t: {"global_batch": -8}, ValueError, ["global_batch"]),
    ("global-batch-unreachable", lambda t: {"global_batch": 10}, ValueError, ["global_batch 10", "nearest valid"]),
    ("bool-not-bool", lambda t: {"bf16": "maybe"}, ValueError, ["bf16"]),
    ("device-unknown", lambda t: {"device": "tpu"}, ValueError, ["device", "tpu"]),
    ("parameter-efficient", lambda t: {"full_parameter": False}, ValueError, ["full_parameter"]),
    ("strategy-unknown", lambda t: {"strategy": "zero3"}, ValueError, ["strategy"]),
    ("nodes-without-endpoint", lambda t: {"nnodes": 2}, ValueError, ["rdzv_endpoint"]),
    ("model-unknown", lambda t: {"model": "gpt-5"}, ValueError, ["gpt-5"]),
    ("seq-len-past-positions", lambda t: {"seq_len": 100_000}, ValueError, ["seq_len", "max_position_embeddings"]),
    ("kept-layers-past-the-model", lambda t: {"kernel_overrides": {"kept_swiglu_layers": 99}}, ValueError,
     ["kept_swiglu_layers: 99 layers, the model has"]),
    ("warmup-over-the-whole-short-run", lambda t: {"warmup_ratio": 0.99, "max_steps": 6}, ValueError,
     ["warmup_ratio 0.99", "6 warm-up steps", "6"]),
    ("warmup-steps-over-the-whole-short-run", lambda t: {"warmup_steps": 2}, ValueError,
     ["warmup_steps 2 would warm up through the whole run of 2 steps", "at most 1"]),
    ("wsd-decay-of-one-step", lambda t: {"lr_schedule": "wsd", "warmup_steps": 0}, ValueError,
     ["lr_schedule wsd: lr_decay_ratio 0.1 gives 1 decay step of the run's 2", "at least 0.5001"]),
    ("lr-schedule-unknown", lambda t: {"lr_schedule": "cosine_with_restarts"}, ValueError,
     ["lr_schedule", "cosine, linear, constant, wsd", "'cosine_with_restarts'"]),
    ("wsd-decay-into-the-warm-up", lambda t: {"lr_schedule": "wsd", "warmup_steps": 1, "lr_decay_ratio": 0.6},
     ValueError, ["lr_schedule wsd: 1 warm-up steps (warmup_steps 1) and 2 decay steps (lr_decay_ratio 0.6)"]),
    ("global-batch-of-a-trillion", lambda t: {"global_batch": 10**12 + 1}, ValueError,
     ["global_batch 1000000000001", "micro_batch_per_rank in [1, 73, 137]"]),
    ("global-batch-past-the-train-set", lambda t: {"micro_batch_per_rank": 2**40, "global_batch": 2**40}, ValueError,
     ["global_batch 1,099,511,627,776 is more than the 16 train examples"]),
    ("global-batch-past-the-packed-windows", lambda t: {"pack_sequences": True}, ValueError,
     ["global_batch 8 is more than the 5 seq_len windows"]),
    ("global-batch-past-an-epoch-draw", lambda t: {"examples_per_epoch": 4}, ValueError,
     ["global_batch 8 is more than the 4 examples an epoch draws (examples_per_epoch)"]),
    ("examples-per-epoch-of-a-trillion", lambda t: {"examples_per_epoch": 10**12}, ValueError,
     ["examples_per_epoch 1,000,000,000,000", "1,000,000,000 an epoch may draw"]),
    ("lora-tokens-of-a-billion", lambda t: {"lora_trainable_tokens": "0-1000000000"}, ValueError,
     ["lora_trainable_tokens", "'0-1000000000'"]),
    ("max-steps-negative", lambda t: {"max_steps": -1}, ValueError, ["max_steps"]),
    ("out-dir-is-a-file", lambda t: {"out_dir": str(t / "afile")}, ValueError, ["afile", "not a directory"]),
    ("out-dir-under-a-file", lambda t: {"out_dir": str(t / "afile" / "run")}, ValueError,
     ["out_dir", "afile is a file"]),
    # --- non-finite and out-of-range numbers: `x <= 0` lets NaN through, and inf passes every lower bound -----
    ("lr-inf", lambda t: {"lr": float("inf")}, ValueError, ["lr", "finite", "inf"]),
    ("lr-inf-from-papermill", lambda t: {"lr": "inf"}, ValueError, ["lr", "finite"]),
    ("weight-decay-inf", lambda t: {"weight_decay": float("inf")}, ValueError, ["weight_decay", "finite"]),
    ("weight-decay-nan", lambda t: {"weight_decay": "nan"}, ValueError, ["weight_decay", "finite"]),
    ("max-grad-norm-inf", lambda t: {"max_grad_norm": "inf"}, ValueError, ["max_grad_norm", "finite"]),
    ("beta2-nan", lambda t: {"beta2": float("nan")}, ValueError, ["beta2", "finite"]),
    ("seed-negative", lambda t: {"seed": -1}, ValueError, ["seed", "-1"]),
    ("seed-past-64-bits", lambda t: {"seed": 2**64}, ValueError, ["seed", str(2**64)]),
    # --- the shard reader --------------------------------------------------------------------------------
    ("shard-root-missing", lambda t: {"data": str(t / "nowhere")}, ValueError, ["nowhere"]),
    ("partition-missing", lambda t: {"data": str(shard(t / "s", lambda p: (p / "sft.idx.json").unlink()))},
     ValueError, ["sft.idx.json", "missing"]),
    ("bin-truncated", lambda t: {"data": str(shard(t / "s", lambda p: rewrite(p / "input_ids.bin", "<u4",
                                                                              lambda a: a[:-1])))},
     ValueError, ["input_ids.bin", "truncated"]),
    ("labels-misaligned", lambda t: {"data": str(shard(t / "s", unshifted))},
     ValueError, ["labels.bin", "row 0", "causally aligned"]),
    ("id-out-of-vocabulary", lambda t: {"data": str(shard(t / "s", lambda p: rewrite(
        p / "input_ids.bin", "<u4", lambda a: np.where(np.arange(a.size) == 3, 5000, a))))},
     ValueError, ["input_ids.bin", "row 0", "5000"]),
    ("label-out-of-vocabulary", lambda t: {"data": str(shard(t / "s", lambda p: rewrite(
        p / "labels.bin", "<i4", lambda a: np.where(a != -100, -5, a))))}, ValueError, ["labels.bin", "-5"]),
    ("no-supervised-token", lambda t: {"data": str(shard(t / "s", no_supervision))},
     ValueError, ["labels.bin", "row 0", "no supervised token"]),
    ("example-longer-than-seq-len", lambda t: {"data": str(shard(t / "s")), "seq_len": 12},
     ValueError, ["examples.jsonl", "seq_len 12"]),
    ("index-past-the-end", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(
        p, lambda rows: rows[:-1] + [{**rows[-1], "num_tokens": rows[-1]["num_tokens"] + 50}])))},
     ValueError, ["examples.jsonl", "falls outside"]),
    ("row-count-mismatch", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(p, lambda rows: rows[:-1])))},
     ValueError, ["examples.jsonl", "rows"]),
    ("empty-partition", lambda t: {"data": str(shard(t / "s", lambda p: (
        (p / "examples.jsonl").write_text(""), edit_json(p / "sft.idx.json", lambda d: {**d, "examples": 0}))))},
     ValueError, ["no examples"]),
    ("wrong-format", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "format": "some-other-v1"})))}, ValueError, ["format", "some-other-v1"]),
    ("shard-vocabulary-too-large", lambda t: {"data": str(shard(t / "s", vocab_size=50_000))},
     ValueError, ["vocab_size 50000"]),
    ("shard-file-changed", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(
        p, lambda rows: [{**rows[0], "task": "renamed"}] + rows[1:])))}, ValueError, ["examples.jsonl", "sha256"]),
    ("shard-not-release-ready", lambda t: {"data": str(shard(t / "s", unended)), "require_release_ready": True},
     ValueError, ["not release-ready", "neither end with EOS"]),
    ("index-not-an-object", lambda t: {"data": str(shard(t / "s", lambda p: (p / "sft.idx.json").write_text("[1]")))},
     ValueError, ["sft.idx.json", "JSON object"]),
    ("index-vocab-size-a-string", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "vocab_size": "260"})))}, ValueError, ["sft.idx.json", "'vocab_size'"]),
    ("index-examples-negative", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "examples": -3})))}, ValueError, ["sft.idx.json", "'examples'"]),
    ("index-cap-a-list", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "max_seq_len": [64]})))}, ValueError, ["sft.idx.json", "'max_seq_len'"]),
    ("index-hashes-a-list", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "sha256": ["abc"]})))}, ValueError, ["sft.idx.json", "'sha256'"]),
    ("index-not-utf8", lambda t: {"data": str(shard(t / "s", lambda p: (p / "sft.idx.json").write_bytes(b"\xff{")))},
     ValueError, ["sft.idx.json", "not valid JSON"]),
    ("row-offset-a-bool", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(
        p, lambda rows: [{**rows[0], "offset": True}] + rows[1:])))}, ValueError, ["examples.jsonl", "'offset'"]),
    ("row-task-a-number", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(
        p, lambda rows: rows[:2] + [{**rows[2], "task": 7}] + rows[3:])))}, ValueError,
     ["examples.jsonl", "line 3", "'task'"]),
    ("rows-not-utf8", lambda t: {"data": str(shard(t / "s", lambda p: (p / "examples.jsonl").write_bytes(
        (p / "examples.jsonl").read_bytes().replace(b'"example_id"', b'"ex\xffmple_id"', 1))))},
     ValueError, ["examples.jsonl", "line 1"]),
    ("index-nested-deep", lambda t: {"data": str(shard(t / "s", lambda p: (p / "sft.idx.json").write_text(
        "[" * 100_000 + "]" * 100_000)))}, ValueError, ["sft.idx.json", "nested deeper"]),
    ("row-nested-deep", lambda t: {"data": str(shard(t / "s", lambda p: (p / "examples.jsonl").write_text(
        '{"offset": 0, "num_tokens": 3, "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n")))}, ValueError,
     ["examples.jsonl", "line 1", "nested deeper"]),
    ("row-offset-past-int64", lambda t: {"data": str(shard(t / "s", lambda p: edit_rows(
        p, lambda rows: rows[:1] + [{**rows[1], "offset": 2**70}] + rows[2:])))}, ValueError,
     ["examples.jsonl", "row 1", "'offset'"]),
    ("index-tokens-past-int64", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "num_tokens": 2**70})))}, ValueError, ["sft.idx.json", "'num_tokens'"]),
    ("index-hash-of-dot", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "sha256": {**d["sha256"], ".": "0" * 64}})))}, ValueError,
     ["sft.idx.json", "'sha256'", "'.'"]),
    ("index-hash-of-dot-dot", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "sha256": {"..": "0" * 64}})))}, ValueError, ["sft.idx.json", "'sha256'"]),
    ("index-hashed-file-missing", lambda t: {"data": str(shard(t / "s", lambda p: edit_json(
        p / "sft.idx.json", lambda d: {**d, "sha256": {**d["sha256"], "extra.bin": "0" * 64}})))}, ValueError,
     ["extra.bin", "recorded in sft.idx.json", "missing"]),
    ("label-on-the-last-position", lambda t: {"data": str(shard(t / "s", label_past_the_end))},
     ValueError, ["labels.bin", "row 0", "last position", "past the example's end"]),
    # --- 2-D loss weighting --------------------------------------------------------------------------------
    ("loss-group-shares-not-one", lambda t: {"loss_groups": loss_groups(0.5, 0.6)}, ValueError,
     ["loss_groups", "sum to 1.1"]),
    ("loss-cell-shares-not-one", lambda t: {"loss_groups": loss_groups(
        cells={"addition x carry": 0.7, "addition x no-carry": 0.4})}, ValueError, ["'arithmetic'", "sum to 1.1"]),
    ("loss-cell-without-share", lambda t: {"loss_groups": {**loss_groups(), "text": {
        "target_share": 0.5, "tasks": ["uppercase"], "task_target_shares": {}}}},
     ValueError, ["missing ['uppercase']"]),
    ("loss-cell-repeated", lambda t: {"loss_groups": {**loss_groups(), "text": {
        "target_share": 0.5, "tasks": ["addition"], "task_target_shares": {"addition": 1.0}}}}, ValueError,
     ["'addition'", "exactly once"]),
    ("loss-cell-missing-from-groups", lambda t: {"loss_groups": {"all": {
        "target_share": 1.0, "tasks": ["addition"], "task_target_shares": {"addition": 1.0}}}}, ValueError,
     ["fall in no cell", "'uppercase'"]),
    ("loss-cell-absent-from-data", lambda t: {"loss_groups": {**loss_groups(), "text": {
        "target_share": 0.5, "tasks": ["uppercase", "poetry"],
        "task_target_shares": {"uppercase": 0.5, "poetry": 0.5}}}},
     ValueError, ["'poetry'", "no visible supervised token"]),
    ("loss-cell-emptied-by-filters", lambda t: {"loss_groups": loss_groups(), "filters": {"tasks": ["addition"]}},
     ValueError, ["'uppercase'", "no visible supervised token in the train examples filters keep ({"]),
    ("loss-weight-over-cap", lambda t: {"loss_groups": loss_groups(0.05, 0.95), "max_task_loss_weight": 1.5},
     ValueError, ["'uppercase'", "max_task_loss_weight 1.5"]),
    # --- the checkpoint loader ---------------------------------------------------------------------------
    ("checkpoint-missing", lambda t: {"init_checkpoint": str(t / "nockpt")}, ValueError, ["nockpt"]),
    ("config-missing", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: (p / "config.json").unlink()))},
     ValueError, ["config.json"]),
    ("config-contradictory", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "head_dim": 7})))}, ValueError, ["head_dim"]),
    ("config-keys-missing-shape", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {k: v for k, v in d.items() if k != "hidden_size"})))},
     ValueError, ["shape"]),
    ("checkpoint-of-another-shape", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "num_experts": 2, "intermediate_size": 32})))},
     ValueError, ["expert_gate", "shape"]),
    ("tensor-missing", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {k: v for k, v in d.items() if k != "norm.weight"})))}, ValueError, ["norm.weight"]),
    ("weights-corrupt", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: (
        p / "model.safetensors").write_bytes(b"\x00" * 64)))}, ValueError, ["model.safetensors"]),
    ("config-nan-shared-output-scale", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "shared_output_scale": float("nan")})))}, ValueError,
     ["config.json", "shared_output_scale", "finite"]),
    ("config-nan-norm-eps", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "norm_eps": float("nan")})))}, ValueError, ["norm_eps", "finite"]),
    ("config-inf-rope-theta", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "rope_theta": float("inf")})))}, ValueError, ["rope_theta", "finite"]),
    ("weights-nan", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {**d, "norm.weight": torch.full_like(d["norm.weight"], float("nan"))})))},
     ValueError, ["model.safetensors", "'norm.weight'", "NaN"]),
    ("weights-inf", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {**d, "embed_tokens.weight": d["embed_tokens.weight"].index_fill(0, torch.tensor([7]),
                                                                                     float("inf"))})))},
     ValueError, ["'embed_tokens.weight'", "inf"]),
    ("weights-fp16", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {k: v.half() if v.is_floating_point() else v for k, v in d.items()})))},
     ValueError, ["float16", "tensor"]),
    # --- finite values that would reach step 1 as NaN, and weights that are no weights ----------------------
    ("config-norm-eps-huge", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "norm_eps": 1e300})))}, ValueError, ["config.json", "norm_eps"]),
    ("config-shared-output-scale-huge", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "shared_output_scale": 1e308})))}, ValueError,
     ["config.json", "shared_output_scale"]),
    ("config-routed-output-scale-huge", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "routed_output_scale": -1e308})))}, ValueError,
     ["config.json", "routed_output_scale"]),
    ("config-rope-theta-tiny-without-derived-buffers", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: (
        edit_json(p / "config.json", lambda d: {**d, "rope_theta": 1e-300}),
        edit_tensors(p, lambda d: {k: v for k, v in d.items() if "rotary_emb" not in k and "fused_" not in k}))))},
     ValueError, ["config.json", "rope_theta"]),
    ("config-million-layers", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_json(
        p / "config.json", lambda d: {**d, "num_hidden_layers": 1_000_000})))}, ValueError,
     ["num_hidden_layers 1000000", "2 layer(s)"]),
    ("config-nested-deep", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: (
        p / "config.json").write_text("[" * 100_000 + "]" * 100_000)))}, ValueError, ["config.json", "nested deeper"]),
    ("weights-integer", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {**d, "norm.weight": d["norm.weight"].to(torch.int32)})))}, ValueError,
     ["'norm.weight'", "torch.int32", "float32 or bfloat16"]),
    ("route-table-out-of-range", lambda t: {"init_checkpoint": str(checkpoint(t / "c", lambda p: edit_tensors(
        p, lambda d: {**d, "layers.0.mlp.engine.route_table": torch.full_like(d["layers.0.mlp.engine.route_table"], 9)})))},
     ValueError, ["layers.0.mlp.engine.route_table"]),
    # --- a distillation teacher (cflib.train.teacher) ---------------------------------------------------------
    ("teacher-of-another-vocabulary", lambda t: {"teacher_checkpoint": str(save_checkpoint(
        TRMoEModel(replace(preset("smoke"), vocab_size=300)), t / "c"))}, ValueError,
     ["teacher_checkpoint", "config.json has vocab_size 300, the model trained has 260", "share", "vocabulary"]),
    ("teacher-missing", lambda t: {"teacher_checkpoint": str(t / "noteacher")}, ValueError,
     ["teacher_checkpoint", "noteacher"]),
    ("teacher-weights-corrupt", lambda t: {"teacher_checkpoint": str(checkpoint(t / "c", lambda p: (
        p / "model.safetensors").write_bytes(b"\x00" * 64)))}, ValueError, ["teacher_checkpoint", "model.safetensors"]),
    ("teacher-adapters", lambda t: {"teacher_checkpoint": str(checkpoint(t / "c", lambda p: (
        p / "adapter_config.json").write_text("{}")))}, ValueError, ["teacher_checkpoint", "LoRA adapters", "merge"]),
    ("teacher-positions-short", lambda t: {"teacher_checkpoint": str(save_checkpoint(
        TRMoEModel(replace(preset("smoke"), max_position_embeddings=32)), t / "c"))}, ValueError,
     ["teacher_checkpoint", "max_position_embeddings 32", "seq_len 64"]),
    ("teacher-init-without-init-checkpoint", lambda t: {"teacher_checkpoint": "init"}, ValueError,
     ["teacher_checkpoint: init", "init_checkpoint"]),
    ("distill-ratio-above-1", lambda t: {"teacher_checkpoint": str(checkpoint(t / "c")), "distill_ratio": 1.5},
     ValueError, ["distill_ratio", "[0, 1]", "1.5"]),
    ("distill-temperature-zero", lambda t: {"teacher_checkpoint": str(checkpoint(t / "c")), "distill_temperature": 0},
     ValueError, ["distill_temperature must be positive", "got 0"]),
    ("distill-temperature-nan", lambda t: {"teacher_checkpoint": str(checkpoint(t / "c")),
                                           "distill_temperature": "nan"}, ValueError,
     ["distill_temperature must be a finite number"]),
    ("distill-ratio-without-teacher", lambda t: {"distill_ratio": 0.2}, ValueError,
     ["distill_ratio is set, but teacher_checkpoint is not"]),
]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("build, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly_before_training_and_keeps_out_dir(tmp_path, build, error, words):
    out_dir = tmp_path / "earlier-run"
    (out_dir / "checkpoints" / "epoch-1").mkdir(parents=True)
    (out_dir / "checkpoints" / "epoch-1" / "model.safetensors").write_bytes(b"weights worth keeping")
    (out_dir / "record.json").write_text('{"earlier": true}')
    (out_dir / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 5.0, "tokens": 64}\n')
    (tmp_path / "afile").write_text("a file, not a folder")
    before = digest(out_dir)
    overrides = build(tmp_path)
    params = {**GOOD, "data": str(shard(tmp_path / "good")), "out_dir": str(out_dir), **overrides}
    with pytest.raises(error) as caught:
        train(params, progress=False)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert digest(out_dir) == before  # nothing overwritten, nothing appended, no optimizer step logged


def test_the_battery_is_large():
    assert len(CASES) >= 30


@pytest.mark.parametrize("layout, words", [
    ({"model": {"preset": "tr_hash_200m"}, "parallel": {"tp": 1, "pp": 1, "dp": 8, "micro_batch_per_rank": 16,
      "global_batch": 100}, "run": {"seq_len": 2048, "target_tokens": 1e9}}, ["parallel.global_batch"]),
    ({"model": {"preset": "tr_hash_200m"}, "parallel": {"tp": 4, "pp": 1, "dp": 2, "micro_batch_per_rank": 16,
      "global_batch": 32}, "run": {"seq_len": 2048, "target_tokens": 1e9}}, ["parallel.tp"]),
    ({"model": {"preset": "tr_hash_200m"}, "parallel": {"tp": 1, "pp": 1, "dp": 8, "micro_batch_per_rank": 16,
      "global_batch": 128}, "run": {"seq_len": 2048, "target_tokens": 1e9, "world_size": 16}}, ["world_size"]),
])
def test_the_sizing_refuses_broken_layouts(layout, words):
    with pytest.raises(SizingError) as caught:
        validate_cluster_layout(layout)
    for word in words:
        assert word in str(caught.value)


def test_a_read_only_out_dir_is_refused_before_anything_runs(tmp_path):
    try:
        from small_disk import read_only_folder
    except ImportError:  # run from the repository root as a package
        from tests.small_disk import read_only_folder
    with read_only_folder(tmp_path / "ro") as folder:
        if folder is None:
            pytest.skip("needs to mount a read-only filesystem (root)")
        params = {**GOOD, "data": str(shard(tmp_path / "good")), "out_dir": str(folder / "run")}
        with pytest.raises(ValueError, match=r"out_dir .*ro/run: .*ro is on a read-only filesystem"):
            train(params, progress=False)


def test_a_seed_out_of_range_fails_before_params_json_blocks_the_out_dir(tmp_path):
    out_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="seed must be an integer in"):
        train({**GOOD, "data": str(shard(tmp_path / "good")), "out_dir": str(out_dir), "seed": 2**64},
              progress=False)
    assert not out_dir.exists()
    train({**GOOD, "data": str(shard(tmp_path / "good")), "out_dir": str(out_dir), "seed": 2**32 - 1},
          progress=False)  # the largest seed trains, into the same folder


BOUNDED = ["global-batch-of-a-trillion", "global-batch-past-the-train-set", "examples-per-epoch-of-a-trillion",
           "lora-tokens-of-a-billion", "config-million-layers", "config-nested-deep", "row-nested-deep",
           "index-nested-deep", "row-offset-past-int64"]


@pytest.mark.parametrize("case", BOUNDED)
def test_one_huge_number_is_refused_at_once_not_walked(tmp_path, case):
    """Each check costs what the input's size costs, not what its value is: a divisor list of 10**12, a billion
    token ids or a million layers are refused before they are built. The bound is generous: it says "no hang"."""
    _, build, error, words = next(c for c in CASES if c[0] == case)
    params = {**GOOD, "data": str(shard(tmp_path / "good")), "out_dir": str(tmp_path / "run"), **build(tmp_path)}
    start = time.monotonic()
    with pytest.raises(error):
        train(params, progress=False)
    assert time.monotonic() - start < 10, f"{case} took {time.monotonic() - start:.1f} s"
    assert not (tmp_path / "run").exists()
