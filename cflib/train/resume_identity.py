"""What a resumed run must share with the run it continues, and the changes a user may allow on purpose.

A checkpoint's trainer state records the run's identity: the data (the SHA-256
its shard manifests record for every file, train and eval), the stream
(seed, global batch, examples, packing, tasks, filters, whether examples
longer than seq_len are dropped, a mixture's weights and examples per
epoch), the schedule and every
setting that changes the trajectory (optimizer, clipping, loss numerics,
precision, NEFTune's noise, model source, RoPE (the model's rope_scaling and rope_theta), LoRA and the adapters a
LoRA run started from, the frozen modules, the distillation teacher with its ratio and temperature), and
the held-out prompts exact match scores.
Resuming compares each with this run's and refuses the first difference by
name; `allow_resume_changes` names the ones
changed on purpose (e.g. `max_grad_norm` to tame a spike, `data` for a
fixed copy of the shard). The world size has its own switch,
`allow_world_size_change`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from cflib.data.mixture import MixedPartition
from cflib.data.shards import ShardError, ShardPartition, sha256_file
from cflib.errors import ParamError
from cflib.export.pull import is_hub
from cflib.jsonio import read_json
from cflib.paths import resolve_path
from cflib.train.held_out import scored_examples
from cflib.train.teacher import teacher_identity

# What changes the stream or the schedule: never allowed (the step counter and the data order would disagree).
# The optimizer, the learning-rate multipliers, LoRA+'s ratio and the frozen modules too: they decide the optimizer's
# state and parameter groups, which its saved state must match. Parameters first, then what is derived from them
# (DERIVED_FROM), so a change is named by the parameter set.
STREAM = ("seed", "global_batch", "pack_sequences", "train_tasks", "filters", "overlong_examples", "optimizer",
          "expert_lr_multiplier", "lora_lr_multiplier", "embedding_lr_multiplier", "lora_plus_ratio",
          "frozen_modules", "frozen_layers",
          "examples_per_epoch", "mixture",
          "lr_schedule", "min_lr_ratio", "lr_decay_ratio", "train_examples", "total_steps", "warmup_steps")
# Of STREAM, what sets the optimizer's parameter groups (and so its saved state's), named as such when changed.
GROUPS = ("expert_lr_multiplier", "lora_lr_multiplier", "embedding_lr_multiplier", "lora_plus_ratio",
          "frozen_modules", "frozen_layers")
# What changes the trajectory but could be changed on purpose: named in allow_resume_changes.
ALLOWABLE = ("data", "model", "rope_scaling", "rope_theta", "lr", "weight_decay", "beta1", "beta2", "adam_epsilon",
             "muon_momentum", "max_grad_norm", "loss_chunk_tokens", "fp32_loss", "bf16", "seq_len",
             "loss_groups",
             "max_task_loss_weight", "full_parameter", "lora_rank", "lora_alpha", "lora_scaling", "lora_dora",
             "lora_dropout", "lora_targets", "base_dtype", "lora_trainable_tokens", "loss_type", "neftune_noise_alpha",
             "teacher_checkpoint", "distill_ratio", "distill_temperature", "early_stopping_patience",
             "best_metric", "greater_is_better",  # which checkpoint best/ holds and early stopping watches
             "exact_match_limit")  # the prompts an answer-scoring best_metric compares over: _check_scored_prompts

# A LoRA run's settings: one started from adapters takes those it leaves unset from them (cflib.train.adapters);
# its checkpoints written before that recorded them unset.
LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_scaling", "lora_dora", "lora_dropout", "lora_targets",
                 "base_dtype", "lora_trainable_tokens")

# The parameters behind the values a run derives, named with them when a resume changes one.
DERIVED_FROM = {
    "total_steps": " (from epochs, max_steps, the examples per epoch, global_batch and pack_sequences)",
    "warmup_steps": " (from warmup_steps, or warmup_ratio and the total steps)",
    "lr_decay_ratio": " (wsd's, as resolved: None for the other schedules)",
    "train_examples": " (the train partition's examples, after overlong_examples, filters and train_tasks)",
}

# Parameters a trainer state keeps under another key: its own `optimizer` is the optimizer's state.
STATE_KEYS = {"optimizer": "optimizer_name"}

# What resuming reads from a trainer state: checked before any of it is used.
TRAINER_STATE_KEYS = ("optimizer", "scheduler", "step", "epoch", "batch_in_epoch", "world_size", "global_batch",
                      "seed", "best_loss", "evals", "fill_ins", "torch_rng", "checkpoints", "timing")

# What checkpoints written before a key existed were trained with; keys absent from both are not compared.
_DEFAULTS = {"pack_sequences": False, "loss_groups": None, "train_tasks": None, "loss_type": "sft_cross_entropy",
             "filters": None, "overlong_examples": "error", "expert_lr_multiplier": 1.0, "lora_lr_multiplier": 1.0,
             "lora_plus_ratio": None, "frozen_modules": None, "frozen_layers": None, "adam_epsilon": 1e-8,
             "optimizer": "adamw", "embedding_lr_multiplier": 1.0, "muon_momentum": 0.95,
             "early_stopping_patience": None,
             "examples_per_epoch": None, "mixture": None, "best_metric": "eval_loss", "greater_is_better": None,
             "lr_schedule": "cosine", "min_lr_ratio": 0.0, "lr_decay_ratio": None, "neftune_noise_alpha": None,
             "teacher_checkpoint": None, "distill_ratio": 0.5, "distill_temperature": 1.0, "rope_scaling": None}


# The train part of a mixture's held-out-only source (weight 0): no train example, whatever its root holds.
HELD_OUT_ONLY = "held out only"


def partition_digest(partition: ShardPartition | MixedPartition, before_markers: bool = False) -> str | None:
    """SHA-256 over the file hashes a partition's manifest records (computed when it records none); a mixture's
    over its sources' names and digests, a held-out-only source's train part as HELD_OUT_ONLY.
    before_markers: the digest checkpoints written before HELD_OUT_ONLY recorded, which hashed such a source's
    train/ manifest (None where its root has no train/sft.idx.json recording hashes)."""
    if isinstance(partition, MixedPartition):
        parts = [[name, partition_digest(part, before_markers)]
                 for name, part in zip(partition.source_names, partition.parts)]
        if any(digest is None for _, digest in parts):
            return None
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    if getattr(partition, "held_out_only", False):
        return _train_manifest_digest(partition.directory.parent) if before_markers else HELD_OUT_ONLY
    recorded = partition.index.get("sha256") or {
        name: sha256_file(partition.directory / name) for name in ("input_ids.bin", "labels.bin", "examples.jsonl")}
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()


def _train_manifest_digest(root: Path) -> str | None:
    """The digest of root/train/'s manifest hashes (its index alone is read, bounded), or None without one."""
    index_path = root / "train" / "sft.idx.json"
    if not index_path.is_file():
        return None
    try:
        recorded = read_json(index_path, ShardError, "shard index").get("sha256")
    except (ShardError, AttributeError):
        return None
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest() if isinstance(
        recorded, dict) else None


