"""The SFT training loop: prepare (every check, nothing written), then train.

`prepare` resolves the device, the model, the data and the batch arithmetic
and fails with a clear message before `out_dir` is touched. `train` runs
full-parameter AdamW with warm-up + cosine, gradient accumulation to the
global batch, optional BF16 autocast and activation checkpointing, evaluates
and checkpoints on schedule, and writes `metrics.jsonl` and `record.json`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from tqdm.auto import tqdm

from . import __version__
from .checkpoint import (CheckpointError, latest_resumable, load_checkpoint, load_config, load_trainer_state,
                         save_checkpoint)
from .config import ModelConfig, preset
from .data import ShardError, ShardPartition, collate, open_shard
from .distributed import (DistContext, choose_strategy, device_memory_bytes, epoch_stream, memory_estimate,
                          rank_share, wrap_model)
from .evaluate import autocast, eval_loss, exact_match
from .kernels import KernelPlan, SFTLoss, plan_kernels
from .model import TRMoEModel
from .packing import PackPlan, collate_packed, plan_packs
from .params import ParamError, TrainParams, gradient_accumulation
from .paths import resolve_path
from .preflight import preflight
from .weighting import LossWeights, audit_table, derive_loss_weights
from .atomic import write_json_atomic
from .records import MetricsLog, device_info, framework_versions
from .tasks import TASKS, ensure_embedded_shard

RUN_FILES = ("record.json", "metrics.jsonl", "params.json", "checkpoints", "COMPLETE")


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ParamError("device: 'cuda' requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return torch.device("cuda", local_rank) if requested == "cuda" else torch.device(requested)


@dataclass
class Run:
    """Everything a run needs, checked; nothing on disk has changed yet."""

    params: TrainParams
    device: torch.device
    model: TRMoEModel
    model_source: str
    data_root: Path
    train_data: ShardPartition
    eval_data: ShardPartition
    out_dir: Path
    grad_accum: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    dist: DistContext
    strategy: str
    memory_estimate: dict
    kernels: KernelPlan
    resume_state: dict | None = None  # trainer state of the checkpoint this run continues
    pack_plan: PackPlan | None = None  # pack_sequences: the windows, planned once
    loss_weights: LossWeights | None = None  # loss_groups: every cell's coefficient
    preflight: dict | None = None  # partition -> report; None in torchrun workers (the launcher checked)

    @property
    def train_units(self) -> int:
        """What an epoch shuffles and a global batch counts: packed windows, or examples."""
        return len(self.pack_plan) if self.pack_plan is not None else len(self.train_data)

    def examples_of(self, units: np.ndarray) -> np.ndarray:
        return self.pack_plan.examples_of(units) if self.pack_plan is not None else units

    @property
    def launches_workers(self) -> bool:
        """True in the process that starts torchrun: it checks, the workers train."""
        return self.params.world_size > 1 and not self.dist.active

    def describe(self) -> str:
        p = self.params
        tokens = int(self.train_data.lengths.sum())
        return "\n".join([
            f"model        {self.model_source}: {count_parameters(self.model)['params_total']:,} parameters",
            f"data         {self.data_root}: {len(self.train_data):,} train / {len(self.eval_data):,} eval "
            f"examples, {tokens:,} train tokens",
            *([self._packing_line()] if self.pack_plan is not None else []),
            f"batch        global {p.global_batch} {'windows' if self.pack_plan else 'examples'} = micro "
            f"{p.micro_batch_per_rank} x world {p.world_size} x accumulation {self.grad_accum}",
            f"schedule     {self.steps_per_epoch} steps/epoch, {self.total_steps} optimizer steps, "
            f"{self.warmup_steps} warm-up, lr {p.lr:g} cosine",
            f"device       {self.device} ({'bf16 autocast' if p.bf16 else 'fp32'}), "
            f"{p.nnodes} node(s) x {p.nproc_per_node} process(es), strategy {self.strategy} "
            f"(estimated {self.memory_estimate['total_bytes'] / 2**30:.1f} GiB of "
            f"{self.memory_estimate['device_bytes'] / 2**30:.0f} per device)",
            f"kernels      {self.kernels.describe()}",
            f"out_dir      {self.out_dir}",
            *([f"loss weights (max_task_loss_weight {p.max_task_loss_weight:g})\n"
               + audit_table(self.loss_weights.audit())] if self.loss_weights else []),
        ])

    def _packing_line(self) -> str:
        packing = self.packing_efficiency()
        return (f"packing      {packing['windows']:,} windows of {packing['seq_len']} tokens, "
                f"{packing['examples_per_window']:.2f} examples, {packing['real_fraction']:.1%} real and "
                f"{packing['supervised_fraction']:.1%} supervised tokens per window")

    def packing_efficiency(self) -> dict | None:
        if self.pack_plan is None:
            return None
        return self.pack_plan.efficiency(self.train_data.lengths, self.train_data.supervised_counts)


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params_total": total, "params_trainable": trainable}


def _out_dir(params: TrainParams, model_name: str) -> Path:
    if params.out_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        return resolve_path(f"outputs/runs/{stamp}-{model_name}")
    out_dir = resolve_path(params.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ParamError(f"out_dir {out_dir} exists and is not a directory")
    previous = [name for name in RUN_FILES if (out_dir / name).exists()]
    # Never mix or overwrite: another run's artifacts are continued (resume) or left alone.
    if previous and params.resume is None:
        raise ParamError(f"out_dir {out_dir} already holds a run ({', '.join(previous)}); choose another "
                         "out_dir, or continue that run with resume: latest")
    return out_dir


def prepare(params: TrainParams, dist: DistContext | None = None) -> Run:
    """Resolve and check everything a run needs without writing to out_dir.

    `dist` is given inside torchrun workers; without it a multi-process
    parameter set is checked here for the launcher, and the model stays on the CPU.
    """
    dist = dist or DistContext()
    device = resolve_device(params.device, dist.local_rank)
    if dist.active and dist.world_size != params.world_size:
        raise ParamError(f"torchrun started {dist.world_size} processes but nproc_per_node x nnodes = "
                         f"{params.world_size}")
    if device.type == "cuda" and params.nproc_per_node > torch.cuda.device_count():
        raise ParamError(f"nproc_per_node {params.nproc_per_node} exceeds the {torch.cuda.device_count()} "
                         "visible CUDA devices")
    if params.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ParamError(f"bf16: true but {torch.cuda.get_device_name(device)} does not support bfloat16")
    torch.manual_seed(params.seed)
    resume_state = None
    if params.resume is not None and (resolve_path(params.out_dir or "") / "COMPLETE").is_file():
        raise ParamError(f"out_dir {resolve_path(params.out_dir)} holds a completed run: nothing to resume")
    if params.resume is not None:
        checkpoint_dir = (latest_resumable(resolve_path(params.out_dir) / "checkpoints") if params.resume == "latest"
                          else resolve_path(params.resume))
        model = load_checkpoint(checkpoint_dir)
        resume_state = load_trainer_state(checkpoint_dir)
        model_source, model_name = f"resumed from {checkpoint_dir} at step {resume_state['step']}", "resumed"
    elif params.init_checkpoint is not None:
        checkpoint_dir = resolve_path(params.init_checkpoint)
        model = load_checkpoint(checkpoint_dir)
        model_source, model_name = f"checkpoint {checkpoint_dir}", checkpoint_dir.name
    else:
        model = TRMoEModel(_preset(params.model))
        model_source, model_name = f"preset {params.model}", params.model
    config: ModelConfig = model.config
    if params.seq_len > config.max_position_embeddings:
        raise ParamError(f"seq_len {params.seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    if params.data == "embedded":
        data_root = ensure_embedded_shard(resolve_path("outputs/data"))
    else:
        data_root = resolve_path(params.data)
    if dist.active:  # a torchrun worker: its launcher ran the preflight, token checks and hashes included
        train_data, eval_data = (open_shard(data_root, partition, vocab_size=config.vocab_size,
                                            seq_len=params.seq_len, check_tokens=False)
                                 for partition in ("train", "eval"))
        reports = None
    else:
        (train_data, train_report), (eval_data, eval_report) = (
            preflight(data_root, partition, vocab_size=config.vocab_size, seq_len=params.seq_len,
                      require_release_ready=params.require_release_ready) for partition in ("train", "eval"))
        reports = {"train": train_report, "eval": eval_report}
    pack_plan = plan_packs(train_data.lengths, params.seq_len) if params.pack_sequences else None
    # No example exceeds seq_len (checked above), so every supervised label is visible in its window.
    loss_weights = (derive_loss_weights(params.loss_groups, train_data.rows, train_data.supervised_counts,
                                        params.max_task_loss_weight) if params.loss_groups is not None else None)
    grad_accum = gradient_accumulation(params.global_batch, params.micro_batch_per_rank, params.world_size)
    # Fill-ins pad the last global batch of an epoch, so it is always whole; packed, a unit is a window.
    units = len(pack_plan) if pack_plan is not None else len(train_data)
    steps_per_epoch, total_steps, warmup_steps = schedule_steps(units, params)
    estimate = memory_estimate(config, params.micro_batch_per_rank, params.seq_len, params.bf16, params.grad_ckpt,
                               device_memory_bytes(device))
    strategy = choose_strategy(params.strategy, estimate) if params.world_size > 1 else "single"
    # Only global rank 0 (node 0) judges out_dir; the others may find it already being written.
    judges = dist.is_main and params.node_rank == 0
    out_dir = _out_dir(params, model_name) if judges else resolve_path(params.out_dir or "")
    model.grad_ckpt = params.grad_ckpt
    kernels = plan_kernels(params.use_custom_kernels, params.require_liger, device)
    model.use_kernels(kernels)
    run = Run(params, device, model, model_source, data_root, train_data, eval_data, out_dir,
              grad_accum, steps_per_epoch, total_steps, warmup_steps, dist, strategy, estimate, kernels, resume_state,
              pack_plan, loss_weights, reports)
    if resume_state is not None:
        _check_resumable(resume_state, run, checkpoint_dir)
    if not run.launches_workers:
        model.to(device)
    return run


def schedule_steps(train_examples: int, params: TrainParams) -> tuple[int, int, int]:
    """Optimizer steps per epoch, in all, and of warm-up."""
    # Fill-ins pad the last global batch of an epoch, so it is always whole.
    steps_per_epoch = math.ceil(train_examples / params.global_batch)
    total_steps = params.max_steps if params.max_steps is not None else params.epochs * steps_per_epoch
    return steps_per_epoch, total_steps, math.ceil(params.warmup_ratio * total_steps)


def count_train_examples(data: str) -> int:
    """Train examples of `data` from its index alone (the embedded set's count is known before it is written)."""
    if data == "embedded":
        return sum(count for _, count in TASKS.values())
    index = resolve_path(data) / "train" / "sft.idx.json"
    if not index.is_file():
        raise ShardError(f"{index}: missing (is {index.parent.parent} a shard root with train/ and eval/?)")
    try:
        return int(json.loads(index.read_text())["examples"])
    except (ValueError, KeyError, TypeError) as err:
        raise ShardError(f"{index}: no example count ({type(err).__name__}: {err})") from None


def model_config(params: TrainParams) -> tuple[ModelConfig, str]:
    """The architecture a run would train, and where it comes from, read without building the model."""
    if params.resume is not None:
        checkpoint_dir = (latest_resumable(resolve_path(params.out_dir) / "checkpoints") if params.resume == "latest"
                          else resolve_path(params.resume))
        return load_config(checkpoint_dir), f"resumed from {checkpoint_dir}"
    if params.init_checkpoint is not None:
        return load_config(resolve_path(params.init_checkpoint)), f"checkpoint {params.init_checkpoint}"
    return _preset(params.model), f"preset {params.model}"


def batch_arithmetic(params: TrainParams) -> dict:
    """A run's batch, schedule and memory figures from its parameters, the model's config and the data's
    index alone: nothing is built or loaded (prepare() then checks everything for real)."""
    config, source = model_config(params)
    train_examples = count_train_examples(params.data)
    steps_per_epoch, total_steps, warmup_steps = schedule_steps(train_examples, params)
    device = resolve_device(params.device)
    estimate = memory_estimate(config, params.micro_batch_per_rank, params.seq_len, params.bf16, params.grad_ckpt,
                               device_memory_bytes(device))
    return {"model": source, "params_total": config.num_parameters(), "world_size": params.world_size,
            "grad_accum": gradient_accumulation(params.global_batch, params.micro_batch_per_rank, params.world_size),
            "tokens_per_step": params.global_batch * params.seq_len, "train_examples": train_examples,
            "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "warmup_steps": warmup_steps,
            "device": str(device), "memory_estimate": estimate,
            "strategy": choose_strategy(params.strategy, estimate) if params.world_size > 1 else "single"}


def describe_arithmetic(figures: dict, params: TrainParams) -> str:
    """batch_arithmetic's figures as the lines a person checks before a run."""
    memory = figures["memory_estimate"]
    return "\n".join([
        f"model            {figures['model']}: {figures['params_total']:,} parameters",
        f"accumulation     {figures['grad_accum']} = global {params.global_batch} / (micro "
        f"{params.micro_batch_per_rank} x world {figures['world_size']})",
        f"tokens per step  up to {figures['tokens_per_step']:,} (global {params.global_batch} x seq_len "
        f"{params.seq_len}; each microbatch is padded to its longest example)",
        f"steps per epoch  {figures['steps_per_epoch']:,} ({figures['train_examples']:,} train examples / global "
        f"{params.global_batch})" + ("; packed, a step takes windows of several examples, so fewer: prepare() "
                                     "plans the windows and prints the real count" if params.pack_sequences else ""),
        f"optimizer steps  {figures['total_steps']:,}" + (" (max_steps)" if params.max_steps is not None else
                                                          f" ({params.epochs} epochs)")
        + f", {figures['warmup_steps']:,} of warm-up",
        f"memory estimate  {_size(memory['total_bytes'])} per rank of {_size(memory['device_bytes'])} on "
        f"{figures['device']} (model + AdamW {_size(memory['model_and_optimizer_bytes'])}, activations "
        f"{_size(memory['activation_bytes'])}); "
        + ("fits one device" if memory["fits_one_device"] else "does not fit one device")
        + (f", strategy {figures['strategy']}" if figures["world_size"] > 1 else ""),
    ])


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def schedule_signature(run: Run) -> dict:
    """What a resumed run must share with the one it continues: the stream and the schedule."""
    p = run.params
    return {"train_examples": len(run.train_data), "total_steps": run.total_steps, "warmup_steps": run.warmup_steps,
            "lr": p.lr, "weight_decay": p.weight_decay, "beta1": p.beta1, "beta2": p.beta2,
            "pack_sequences": p.pack_sequences, "loss_groups": p.loss_groups}


# What checkpoints written before a signature key existed were trained with.
_SIGNATURE_DEFAULTS = {"pack_sequences": False, "loss_groups": None}


def _check_resumable(state: dict, run: Run, checkpoint_dir: Path) -> None:
    """A resumed run must cut the same stream into the same global batches, on the same schedule."""
    params = run.params
    now = {"seed": params.seed, "global_batch": params.global_batch, **schedule_signature(run)}
    for name, value in now.items():
        then = state.get(name, _SIGNATURE_DEFAULTS.get(name))
        if then != value:
            raise ParamError(f"{checkpoint_dir} was written with {name} {then}, this run has {value}: "
                             "a resumed run continues the same stream and schedule; start a new run "
                             "(init_checkpoint) to change them")
    if state["world_size"] != params.world_size and not params.allow_world_size_change:
        raise ParamError(f"{checkpoint_dir} was written by {state['world_size']} process(es), this run has "
                         f"{params.world_size}; set allow_world_size_change: true to resume anyway (the global "
                         "batch stays the same, the per-rank split and accumulation change)")


def _preset(name: str) -> ModelConfig:
    try:
        return preset(name)
    except ValueError as err:
        raise ParamError(f"model: {err}") from None


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to the peak, then one cosine to zero at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, decay_steps) / decay_steps))


