"""A run, checked before anything is written: `prepare(params) -> Run`.

`prepare` resolves the device, the model (preset, init checkpoint or resumed
checkpoint), the data (preflight, packing plan, loss weights), the batch
arithmetic and the execution plan, and fails with a message naming the culprit
before `out_dir` is touched. `batch_arithmetic` gives the same figures from
the parameters alone, for the notebook's form. The loop is cflib.train.trainer.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from cflib.atomic import check_writable_folder, live_path
from cflib.data.filters import parse_filters, select
from cflib.data.packing import PackedWindows, pack_examples
from cflib.data.preflight import preflight
from cflib.data.shards import ShardError, ShardPartition, open_shard
from cflib.data.tasks import TASKS, ensure_embedded_shard
from cflib.data.weighting import LossWeights, audit_table, derive_loss_weights
from cflib.jobs import job_out_dir
from cflib.model.checkpoint import latest_resumable, load_trainer_state
from cflib.model.config import ModelConfig, preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import adapter_parameter_count
from cflib.paths import resolve_path
from cflib.train.adapters import LoraRun, checkpoint_config, initial_model, resumed_model
from cflib.train.distributed import DistContext, choose_strategy, device_memory_bytes, memory_estimate
from cflib.train.execution import ExecutionPlan, apply_to_model, plan_execution
from cflib.train.lock import check_not_locked
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import count_parameters, read_metrics
from cflib.train.resume_identity import TRAINER_STATE_KEYS, check_resumable, run_identity

RUN_FILES = ("record.json", "metrics.jsonl", "params.json", "checkpoints", "COMPLETE")
# What a run replaces whole (cflib.atomic): their staging files are leftovers to clean at the next start.
RUN_JSON_FILES = ("record.json", "params.json", "loss_weighting.json", "COMPLETE", "metrics.jsonl")


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
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    dist: DistContext
    strategy: str
    memory_estimate: dict
    plan: ExecutionPlan
    resume_state: dict | None = None  # trainer state of the checkpoint this run continues
    packed: PackedWindows | None = None  # pack_sequences: the windows, computed once
    loss_weights: LossWeights | None = None  # loss_groups: every cell's coefficient
    preflight: dict | None = None  # partition -> report; None in torchrun workers (the launcher checked)
    lora: LoraRun | None = None  # full_parameter: false: the adapters' settings and their base
    filter_counts: dict | None = None  # filters: the examples each one kept (cflib.data.filters)

    @property
    def train_units(self) -> int:
        """What an epoch shuffles and a global batch counts: packed windows, or examples."""
        return len(self.packed) if self.packed is not None else len(self.train_data)

    def examples_of(self, units: np.ndarray) -> np.ndarray:
        return self.packed.examples_of(units) if self.packed is not None else units

    @property
    def launches_workers(self) -> bool:
        """True in the process that starts torchrun: it checks, the workers train."""
        return self.params.world_size > 1 and not self.dist.active

    def describe(self) -> str:
        p = self.params
        tokens = int(self.train_data.lengths.sum())
        return "\n".join([
            f"model        {self.model_source}: {count_parameters(self.model)['params_total']:,} parameters",
            *([f"lora         {self.lora.describe()}: {count_parameters(self.model)['params_trainable']:,} "
               "trainable"] if self.lora is not None else []),
            f"data         {self.data_root}: {len(self.train_data):,} train / {len(self.eval_data):,} eval "
            f"examples, {tokens:,} train tokens",
            *([self._packing_line()] if self.packed is not None else []),
            f"batch        global {p.global_batch} {'windows' if self.packed else 'examples'} = micro "
            f"{p.micro_batch_per_rank} x world {p.world_size} x accumulation {p.grad_accum}",
            f"schedule     {self.steps_per_epoch} steps/epoch, {self.total_steps} optimizer steps, "
            f"{self.warmup_steps} warm-up, lr {p.lr:g} cosine",
            f"device       {self.device} ({'bf16 autocast' if p.bf16 else 'fp32'}), "
            f"{p.nnodes} node(s) x {p.nproc_per_node} process(es), strategy {self.strategy} "
            f"(estimated {self.memory_estimate['total_bytes'] / 2**30:.1f} GiB of "
            f"{self.memory_estimate['device_bytes'] / 2**30:.0f} per device)",
            f"plan         {self.plan.describe()}",
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
        if self.packed is None:
            return None
        return self.packed.efficiency(self.train_data.lengths, self.train_data.supervised_counts)


def never_trained(out_dir: Path) -> bool:
    """Whether the run in `out_dir` stopped before its first optimizer step (building the trainer, the
    evaluation at start or the first step failed): it left nothing worth keeping, so a new run may start there."""
    if (out_dir / "record.json").exists() or (out_dir / "COMPLETE").exists():
        return False
    checkpoints = out_dir / "checkpoints"
    if checkpoints.exists() and not (checkpoints.is_dir() and not any(checkpoints.iterdir())):
        return False
    metrics = out_dir / "metrics.jsonl"
    try:
        return not metrics.exists() or not any(row.get("event") == "train" for row in read_metrics(metrics))
    except ValueError:  # rows that cannot be read may be steps: leave them alone
        return False


def _out_dir(params: TrainParams, model_name: str) -> Path:
    # Never mix or overwrite: another run's artifacts are continued (resume) or left alone; one that never
    # trained left none.
    reusable = params.resume is not None or (params.out_dir is not None
                                             and never_trained(resolve_path(params.out_dir)))
    holds = () if reusable else RUN_FILES
    out_dir = job_out_dir(params.out_dir, "runs", holds, "a run", name=model_name,
                          hint="choose another out_dir, or continue that run with resume: latest")
    if params.out_dir is not None:
        check_writable_folder(out_dir, "out_dir")
    return out_dir


def recheck_out_dir(run: "Run") -> None:
    """prepare's out_dir verdict again, once the lock is held: another run may have written it in between."""
    if run.params.out_dir is None:
        return
    if run.resume_state is not None and (run.out_dir / "COMPLETE").is_file():
        raise ParamError(f"out_dir {run.out_dir} holds a completed run: another run finished it meanwhile")
    if run.resume_state is None:
        _out_dir(run.params, "")