def _shares(weights: Any) -> Any:
    """A mixture's weights as the shares they make (rounded past float noise); anything else as it is."""
    if not isinstance(weights, list) or not weights or not all(isinstance(w, (int, float)) for w in weights):
        return weights
    total = sum(weights)
    return [round(w / total, 12) for w in weights] if total > 0 else weights


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def scored_prompts(run: Any) -> dict[str, Any] | None:
    """Which held-out prompts exact match scores (cflib.train.held_out.scored_examples), cheap to keep: their count
    and the SHA-256 of their indices, so that another choice of the same number is told apart. None: none scored."""
    if run.params.exact_match_limit == 0:
        return None
    chosen = np.asarray(scored_examples(run.eval_data, run.params.exact_match_limit), dtype="<i8")
    return {"count": len(chosen), "sha256": hashlib.sha256(chosen.tobytes()).hexdigest()}


def run_identity(run: Any) -> dict[str, Any]:
    """The identity of a prepared run (cflib.train.run.Run), as plain data a trainer state keeps."""
    p = run.params
    # A Hub start is named by its commit (prepare pinned it), a folder by where it is.
    model = (f"preset {p.model}" if p.init_checkpoint is None else p.init_checkpoint if is_hub(p.init_checkpoint)
             else str(resolve_path(p.init_checkpoint).resolve()))
    mixture = None if run.mixture is None else list(run.mixture.weights)  # the sources' names are the data's
    return {"train_examples": len(run.train_data), "total_steps": run.total_steps, "warmup_steps": run.warmup_steps,
            # wsd's decay as resolved, so that leaving lr_decay_ratio at None and naming its default are one run
            "lr_decay_ratio": run.schedule.lr_decay_ratio,
            "data": {"train": partition_digest(run.train_data), "eval": partition_digest(run.eval_data)},
            "model": model, "mixture": mixture, "exact_match_prompts": scored_prompts(run),
            "init_adapters": getattr(run, "init_adapters", None),
            # A Hub start's repository, commit and the revision the run named: a resume naming it asks no Hub
            "hub_start": None if getattr(run, "hub_start", None) is None else run.hub_start.record(),
            **{STATE_KEYS.get(name, name): _listed(getattr(p, name)) for name in ALLOWABLE + STREAM
               if name not in ("data", "model", "train_examples", "total_steps", "warmup_steps", "mixture",
                               "lr_decay_ratio", "rope_scaling", "rope_theta")},
            # The model's RoPE as it trains, whether the run set it or its checkpoint carried it (a resume of a scaled
            # run that leaves rope_scaling unset continues the same positions)
            "rope_scaling": run.model.config.rope_scaling, "rope_theta": run.model.config.rope_theta,
            "neftune_noise_alpha": p.neftune_noise_alpha or None,  # 0 is off, as None is
            # The teacher by where it is (`init`: init_checkpoint's place), a Hub one by its commit; its Hub start
            # (the revision the run named), which a resume naming that revision resolves to without asking the Hub
            "teacher_checkpoint": teacher_identity(p),
            "teacher_start": None if getattr(run, "teacher", None) is None or run.teacher.hub is None
            else run.teacher.hub.record(),
            "lora_plus_ratio": None if p.lora_plus_ratio == 1 else p.lora_plus_ratio}  # 1 is off, as None is