def make_optimizer(model: torch.nn.Module, params: TrainParams, device: torch.device,
                   fused: bool = True) -> torch.optim.AdamW:
    # Norm gains are scale parameters; decaying them toward 0 fights the normalisation.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=params.lr, betas=(params.beta1, params.beta2),
                             fused=fused and device.type == "cuda")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor to the GPU from pinned memory without waiting: the host goes on launching meanwhile."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(self, run: Run, progress: bool = True) -> None:
        if run.launches_workers:
            raise ParamError("this parameter set runs on several processes: use cflib.launch.fit(run), "
                             "which starts torchrun")
        self.run, self.params, self.device, self.model = run, run.params, run.device, run.model
        self.dist = run.dist
        self.progress = progress and self.dist.is_main
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the record's peak is this run's alone
        # FSDP shards the model in place, so the optimizer is built after wrapping.
        self.train_model = wrap_model(self.model, run.strategy, self.dist, self.device)
        self.optimizer = make_optimizer(self.model, self.params, self.device, fused=run.strategy != "fsdp")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, run.warmup_steps, run.total_steps))
        self.loss = SFTLoss(run.kernels)
        self.metrics = MetricsLog(run.out_dir / "metrics.jsonl")  # appends only once fit() writes
        self.step = 0
        self.evals: list[dict] = []
        self.checkpoints: dict[str, str] = {}
        self.best_loss = math.inf
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0}
        self.steady = {"tokens": 0, "supervised_tokens": 0, "seconds": 0.0, "steps": 0}
        self.fill_ins: list[int] = []
        self.bad_steps = 0  # consecutive non-finite steps
        self.position = (0, 0)  # (epoch, global batches done in it)
        weights = run.loss_weights
        self.example_weights = torch.from_numpy(weights.example_weights()).float() if weights else None
        self.trained_mass = np.zeros(len(weights.cells)) if weights else None  # weighted tokens per cell, consumed
        self.train_kernel_path: dict | None = None  # read back after a training step: evaluation runs unpacked
        if run.resume_state is not None:
            self._restore(run.resume_state)
        # The first steps pay for allocator growth and kernel selection: not steady state.
        self.warmup_exclude = min(3, max(run.total_steps // 5, 0))

    def _restore(self, state: dict) -> None:
        saved = state["optimizer"]
        if saved["param_groups"] and saved["param_groups"][0]["params"] and isinstance(
                saved["param_groups"][0]["params"][0], int):
            self.optimizer.load_state_dict(saved)  # written before optimizer state was keyed by parameter name
        else:  # keyed by parameter name, whole: any strategy (single, DDP, FSDP shards) takes its part
            set_optimizer_state_dict(self.model, self.optimizer, saved, options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.position = state["step"], (state["epoch"], state["batch_in_epoch"])
        self.evals, self.best_loss, self.fill_ins = state["evals"], state["best_loss"], state["fill_ins"]
        self.checkpoints, self.timing = state["checkpoints"], state["timing"]
        if self.trained_mass is not None and state.get("trained_mass") is not None:
            self.trained_mass = np.asarray(state["trained_mass"], dtype=np.float64)
        torch.set_rng_state(state["torch_rng"])

    def _trainer_state(self, optimizer_state: dict) -> dict:
        epoch, batch_in_epoch = self.position
        return {"optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "world_size": self.dist.world_size, "global_batch": self.params.global_batch,
                "seed": self.params.seed, "best_loss": self.best_loss, "evals": self.evals,
                "fill_ins": self.fill_ins, "torch_rng": torch.get_rng_state(), "checkpoints": self.checkpoints,
                "trained_mass": None if self.trained_mass is None else self.trained_mass.tolist(),
                "timing": self.timing, **schedule_signature(self.run)}

    # --- evaluation and checkpoints -------------------------------------------------
    @property
    def evaluates(self) -> bool:
        """Rank 0 evaluates alone, except under FSDP, where every rank holds a shard of each forward."""
        return self.dist.is_main or self.run.strategy == "fsdp"

    def evaluate(self, tag: str, epoch: int, with_exact_match: bool) -> dict:
        p = self.params
        _sync(self.device)
        start = time.perf_counter()
        result = {"tag": tag, "step": self.step, "epoch": epoch}
        result.update(eval_loss(self.model, self.run.eval_data, p.eval_micro_batch or p.micro_batch_per_rank,
                                self.device, p.bf16, p.loss_chunk_tokens, p.fp32_loss))
        if with_exact_match and p.exact_match_limit != 0:
            matched = exact_match(self.model, self.run.eval_data, self.device, p.bf16, p.exact_match_limit)
            result.update(exact_match=matched["exact_match"], exact_match_by_group=matched["exact_match_by_group"],
                          exact_match_samples=matched["samples"])
        _sync(self.device)
        result["seconds"] = time.perf_counter() - start
        self.timing["eval_s"] += result["seconds"]
        self.evals.append(result)
        if self.dist.is_main:
            self.metrics.write(event="eval", **{k: v for k, v in result.items() if k != "exact_match_samples"})
            summary = f"eval {tag} step {self.step}: loss {result['loss']:.4f}"
            if "exact_match" in result:
                summary += f", exact match {result['exact_match']['overall']:.3f}"
            tqdm.write(summary)
        return result

    def save(self, name: str, epoch: int, resumable: bool | None = None) -> None:
        """Rank 0 writes; under FSDP every rank first joins in gathering the full weights."""
        if not self.params.save_checkpoints:
            return
        resumable = self.params.save_optimizer_state if resumable is None else resumable
        start = time.perf_counter()
        weights = optimizer_state = None
        fsdp = self.run.strategy == "fsdp"
        if fsdp:  # every rank joins the gathers; rank 0 receives the whole
            weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
        if resumable and (fsdp or self.dist.is_main):
            # Keyed by parameter name and whole, so a run on another strategy or world size can resume it.
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
                full_state_dict=True, cpu_offload=fsdp))
        if self.dist.is_main:
            state = self._trainer_state(optimizer_state) if resumable else None
            progress = {"step": self.step, "epoch": self.position[0], "batch_in_epoch": self.position[1]}
            target = self.run.out_dir / "checkpoints" / name
            try:
                path = save_checkpoint(self.model, target, state, weights, progress if resumable else None)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                kept = [p for n, p in self.checkpoints.items() if n != "best_step"]
                raise CheckpointError(f"out of disk space writing checkpoint {target}; it was not written and "
                                      f"the earlier checkpoints are intact: {kept or 'none yet'}") from err
            self.checkpoints.pop(name, None)  # re-inserted last: the dict's order is the saving order
            self.checkpoints[name] = str(path)
            self._prune_checkpoints()
        self.timing["checkpoint_s"] += time.perf_counter() - start

    def _prune_checkpoints(self) -> None:
        """Keep the newest save_total_limit checkpoints; "best" is never pruned."""
        limit = self.params.save_total_limit
        rolling = [name for name in self.checkpoints if name not in ("best", "best_step")]
        for name in rolling[:-limit] if limit else ():
            shutil.rmtree(self.checkpoints.pop(name), ignore_errors=True)

    def evaluation_point(self, tag: str, epoch: int, with_exact_match: bool, checkpoint: str | None = None) -> None:
        """Evaluate, keep the best weights, write the scheduled checkpoint; then every rank goes on together."""
        if self.evaluates:
            result = self.evaluate(tag, epoch, with_exact_match)
            improved = result["loss"] < self.best_loss and self.step > 0
            if self.run.strategy == "fsdp":  # every rank evaluated, and the save gathers: rank 0 decides
                improved = self.dist.agree(improved)
            if improved:
                self.best_loss = result["loss"]
                self.save("best", epoch)
                if "best" in self.checkpoints:
                    self.checkpoints["best_step"] = str(self.step)
        if checkpoint is not None:
            self.save(checkpoint, epoch)
        self.dist.barrier()

    # --- training -------------------------------------------------------------------
    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Only the last microbatch of a step all-reduces gradients."""
        if self.run.strategy == "ddp":
            return contextlib.nullcontext() if enabled else self.train_model.no_sync()
        if self.run.strategy == "fsdp":
            self.train_model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def batch(self, units: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """input_ids, labels, document_ids (packed) and token_weights (weighted) of some units, on the device."""
        data, plan = self.run.train_data, self.run.pack_plan
        document_ids = None
        if plan is None:
            input_ids, labels = collate([data[int(i)] for i in units], data.eos_token_id)
            example_index = torch.as_tensor(np.asarray(units, dtype=np.int64))[:, None].expand_as(labels)
        else:
            input_ids, labels, document_ids, example_index = collate_packed(data, plan, units)
        token_weights = None
        if self.example_weights is not None:  # padding (-1) takes any weight: its label is -100
            token_weights = to_device(self.example_weights[example_index.clamp(min=0)], self.device)
        if document_ids is not None:
            document_ids = to_device(document_ids, self.device)
        return to_device(input_ids, self.device), to_device(labels, self.device), document_ids, token_weights

    def train_step(self, step_units: np.ndarray) -> dict:
        p, data = self.params, self.run.train_data
        step_examples = self.run.examples_of(step_units)
        # Every rank knows the whole step's examples, so every rank divides by the same count (or mass).
        step_supervised = data.supervised_tokens(step_examples)
        step_mass = step_supervised
        if self.example_weights is not None:
            cell_mass = self.run.loss_weights.cell_mass(step_examples, data.supervised_counts)
            self.trained_mass += cell_mass
            step_mass = float(cell_mass.sum())
        mine = rank_share(step_units, self.dist)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        _sync(self.device)
        start = time.perf_counter()
        micro_starts = range(0, len(mine), p.micro_batch_per_rank)
        for micro_start in micro_starts:
            input_ids, labels, document_ids, token_weights = self.batch(
                mine[micro_start:micro_start + p.micro_batch_per_rank])
            with self._gradient_sync(micro_start == micro_starts[-1]):
                with autocast(self.device, p.bf16):
                    hidden = self.train_model(input_ids, document_ids)
                    loss_sum, _ = self.loss(hidden, self.model.head_weight, labels, p.loss_chunk_tokens, p.fp32_loss,
                                            token_weights=token_weights)
                # The step's (weighted) token mean, times world size: data parallelism averages gradients.
                (loss_sum * (self.dist.world_size / step_mass)).backward()
            totals[0] += loss_sum.detach().double()
            totals[1] += labels.numel()
        totals = self.dist.sum(totals)  # every rank sees the global loss and agrees
        # The norm is measured even unclipped (max_norm inf), so a non-finite gradient is caught here.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.max_grad_norm or math.inf)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor
        lr = self.scheduler.get_last_lr()[0]
        on_device = all(group.get("fused") for group in self.optimizer.param_groups)
        if on_device:
            # The fused AdamW skips a non-finite step on the device (found_inf, as under GradScaler), so the
            # host queues the update while the backward still runs instead of waiting to read the norm.
            self.optimizer.found_inf = (~torch.isfinite(totals[0] + norm.double())).float()
            self.optimizer.step()
            self._end_step()
        loss_total, tokens, grad_norm = torch.stack([totals[0], totals[1], norm.double()]).tolist()
        tokens = int(tokens)
        loss = loss_total / step_mass
        finite = math.isfinite(loss) and math.isfinite(grad_norm)  # global values: every rank agrees
        self.bad_steps = 0 if finite else self.bad_steps + 1
        if self.bad_steps > p.nan_patience:
            self._stop_non_finite(loss, grad_norm, step_examples)
        if not on_device:
            if finite:
                self.optimizer.step()
            self._end_step()
        _sync(self.device)
        seconds = time.perf_counter() - start
        self.train_kernel_path = self.model.kernel_path()
        self.step += 1
        self.timing["train_s"] += seconds
        if self.step > self.warmup_exclude:
            self.steady["tokens"] += tokens
            self.steady["supervised_tokens"] += step_supervised
            self.steady["seconds"] += seconds
            self.steady["steps"] += 1
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "supervised_tokens": step_supervised, "seconds": seconds, "skipped": not finite}

    def _end_step(self) -> None:
        with warnings.catch_warnings():  # torch warns when the schedule moves without an optimizer step
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()  # a skipped step still consumes its data and its place in the schedule
        self.optimizer.zero_grad(set_to_none=True)  # stream-ordered: the update queued before still reads them

    def _stop_non_finite(self, loss: float, grad_norm: float, step_examples: np.ndarray) -> None:
        rows = self.run.train_data.rows
        ids = [rows[int(i)].get("example_id", int(i)) for i in step_examples[:8]]
        saved = [path for name, path in self.checkpoints.items() if name != "best_step"]
        last_good = saved[-1] if saved else "none yet"
        raise FloatingPointError(
            f"step {self.step + 1}: loss {loss}, gradient norm {grad_norm}, after {self.bad_steps} non-finite "
            f"step(s) in a row (nan_patience {self.params.nan_patience}); the optimizer skipped the step, so "
            f"no non-finite weight was written. Batch examples (first 8): {ids}. Last checkpoint: {last_good}")

    def fit(self) -> dict:
        run, p = self.run, self.params
        started = time.perf_counter()
        if self.dist.is_main:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            if run.resume_state is not None:
                self.metrics.truncate_after(self.step)  # what the interrupted run logged past its checkpoint
            write_json_atomic(run.out_dir / "params.json", {**asdict(p), "out_dir": str(run.out_dir)})
            if run.loss_weights is not None:  # the audit is on disk before the first step
                write_json_atomic(run.out_dir / "loss_weighting.json", self.loss_weighting())
        self.model.train()
        last_eval_step = self.evals[-1]["step"] if self.evals else -1
        if run.resume_state is None and (p.eval_at_start or run.total_steps == 0):
            self.evaluation_point("start", 0, with_exact_match=True)
            last_eval_step = 0
        epoch, batches_done = self.position  # the epoch in progress (0 before the first), its batches done
        if 0 < batches_done < run.steps_per_epoch:
            epoch -= 1  # resumed mid-epoch: the loop below re-enters that epoch where it stopped
        else:
            batches_done = 0
        log_every = max(1, run.total_steps // 10)
        bar = tqdm(total=run.total_steps, initial=self.step, desc="train", unit="step", disable=not self.progress)
        while self.step < run.total_steps:
            epoch += 1
            order, fill_ins = epoch_stream(run.train_units, p.seed, epoch, p.global_batch)
            if batches_done == 0:
                self.fill_ins.append(fill_ins)
            for batch_start in range(batches_done * p.global_batch, len(order), p.global_batch):
                row = self.train_step(order[batch_start:batch_start + p.global_batch])
                self.position = (epoch, batch_start // p.global_batch + 1)
                if self.dist.is_main:
                    self.metrics.write(event="train", epoch=epoch, **row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                if self.step % log_every == 0:  # a text trace too: papermill keeps no live widget state
                    rank = f"[rank {self.dist.rank}] " if self.dist.active else ""
                    tqdm.write(f"{rank}step {self.step}/{run.total_steps} epoch {epoch} loss {row['loss']:.4f} "
                               f"lr {row['lr']:.2e} {row['tokens'] / row['seconds']:,.0f} tokens/s")
                if batch_start + p.global_batch >= len(order):  # the epoch ran to its end
                    self.evaluation_point(f"epoch-{epoch}", epoch, with_exact_match=True, checkpoint=f"epoch-{epoch}")
                    last_eval_step = self.step
                elif p.eval_every_steps and self.step % p.eval_every_steps == 0 and self.step < run.total_steps:
                    self.evaluation_point("periodic", epoch, with_exact_match=False)
                    last_eval_step = self.step
                if p.save_every_steps and self.step % p.save_every_steps == 0 and self.step < run.total_steps:
                    self.save(f"step-{self.step}", epoch, resumable=True)
                    self.dist.barrier()
                if self.step >= run.total_steps:
                    break
            batches_done = 0
        bar.close()
        if last_eval_step != self.step:
            self.evaluation_point("end", epoch, with_exact_match=True, checkpoint="last" if self.step > 0 else None)
        if not self.dist.is_main:
            return {}
        record = self.record(dict(self.evals[-1]), epoch, time.perf_counter() - started)
        write_json_atomic(run.out_dir / "record.json", record)
        # Written last: its presence says the record and every checkpoint are final.
        write_json_atomic(run.out_dir / "COMPLETE", {"completed_utc": record["created_utc"],
                                                     "steps": self.step})
        return record

    # --- the record -----------------------------------------------------------------
    def loss_weighting(self) -> dict | None:
        """The audit: raw shares, targets, coefficients, the achieved shares, and those trained so far."""
        weights = self.run.loss_weights
        if weights is None:
            return None
        return {"max_task_loss_weight": weights.max_task_loss_weight,
                "normalisation": "sum of weighted token losses / weighted supervised tokens of the step",
                "cells": weights.audit(self.trained_mass)}

    def record(self, final: dict, epochs_done: int, wall_s: float) -> dict:
        run, p, model = self.run, self.params, self.model
        config = model.config
        steady_s = self.steady["seconds"]
        tokens_per_s = self.steady["tokens"] / steady_s if steady_s else None
        flops_per_token = 6 * config.active_parameters() + 6 * config.num_hidden_layers * config.hidden_size * p.seq_len
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        eval_block: dict[str, Any] = {"final": final, "history": self.evals}
        at_start = next((e for e in self.evals if e["tag"] == "start"), None)
        if at_start is not None:
            eval_block["at_start"] = at_start
        eval_block["epochs"] = [e for e in self.evals if e["tag"].startswith("epoch-")]
        return {
            "job": "train_sft",
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "out_dir": str(run.out_dir),
            # measurement protocol (DESIGN.md)
            "framework": {"cflib": __version__, **framework_versions()},
            "device": device_info(self.device, count=self.dist.world_size),
            "world_size": self.dist.world_size,
            "strategy": run.strategy,
            "memory_estimate": run.memory_estimate,
            "kernel_path": {**(self.train_kernel_path or model.kernel_path()), "loss": self.loss.last_backend},
            "kernels_requested": {"use_custom_kernels": p.use_custom_kernels, "require_liger": p.require_liger,
                                  "notes": list(run.kernels.notes)},
            **count_parameters(model),
            "params_active": config.active_parameters(),
            "vocab_size": config.vocab_size,
            "seq_len": p.seq_len,
            "micro_batch_per_rank": p.micro_batch_per_rank,
            "global_batch": p.global_batch,
            "grad_accum": run.grad_accum,
            "precision": "bf16-autocast" if p.bf16 else "fp32",
            "loss_precision": "fp32" if p.fp32_loss else ("bf16" if p.bf16 else "fp32"),
            "grad_ckpt": p.grad_ckpt,
            "loss_chunk_tokens": p.loss_chunk_tokens,
            "telemetry": "tqdm progress + metrics.jsonl per step (host sync once per step)",
            "compiled": False,
            "timing_protocol": {
                "warmup_steps_excluded": self.warmup_exclude,
                "sync_boundaries": "torch.cuda.synchronize before and after each timed optimizer step"
                if self.device.type == "cuda" else "host timers around each optimizer step (CPU: synchronous)",
                "includes_eval": False,
                "includes_checkpoint_io": False,
                "tokens_counted": "padded tokens fed to the model",
            },
            "throughput": {
                "steady_state_tokens_per_s": tokens_per_s,
                "steady_state_supervised_tokens_per_s": self.steady["supervised_tokens"] / steady_s if steady_s else None,
                "timed_steps": self.steady["steps"],
                "model_flops_per_token": flops_per_token,
                "model_tflops_per_s": tokens_per_s * flops_per_token / 1e12 if tokens_per_s else None,
                "peak_memory_gib": peak,
            },
            "timing": {**self.timing, "wall_s": wall_s},
            # the run
            "model_source": run.model_source,
            "model_config": config.to_dict(),
            "data": {"root": str(run.data_root), "train_examples": len(run.train_data),
                     "eval_examples": len(run.eval_data), "vocab_size": run.train_data.vocab_size,
                     "eos_token_id": run.train_data.eos_token_id, "max_seq_len": run.train_data.max_seq_len,
                     "preflight": run.preflight},
            "packing": run.packing_efficiency(),
            "loss_weighting": self.loss_weighting(),
            "schedule": {"steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
                         "warmup_steps": run.warmup_steps, "steps_done": self.step, "epochs_started": epochs_done,
                         "fill_ins_per_epoch": self.fill_ins},
            "params": asdict(p),
            "eval": eval_block,
            "checkpoints": self.checkpoints,
        }


def train(params: TrainParams | dict, progress: bool = True) -> dict:
    """Check everything, then train (here or through torchrun); returns the record of out_dir/record.json."""
    from .launch import fit  # launch builds on this module

    if isinstance(params, dict):
        params = TrainParams.from_dict(params)
    run = prepare(params)
    print(run.describe())
    return fit(run, progress=progress)