def prepare(params: TrainParams, dist: DistContext | None = None) -> Run:
    """Resolve and check everything a run needs without writing to out_dir.

    `dist` is given inside torchrun workers; without it a multi-process
    parameter set is checked here for the launcher, and the model stays on the CPU.
    """
    if params.curriculum is not None or params.dry_run:
        raise ParamError("curriculum and dry_run are prepared by cflib.train.prepare_job, stage by stage")
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
    if params.out_dir is not None and dist.is_main:  # first: a live run's checkpoints are still changing
        check_not_locked(resolve_path(params.out_dir))
    resume_state = None
    if params.resume is not None and (resolve_path(params.out_dir or "") / "COMPLETE").is_file():
        raise ParamError(f"out_dir {resolve_path(params.out_dir)} holds a completed run: nothing to resume")
    if params.resume is not None:
        checkpoint_dir = resume_dir(params)
        model, lora = resumed_model(checkpoint_dir, params.lora_settings(), params.init_checkpoint)
        resume_state = load_trainer_state(checkpoint_dir, required=TRAINER_STATE_KEYS)
        model_source, model_name = f"resumed from {checkpoint_dir} at step {resume_state['step']}", "resumed"
    elif params.init_checkpoint is not None:
        checkpoint_dir = resolve_path(params.init_checkpoint)
        model, lora = initial_model(checkpoint_dir, params.lora_settings())
        model_source, model_name = f"checkpoint {checkpoint_dir}", checkpoint_dir.name
    else:
        model, lora = TRMoEModel(_preset(params.model)), None
        model_source, model_name = f"preset {params.model}", params.model
    config: ModelConfig = model.config
    check_seq_len(config, params.seq_len)
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
    train_data, filter_counts = kept_examples(params, train_data)
    packed = pack_examples(train_data.lengths, params.seq_len) if params.pack_sequences else None
    # No example exceeds seq_len (checked above), so every supervised label is visible in its window.
    loss_weights = (derive_loss_weights(params.loss_groups, train_data.rows, train_data.supervised_counts,
                                        params.max_task_loss_weight) if params.loss_groups is not None else None)
    # Fill-ins pad the last global batch of an epoch, so it is always whole; packed, a unit is a window.
    units = len(packed) if packed is not None else len(train_data)
    steps_per_epoch, total_steps, warmup_steps = schedule_steps(units, params)
    estimate = memory_figures(config, params, device)
    strategy = choose_strategy(params.strategy, estimate) if params.world_size > 1 else "single"
    plan = plan_execution(params, model, strategy, device)
    apply_to_model(model, plan)
    # Only global rank 0 (node 0) judges out_dir; the others may find it already being written.
    judges = dist.is_main and params.node_rank == 0
    out_dir = _out_dir(params, model_name) if judges else resolve_path(params.out_dir or "")
    run = Run(params, device, model, model_source, data_root, train_data, eval_data, out_dir,
              steps_per_epoch, total_steps, warmup_steps, dist, strategy, estimate, plan, resume_state,
              packed, loss_weights, reports, lora, filter_counts)
    if resume_state is not None:
        check_resumable(resume_state, run, checkpoint_dir)
    if not run.launches_workers:
        model.to(device)
    return run