def _same_model(run: Any) -> bool:
    """Whether a resume that names its model otherwise still trains the same one. Resuming takes the architecture
    and weights from the checkpoint: a run that names neither a preset nor an init_checkpoint changes nothing. A
    LoRA run's base was checked by its weights' SHA-256 as the adapters loaded (cflib.train.adapters), so a base
    named at its new place after a move is the same base; the adapters it started from, by _check_start."""
    params = run.params
    default = next(f.default for f in dataclasses.fields(params) if f.name == "model")
    return (params.init_checkpoint is None and params.model == default) or getattr(run, "lora", None) is not None


def check_resumable(state: dict, run: Any, checkpoint_dir: Path) -> None:
    """ParamError naming the first setting this run changes from the one `checkpoint_dir` continues."""
    params = run.params
    allowed = set(params.allow_resume_changes or ())
    unknown = sorted(allowed - set(ALLOWABLE))
    if unknown:
        raise ParamError(f"allow_resume_changes: {unknown[0]!r} cannot be allowed; a resumed run may change "
                         f"{', '.join(ALLOWABLE)} (the stream and schedule, {', '.join(STREAM)}, never)")
    now = {"seed": params.seed, "global_batch": params.global_batch, **run_identity(run)}
    if "model" not in allowed:
        _check_start(state, run, checkpoint_dir)
    for name in (*STREAM, *ALLOWABLE):
        key = STATE_KEYS.get(name, name)
        if key not in state and name not in _DEFAULTS:
            continue  # written before this key was recorded
        if name == "exact_match_limit":  # judged by the prompts it chooses, even at the same limit
            if name not in allowed:
                _check_scored_prompts(state, now, run, checkpoint_dir)
            continue
        then, value = state.get(key, _DEFAULTS.get(name)), now[key]
        if name == "mixture" and _shares(then) == _shares(value):  # 1:3 is 0.25:0.75: the same draw
            continue
        if then == value or name in allowed or (name == "model" and _same_model(run)):
            continue
        if then is None and name in LORA_SETTINGS and getattr(run, "lora", None) is not None:
            continue  # left unset then, taken from the adapters now: checked against them as they loaded
        if name == "data" and getattr(run, "mixture", None) is not None:  # one digest over every source
            if isinstance(then, dict) and then.get("eval") == value["eval"] and then.get("train") is not None and \
                    then.get("train") == partition_digest(run.train_data, before_markers=True):
                continue  # written before a held-out-only source's train part was a marker: the same data
            raise ParamError(f"{checkpoint_dir} was trained on other data: a source of the mixture was added, "
                             "removed or renamed, or its shard's hashes differ; resume with the same sources, or "
                             "set allow_resume_changes: data to continue on these on purpose")
        if name == "data":
            changed = [part for part in ("train", "eval") if (then or {}).get(part) != value[part]]
            raise ParamError(f"{checkpoint_dir} was trained on other data: the {' and '.join(changed)} "
                             f"partition of {run.data_root} differs from the one it continued (its shard manifest's "
                             "hashes differ, even if the example count is the same); resume with the same shard, "
                             "or set allow_resume_changes: data to continue on this one on purpose")
        if name == "optimizer":
            hint = (f"the checkpoint's optimizer state is {then}'s, which {value} cannot continue; start a new run "
                    "(init_checkpoint) to change the optimizer")
        elif name in GROUPS:
            hint = ("it sets the optimizer's parameter groups, which the checkpoint's optimizer state must match; "
                    "start a new run (init_checkpoint) to change it")
        elif name in STREAM:
            hint = ("a resumed run continues the same stream and schedule; start a new run (init_checkpoint) to "
                    "change them")
        else:
            hint = f"set allow_resume_changes: {name} to change it on purpose, or start a new run (init_checkpoint)"
        raise ParamError(f"{checkpoint_dir} was written with {name} {then}, this run has {value}"
                         f"{DERIVED_FROM.get(name, '')}: {hint}")
    if state["world_size"] != params.world_size and not params.allow_world_size_change:
        raise ParamError(f"{checkpoint_dir} was written by {state['world_size']} process(es), this run has "
                         f"{params.world_size}; set allow_world_size_change: true to resume anyway (the global "
                         "batch stays the same, the per-rank split and accumulation change)")


def _check_start(state: dict, run: Any, checkpoint_dir: Path) -> None:
    """ParamError when a LoRA run that started from adapters is resumed naming others (or one that started from its
    base, naming adapters). The base is checked by SHA-256 as the adapters load (cflib.train.adapters), so any
    adapters on it would pass there, and the record would name them as where the run started. The start is known by
    its adapter file's SHA-256: the same adapters at another place, or the base alone (found again after a move),
    name the same start."""
    if getattr(run, "lora", None) is None or "init_adapters" not in state:
        return  # a full run's start is checked as `model`; a checkpoint written before the start was recorded
    then, now = state["init_adapters"], run.init_adapters
    if now is None or (then is not None and then["sha256"] == now["sha256"]):
        return
    started = (f"from the adapters {then['path']} (SHA-256 {then['sha256'][:12]}...)" if then is not None
               else "from its base, not from adapters")
    raise ParamError(f"{checkpoint_dir} continues a LoRA run that started {started}, but init_checkpoint "
                     f"{now['path']} holds {'other ' if then else ''}adapters (SHA-256 {now['sha256'][:12]}...) on "
                     "that base: name the "
                     "adapters the run started from (or its base alone, if it moved), or set "
                     "allow_resume_changes: model to record these as its start on purpose")


def _check_scored_prompts(state: dict, now: dict, run: Any, checkpoint_dir: Path) -> None:
    """ParamError when exact match would score other held-out prompts than those the checkpoint's evaluations
    scored, and best_metric compares answers: its best so far, and early stopping's count of evaluations without
    improvement, would then weigh scores over different prompts. A limit that chooses the same prompts, or one that
    feeds no best_metric, is only recorded."""
    then, value = state.get("exact_match_prompts"), now["exact_match_prompts"]
    metric = run.params.best()
    if then is None or then == value or not metric.needs_answers:
        return  # the checkpoint's evaluations scored no answers (or a limit written before the prompts were)
    limits = state["exact_match_limit"], run.params.exact_match_limit
    if then["count"] != value["count"]:
        change = (f"was written with exact_match_limit {limits[0]} ({then['count']} held-out prompts scored), "
                  f"this run has {limits[1]} ({value['count']})")
    else:
        change = (f"scored {then['count']} held-out prompts (exact_match_limit {limits[0]}), this run's "
                  f"exact_match_limit {limits[1]} chooses {value['count']} others (the held-out data, or how "
                  "prompts are chosen, changed)")
    back = f"resume with exact_match_limit {limits[0]}, or " if limits[0] != limits[1] else ""
    raise ParamError(f"{checkpoint_dir} {change}: best_metric {metric.name!r} would compare its best so far, and "
                     "early stopping its evaluations without improvement, with scores over other prompts; "
                     f"{back}set allow_resume_changes: exact_match_limit to change them on purpose")