def check_seq_len(config: ModelConfig, seq_len: int) -> None:
    """seq_len against the model's positions, before anything is written."""
    if seq_len > config.max_position_embeddings:
        raise ParamError(f"seq_len {seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")


def kept_examples(params: TrainParams, train_data: ShardPartition) -> tuple[ShardPartition, dict | None]:
    """The train examples of train_tasks and filters, and each filter's count; an empty result is an error."""
    if params.train_tasks is not None:
        missing = [task for task in params.train_tasks if task not in train_data.tasks()]
        if missing:
            raise ParamError(f"train_tasks: no example of {train_data.directory} has task {missing[0]!r}; its "
                             f"tasks: {', '.join(train_data.tasks())}")
        train_data = train_data.only_tasks(params.train_tasks)
    if params.filters is None:
        return train_data, None
    keep, counts = select(train_data.rows, train_data.supervised_counts, parse_filters(params.filters, "filters"),
                          params.seed)
    if not len(keep):
        emptied = next(key for key, count in counts.items() if count == 0)
        raise ParamError(f"filters: {emptied} keeps no train example of {train_data.directory} ({counts}); "
                         "loosen it")
    return train_data.subset(keep), counts


def schedule_steps(train_examples: int, params: TrainParams) -> tuple[int, int, int]:
    """Optimizer steps per epoch, in all, and of warm-up."""
    # Fill-ins pad the last global batch of an epoch, so it is always whole.
    steps_per_epoch = math.ceil(train_examples / params.global_batch)
    total_steps = params.max_steps if params.max_steps is not None else params.epochs * steps_per_epoch
    return steps_per_epoch, total_steps, math.ceil(params.warmup_ratio * total_steps)


def count_train_examples(data: str, tasks: Sequence[str] | None = None) -> int:
    """Train examples of `data` (of `tasks` only, when named) from its index alone; the embedded set's count
    is known before it is written, and a shard's per-task counts are in its examples.jsonl."""
    if data == "embedded":
        return sum(count for task, (_, count) in TASKS.items() if tasks is None or task in tasks)
    index = resolve_path(data) / "train" / "sft.idx.json"
    if not index.is_file():
        raise ShardError(f"{index}: missing (is {index.parent.parent} a shard root with train/ and eval/?)")
    if tasks is not None:
        return len(ShardPartition(index.parent).only_tasks(tasks))
    try:
        return int(json.loads(index.read_text())["examples"])
    except (ValueError, KeyError, TypeError) as err:
        raise ShardError(f"{index}: no example count ({type(err).__name__}: {err})") from None


def resume_dir(params: TrainParams) -> Path:
    """The checkpoint `resume` names: `latest` is out_dir's newest resumable one; a named one whose replacement
    a kill cut between its renames is its retired copy (cflib.atomic.live_path), as loaders take it."""
    if params.resume == "latest":
        return latest_resumable(resolve_path(params.out_dir) / "checkpoints")
    return live_path(resolve_path(params.resume))


def model_config(params: TrainParams) -> tuple[ModelConfig, str]:
    """The architecture a run would train, and where it comes from, read without building the model."""
    if params.resume is not None:
        checkpoint_dir = resume_dir(params)
        return checkpoint_config(checkpoint_dir), f"resumed from {checkpoint_dir}"
    if params.init_checkpoint is not None:
        return checkpoint_config(resolve_path(params.init_checkpoint)), f"checkpoint {params.init_checkpoint}"
    return _preset(params.model), f"preset {params.model}"


def batch_arithmetic(params: TrainParams) -> dict:
    """A run's batch, schedule and memory figures from its parameters, the model's config and the data's
    index alone: nothing is built or loaded (prepare() then checks everything for real)."""
    config, source = model_config(params)
    train_examples = count_train_examples(params.data, params.train_tasks)
    steps_per_epoch, total_steps, warmup_steps = schedule_steps(train_examples, params)
    device = resolve_device(params.device)
    estimate = memory_figures(config, params, device)
    return {"model": source, "params_total": config.num_parameters(), "world_size": params.world_size,
            "grad_accum": params.grad_accum,
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
    """What a resumed run must share with the one it continues (cflib.train.resume_identity)."""
    return run_identity(run)


def memory_figures(config: ModelConfig, params: TrainParams, device: torch.device) -> dict:
    settings = params.lora_settings()
    lora = None if settings is None else {"trainable_params": adapter_parameter_count(config, settings),
                                          "base_dtype": settings.base_dtype}
    return memory_estimate(config, params.micro_batch_per_rank, params.seq_len, params.bf16, params.grad_ckpt,
                           device_memory_bytes(device), lora=lora)


def _preset(name: str) -> ModelConfig:
    try:
        return preset(name)
    except ValueError as err:
        raise ParamError(f"model: {err}") from None
