"""A run, checked before anything is written: `prepare(params) -> Run`.

`prepare` resolves the device, the model's architecture (from a preset, an
init checkpoint or a resumed checkpoint's config alone), the data (preflight,
packing plan, loss weights) and the batch arithmetic and schedule, then loads
the model (a Hub bundle's weights are downloaded only then) and plans the
execution, and fails with a message naming the culprit before `out_dir` is
touched. `batch_arithmetic` gives the same figures from
the parameters alone, for the notebook's form. The loop is cflib.train.trainer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cflib.atomic import check_writable_folder, live_path
from cflib.data.mixture import MixturePlan, as_mixture, mixture_table
from cflib.data.packing import EpochWindows, PackedWindows, pack_examples
from cflib.data.weighting import LossWeights, audit_table, derive_loss_weights
from cflib.export.pull import HubStart, checkpoint_folder, fetch_bundle, is_hub, resolve_start
from cflib.jobs import job_out_dir
from cflib.jsonio import read_json
from cflib.model.checkpoint import latest_resumable, load_trainer_state
from cflib.model.config import ModelConfig, preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import adapter_parameter_count
from cflib.paths import resolve_path
from cflib.train.adapters import (
    LoraRun,
    checkpoint_config,
    initial_model,
    resumed_model,
    start_adapters,
    with_adapter_settings,
)
from cflib.train.distributed import (
    DistContext,
    choose_strategy,
    device_memory_bytes,
    epoch_stream,
    memory_estimate,
    strategy_costs,
    whole_batches,
    with_teacher,
)
from cflib.train.execution import ExecutionPlan, apply_to_model, plan_execution
from cflib.train.freezing import frozen_weights
from cflib.train.optim import WSD_DECAY_RATIO, LrSchedule
from cflib.train.optimizer_choice import optimizer_memory
from cflib.train.params import ParamError, TrainParams
from cflib.train.positions import describe as describe_positions, run_config
from cflib.train.records import count_parameters, read_metrics
from cflib.train.registered import describe_carried, for_workers
from cflib.train.resume_identity import TRAINER_STATE_KEYS, check_resumable, run_identity
from cflib.train.run_data import Partition, count_train_examples, describe_overlong, kept_data, open_data
from cflib.train.run_folder import check_entries_inside, check_run_folder, refuse_mixing, starts_over
from cflib.train.teacher import Teacher, start_teacher, teacher_bytes, teacher_config

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
    train_data: Partition
    eval_data: Partition
    out_dir: Path
    steps_per_epoch: int
    schedule: LrSchedule  # the steps and the learning rate at each, resolved before step 1
    dist: DistContext
    strategy: str
    memory_estimate: dict
    plan: ExecutionPlan
    resume_state: dict | None = None  # trainer state of the checkpoint this run continues
    packed: PackedWindows | EpochWindows | None = None  # pack_sequences: one shard's, or each epoch's draw's
    loss_weights: LossWeights | None = None  # loss_groups: every cell's coefficient
    preflight: dict | None = None  # partition -> report; None in torchrun workers (the launcher checked)
    lora: LoraRun | None = None  # full_parameter: false: the adapters' settings and their base
    filter_counts: dict | None = None  # filters: the examples each one kept (cflib.data.filters)
    mixture: MixturePlan | None = None  # several sources (or examples_per_epoch): what each epoch draws
    init_adapters: dict | None = None  # a LoRA run from adapters: their place and SHA-256 (start_adapters)
    # The launcher of torchrun's workers: the registered losses, metrics and attention backends they import
    # (cflib.train.registered).
    worker_imports: dict | None = None
    hub_start: HubStart | None = None  # init_checkpoint hub:ORG/NAME: the commit it trains from
    overlong: dict | None = None  # overlong_examples: drop: seq_len and the examples each partition left out
    teacher: Teacher | None = None  # teacher_checkpoint: the frozen model the loss distils from

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, int]:
        """The epoch's units in order, padded to whole global batches, and the fill-in count: one global order,
        the same on every rank (each takes its slice of every global batch) and after a resume."""
        p = self.params
        if isinstance(self.packed, EpochWindows):  # the epoch's draw packed: its windows shuffled like one shard's
            order, fill_ins = epoch_stream(len(self.packed.of_epoch(epoch)), p.seed, epoch, p.global_batch)
            return self.packed.first_window(epoch) + order, fill_ins
        if self.mixture is not None:
            return whole_batches(self.mixture.epoch(epoch), p.global_batch)
        units = len(self.packed) if self.packed is not None else len(self.train_data)
        return epoch_stream(units, p.seed, epoch, p.global_batch)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps epoch `epoch` takes: steps_per_epoch, but for a packed mixture, whose epochs pack into
        their own numbers of windows."""
        if not isinstance(self.packed, EpochWindows):
            return self.steps_per_epoch
        return math.ceil(len(self.packed.of_epoch(epoch)) / self.params.global_batch)

    def epoch_steps(self) -> list[int] | None:
        """A packed mixture's steps in each epoch planned so far, whose draws pack into their own numbers of
        windows; None where every epoch takes steps_per_epoch."""
        if not isinstance(self.packed, EpochWindows):
            return None
        return [self.steps_in_epoch(epoch) for epoch in range(1, len(self.packed.epochs) + 1)]

    def consumed_units(self, steps: int) -> np.ndarray:
        """The units of the first `steps` optimizer steps, fill-ins included."""
        batch, taken, epoch = self.params.global_batch, [], 0
        while steps > 0:
            epoch += 1
            order, _ = self.epoch_order(epoch)
            taken.append(order[:steps * batch])
            steps -= len(order) // batch
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)

    def data_record(self, steps_done: int) -> dict:
        """The record's `data`: the root, the counts, the preflight; a mixture's plan, and the examples and
        supervised tokens each source gave the steps done."""
        data = self.train_data
        block = {"root": str(self.data_root), "train_examples": len(data), "eval_examples": len(self.eval_data),
                 "vocab_size": data.vocab_size, "eos_token_id": data.eos_token_id, "max_seq_len": data.max_seq_len,
                 "preflight": self.preflight, "train_supervised_tokens": data.supervised_tokens(),
                 "overlong": self.overlong, **manifests(data, self.eval_data)}
        if self.mixture is not None:
            consumed = self.examples_of(self.consumed_units(steps_done))
            block["mixture"] = {**self.mixture.record(),
                                "trained": self.mixture.realised(consumed, data.supervised_counts)}
        return block

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
            f"model        {self.model_source}: {count_parameters(self.model)['params_total']:,} parameters"
            + (f", {count_parameters(self.model)['params_trainable']:,} trainable" if self.plan.frozen else ""),
            *([f"lora         {self.lora.describe()}: {count_parameters(self.model)['params_trainable']:,} "
               "trainable"] if self.lora is not None else []),
            *([f"positions    {line}"] if (line := describe_positions(self.model.config)) else []),
            f"data         {self.data_root}: {len(self.train_data):,} train / {len(self.eval_data):,} eval "
            f"examples, {tokens:,} train tokens" if self.mixture is None else self._mixture_lines(),
            *([f"overlong     {describe_overlong(self.overlong)}"] if self.overlong is not None else []),
            *([self._packing_line()] if self.packed is not None else []),
            f"batch        global {p.global_batch} {'windows' if self.packed is not None else 'examples'} = micro "
            f"{p.micro_batch_per_rank} x world {p.world_size} x accumulation {p.grad_accum}",
            f"schedule     {self.steps_per_epoch} steps/epoch{self._epoch_steps()}, {self.total_steps} optimizer "
            f"steps, {self.schedule.describe_warmup()}, lr {p.lr:g} {self.schedule.describe()}",
            f"device       {self.device} ({'bf16 autocast' if p.bf16 else 'fp32'}), "
            f"{p.nnodes} node(s) x {p.nproc_per_node} process(es), strategy {self.strategy} "
            f"(estimated {self.memory_estimate['total_bytes'] / 2**30:.1f} GiB of "
            f"{self.memory_estimate['device_bytes'] / 2**30:.0f} per device)",
            *([self._teacher_line()] if self.teacher is not None else []),
            f"plan         {self.plan.describe()}",
            f"out_dir      {self.out_dir}",
            *([line] if self.worker_imports and (line := describe_carried(self.worker_imports)) else []),
            *([f"loss weights (max_task_loss_weight {p.max_task_loss_weight:g})\n"
               + audit_table(self.loss_weights.audit())] if self.loss_weights else []),
        ])

    def _teacher_line(self) -> str:
        p, teacher = self.params, self.teacher
        return (f"teacher      {teacher.spec}: {teacher.config.num_parameters():,} parameters, frozen "
                f"({_size(self.memory_estimate['teacher_bytes'])} a rank); loss (1 - {p.distill_ratio:g}) x "
                f"cross-entropy + {p.distill_ratio:g} x {p.distill_temperature:g}^2 x KL(teacher || student)")

    def _mixture_lines(self) -> str:
        plan = self.mixture
        return (f"data         a mixture of {len(plan.names)} source(s): {plan.examples_per_epoch:,} examples an epoch, "
                f"{len(self.eval_data):,} eval examples; the first epoch's draw:\n"
                + mixture_table(plan.record(), plan.realised(plan.epoch(1), self.train_data.supervised_counts)))

    def _epoch_steps(self) -> str:
        steps = self.epoch_steps()
        return "" if steps is None else f" in epoch 1 (each epoch's draw packed anew; epochs planned: {steps})"

    def _packing_line(self) -> str:
        packing = self.packing_efficiency()
        epochs = f" over the draws of {packing['epochs']} epoch(s)" if "epochs" in packing else ""
        return (f"packing      {packing['windows']:,} windows of {packing['seq_len']} tokens{epochs}, "
                f"{packing['examples_per_window']:.2f} examples, {packing['real_fraction']:.1%} real and "
                f"{packing['supervised_fraction']:.1%} supervised tokens per window")

    def packing_efficiency(self) -> dict | None:
        if self.packed is None:
            return None
        return self.packed.efficiency(self.train_data.lengths, self.train_data.supervised_counts)


def never_trained(out_dir: Path) -> bool:
    """Whether the run in `out_dir` stopped before its first optimizer step (building the trainer, the
    evaluation at start or the first step failed): it left nothing worth keeping, so a new run may start there.
    Only a run's own files qualify: a metrics.jsonl or params.json another tool wrote is never replaced."""
    if (out_dir / "record.json").exists() or (out_dir / "COMPLETE").exists():
        return False
    checkpoints = out_dir / "checkpoints"
    if checkpoints.exists() and not (checkpoints.is_dir() and not any(checkpoints.iterdir())):
        return False
    metrics, params = out_dir / "metrics.jsonl", out_dir / "params.json"
    if not params.exists():  # a run writes its parameters before its metrics and loss weights
        return not metrics.exists() and not (out_dir / "loss_weighting.json").exists()
    try:
        written = read_json(params, ParamError, "run parameters")
        rows = read_metrics(metrics) if metrics.exists() else []
    except (ParamError, ValueError):  # unreadable: maybe not a run's, maybe steps: left alone
        return False
    if not isinstance(written, dict) or "out_dir" not in written or not set(written) <= set(TrainParams.names()):
        return False  # not a run's parameters
    return all(isinstance(row.get("event"), str) for row in rows) and not any(row["event"] == "train" for row in rows)


def manifests(train: Partition, eval_: Partition) -> dict:
    """What identifies the data beyond its folder, which may be converted again in place: each partition's file
    hashes and the conversion that wrote it (tokenizer, template, supervision, its sources by name and kind,
    their rejections), as its sft.idx.json records them. None for a mixture, whose sources its plan names."""
    indexes = {name: getattr(part, "index", None) for name, part in (("train", train), ("eval", eval_))}
    if any(index is None for index in indexes.values()):
        return {}
    conversion = indexes["train"].get("conversion")
    if isinstance(conversion, dict) and isinstance(conversion.get("stats"), dict):
        stats = conversion["stats"]
        sources = [{key: value for key, value in source.items() if key != "files"}
                   | ({"files": len(source["files"])} if isinstance(source.get("files"), list) else {})
                   for source in stats.get("sources", []) if isinstance(source, dict)]
        conversion = {**conversion, "stats": {**stats, "sources": sources}}
    return {"sha256": {name: index.get("sha256") for name, index in indexes.items()}, "conversion": conversion}


def refuse_foreign_resume(checkpoint_dir: Path, out_dir: Path) -> None:
    """ParamError when `resume` names a checkpoint outside out_dir/checkpoints while out_dir holds a run that
    trained: continued there, the two runs' metrics, checkpoints and record would interleave."""
    if checkpoint_dir.resolve().parent == (out_dir / "checkpoints").resolve() or never_trained(out_dir):
        return
    raise ParamError(f"resume {checkpoint_dir} is a checkpoint of another folder, but out_dir {out_dir} holds a run "
                     "that trained: continuing there would interleave the two runs' metrics and checkpoints; resume "
                     "into a new out_dir, or continue this folder's own run with resume: latest")


def _out_dir(params: TrainParams, model_name: str) -> Path:
    # Never mix or overwrite: another run's artifacts are continued (resume) or left alone; one that never
    # trained left none.
    reusable = params.resume is not None or (params.out_dir is not None
                                             and never_trained(resolve_path(params.out_dir)))
    holds = () if reusable else RUN_FILES
    out_dir = job_out_dir(params.out_dir, "runs", holds, "a run", name=model_name,
                          hint="choose another out_dir, or continue that run with resume: latest (a run killed "
                               "before its first resumable checkpoint starts over, its files set aside)")
    if params.out_dir is not None:
        check_writable_folder(out_dir, "out_dir")
        check_entries_inside(out_dir)
        refuse_mixing(out_dir, "single run")
    return out_dir


def continues(params: TrainParams) -> bool:
    """Whether the run continues a checkpoint: `resume` names one, or `latest` finds one (a run killed before its
    first resumable checkpoint starts over instead: cflib.train.run_folder)."""
    return params.resume is not None and not (params.resume == "latest" and starts_over(resolve_path(params.out_dir)))


def recheck_out_dir(run: "Run") -> None:
    """prepare's out_dir verdict again, once the lock is held: another run may have written it in between."""
    if run.params.out_dir is None:
        return
    if run.resume_state is not None and (run.out_dir / "COMPLETE").is_file():
        raise ParamError(f"out_dir {run.out_dir} holds a completed run: another run finished it meanwhile")
    if run.params.resume == "latest" and run.resume_state is None and starts_over(run.out_dir):
        # fit() sets such a run's files aside first; a trainer started without it (a torchrun worker run by hand)
        # would write over them
        raise ParamError(f"out_dir {run.out_dir} holds a run killed before its first resumable checkpoint: "
                         "resume: latest starts it over through cflib.train.train or train_sft.ipynb, which keep "
                         "its files in out_dir/set-aside-N/ first")
    if run.resume_state is None:
        _out_dir(run.params, "")


def prepare(params: TrainParams, dist: DistContext | None = None) -> Run:
    """Resolve and check everything a run needs without writing to out_dir.

    `dist` is given inside torchrun workers; without it a multi-process
    parameter set is checked here for the launcher, and the model stays on the CPU.
    """
    if params.curriculum is not None or params.dry_run:
        raise ParamError("curriculum and dry_run are prepared by cflib.train.prepare_job, stage by stage")
    params = with_adapter_settings(params)
    dist = dist or DistContext()
    launches = params.world_size > 1 and not dist.active  # this process starts torchrun's workers, which train
    # First: a registered loss or metric the workers could not import refuses the run before anything is opened.
    worker_imports = for_workers(params) if launches else None
    device = resolve_device(params.device, dist.local_rank)
    check_processes_and_device(params, dist, device)
    if params.out_dir is not None and dist.is_main:  # first: a live run's checkpoints are still changing
        check_run_folder(resolve_path(params.out_dir))
    if params.resume is not None and (resolve_path(params.out_dir or "") / "COMPLETE").is_file():
        raise ParamError(f"out_dir {resolve_path(params.out_dir)} holds a completed run: nothing to resume")
    # The architecture alone first (a Hub start pinned to its commit, its config.json read): the data, the schedule
    # and the batch are checked against it before any weights are downloaded or loaded.
    params, hub = (params, None) if continues(params) else pinned_hub_start(params)
    config, _ = model_config(params)  # seq_len checked against its positions
    # A torchrun worker counts labels only: its launcher ran the preflight, token checks and hashes included.
    data = open_data(params, config.vocab_size, check="counts" if dist.active else "preflight")
    train_data, mixture = data.train, data.mixture
    packed, units = plan_units(params, train_data, mixture)
    # No example exceeds seq_len (checked above), so every supervised label is visible in its window.
    loss_weights = (derive_loss_weights(params.loss_groups, train_data.rows, visible_supervised(train_data, mixture),
                                        params.max_task_loss_weight, kept_data(params, data.filter_counts))
                    if params.loss_groups is not None else None)
    steps_per_epoch, schedule = schedule_steps(units, params)
    # A preset's weights and fresh adapters are drawn from it, alike on every rank; the trainer then seeds each rank's
    # generators apart (cflib.train.trainer.seed_rank_generators), so that dropout draws other masks on each.
    torch.manual_seed(params.seed)
    start = starting_model(params, hub)
    params, model, lora, resume_state = start.params, start.model, start.lora, start.resume_state
    config = model.config
    params, teacher = start_teacher(params, resume_state, config, weights=not launches)
    estimate = memory_figures(config, params, device, model, None if teacher is None else teacher.config)
    strategy = choose_strategy(params.strategy, estimate) if params.world_size > 1 else "single"
    plan = plan_execution(params, model, strategy, device, None if teacher is None else teacher.describe())
    apply_to_model(model, plan, None if teacher is None else teacher.model)
    # Only global rank 0 (node 0) judges out_dir; the others may find it already being written.
    judges = dist.is_main and params.node_rank == 0
    out_dir = _out_dir(params, start.name) if judges else resolve_path(params.out_dir or "")
    run = Run(params, device, model, start.source, data.root, train_data, data.eval, out_dir,
              steps_per_epoch, schedule, dist, strategy, estimate, plan, resume_state,
              packed, loss_weights, data.preflight, lora, data.filter_counts, mixture, start_adapters(params),
              worker_imports, start.hub, data.overlong, teacher)
    if resume_state is not None:
        check_resumable(resume_state, run, start.resumed)
        if run.init_adapters is None:  # the base named at its new place, or nothing: the start stays the recorded one
            run.init_adapters = resume_state.get("init_adapters")
    if not run.launches_workers:
        model.to(device)
        if teacher is not None:
            teacher.model.to(device)
    return run


def check_processes_and_device(params: TrainParams, dist: DistContext, device: torch.device) -> None:
    """The processes torchrun started and the device against what the run names."""
    if dist.active and dist.world_size != params.world_size:
        raise ParamError(f"torchrun started {dist.world_size} processes but nproc_per_node x nnodes = "
                         f"{params.world_size}")
    if device.type == "cuda" and params.nproc_per_node > torch.cuda.device_count():
        raise ParamError(f"nproc_per_node {params.nproc_per_node} exceeds the {torch.cuda.device_count()} "
                         "visible CUDA devices")
    if params.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ParamError(f"bf16: true but {torch.cuda.get_device_name(device)} does not support bfloat16")


MAX_STEPS_EPOCHS_CHECKED = 16  # a packed mixture under max_steps: the epochs counted before step 1, at most


def plan_units(params: TrainParams, train_data: Partition, mixture: MixturePlan | None
               ) -> tuple[PackedWindows | EpochWindows | None, list[int]]:
    """The packed windows, if any, and the units (what an epoch shuffles and a global batch counts) of every epoch
    the schedule must know before step 1: the epochs' (their draws pack into their own numbers of windows), or
    under max_steps, which fixes the steps itself, the first's and then those of the later epochs its steps reach
    (up to MAX_STEPS_EPOCHS_CHECKED in all), counted so that global_batch is checked against each; those are
    planned in `windows` as they start, as before, so the record's epochs are the epochs trained."""
    if not params.pack_sequences:
        return None, [len(train_data) if mixture is None else mixture.examples_per_epoch]
    if mixture is None:
        packed = pack_examples(train_data.lengths, params.seq_len)
        return packed, [len(packed)]
    windows = EpochWindows(mixture.epoch, train_data.lengths, params.seq_len)
    if params.max_steps is None:
        return windows, [len(windows.of_epoch(epoch)) for epoch in range(1, params.epochs + 1)]
    counts = [len(windows.of_epoch(1))]
    reached = math.ceil(counts[0] / params.global_batch)
    while reached < params.max_steps and len(counts) < MAX_STEPS_EPOCHS_CHECKED:
        counts.append(len(pack_examples(train_data.lengths[mixture.epoch(len(counts) + 1)], params.seq_len)))
        reached += math.ceil(counts[-1] / params.global_batch)
    return windows, counts


@dataclass
class Start:
    """Where a run's model comes from: the checkpoint a resume continues, an init_checkpoint (a folder, or a Hub
    bundle at its commit), or a preset."""

    params: TrainParams  # with the LoRA settings of the adapters it continues, and a Hub start pinned to its commit
    model: TRMoEModel
    lora: LoraRun | None
    source: str  # the record's model_source
    name: str  # a new out_dir's, after the model
    resume_state: dict | None = None
    resumed: Path | None = None  # the checkpoint a resume continues
    hub: HubStart | None = None


def starting_model(params: TrainParams, hub: HubStart | None = None) -> Start:
    """The model a run trains, loaded and checked, with the run's positions (cflib.train.positions), and where it
    comes from. hub: the commit a Hub init_checkpoint was already pinned to (`params` name it; pinned_hub_start),
    else it is pinned here."""
    start = loaded_start(params, hub)
    config = run_config(start.model.config, start.params)
    if config != start.model.config:  # the checkpoint's stored frequencies were checked against its own config
        start.model.set_positions(config)
    return start


def loaded_start(params: TrainParams, hub: HubStart | None = None) -> Start:
    """The model a run starts from, as its checkpoint (or preset) gives it, and where it comes from."""
    if continues(params):
        checkpoint_dir = resume_dir(params)
        if params.out_dir is not None:
            refuse_foreign_resume(checkpoint_dir, resolve_path(params.out_dir))
        params = with_adapter_settings(params, checkpoint_dir)  # its own, whatever init_checkpoint names
        state = load_trainer_state(checkpoint_dir, required=TRAINER_STATE_KEYS)
        # The commit its run started from, also where the resume names the run's branch or tag (no Hub request).
        params, hub = pinned_hub_start(params, state.get("model"), state.get("hub_start"))
        model, lora = resumed_model(checkpoint_dir, params.lora_settings(), params.init_checkpoint)
        return Start(params, model, lora, f"resumed from {checkpoint_dir} at step {state['step']}", "resumed",
                     state, checkpoint_dir, hub)
    if params.init_checkpoint is not None:
        if hub is None:
            params, hub = pinned_hub_start(params)
        checkpoint_dir = checkpoint_folder(params.init_checkpoint)
        model, lora = initial_model(checkpoint_dir, params.lora_settings(), None if hub is None else hub.record())
        if hub is None:
            return Start(params, model, lora, f"checkpoint {checkpoint_dir}", checkpoint_dir.name)
        return Start(params, model, lora, f"checkpoint {hub.spec} ({checkpoint_dir})", hub.repo_id.split("/")[1],
                     hub=hub)
    return Start(params, TRMoEModel(_preset(params.model)), None, f"preset {params.model}", params.model)


def pinned_hub_start(params: TrainParams, recorded: str | None = None, recorded_start: object = None
                     ) -> tuple[TrainParams, HubStart | None]:
    """`params` with an init_checkpoint hub:ORG/NAME[@REVISION] pinned to the commit it resolves to (a resume's:
    the one its checkpoint records, `recorded`, with the revision the run named, `recorded_start`), so the record,
    the resume identity and torchrun's workers all name that commit, and the revision is resolved once; other
    parameters as they are."""
    if not is_hub(params.init_checkpoint):
        return params, None
    hub = resolve_start(params.init_checkpoint, recorded, recorded_start)
    return replace(params, init_checkpoint=hub.spec), hub


def visible_supervised(train_data: Partition, mixture: MixturePlan | None) -> np.ndarray:
    """Each example's supervised tokens as the loss weighting counts them: under a mixture, times the draws an epoch
    makes of it on average, so that the raw shares are those the run trains on."""
    if mixture is None:
        return train_data.supervised_counts
    return train_data.supervised_counts * mixture.multiplicity()


def schedule_steps(units: int | list[int], params: TrainParams, unit: str | None = None) -> tuple[int, LrSchedule]:
    """Optimizer steps of the first epoch, and the schedule over the run's steps. `units` are what an epoch shuffles
    and a global batch counts, named `unit` in an error (by default as `params` decide: packed windows, a mixture's
    draw, examples): one count for every epoch, or each epoch's (plan_units), whose steps the run's total sums."""
    counts = [units] if isinstance(units, int) else units
    check_global_batch(min(counts), params, unit or unit_name(params))
    # Fill-ins pad the last global batch of an epoch, so it is always whole.
    steps = [math.ceil(count / params.global_batch) for count in counts]
    steps_per_epoch = steps[0]
    if params.max_steps is not None:
        total_steps = params.max_steps
    else:  # the same count each epoch, or one per epoch
        total_steps = params.epochs * steps_per_epoch if len(steps) == 1 else sum(steps)
    return steps_per_epoch, resolve_schedule(params, total_steps)


def resolve_schedule(params: TrainParams, total_steps: int) -> LrSchedule:
    """The learning-rate schedule over `total_steps`: warm-up steps from warmup_steps where it is set (warmup_ratio
    then unused), else from warmup_ratio; wsd's decay steps from lr_decay_ratio; ParamError where they do not fit
    the run."""
    by_ratio = params.warmup_steps is None
    warmup_steps = math.ceil(params.warmup_ratio * total_steps) if by_ratio else params.warmup_steps
    warmup = f"warmup_ratio {params.warmup_ratio:g}" if by_ratio else f"warmup_steps {warmup_steps}"
    ratio_used = params.warmup_ratio if by_ratio else None
    # The learning rate would rise to its peak at the last step (or never reach it), never decay; a one-step run
    # may take its one step at the peak.
    if warmup_steps >= total_steps > 1 or warmup_steps > total_steps > 0:
        if by_ratio:
            raise ParamError(f"{warmup} gives {warmup_steps} warm-up steps of the run's {total_steps}: the whole run "
                             f"would warm up; with {total_steps} steps it must be at most "
                             f"{math.floor((total_steps - 1) / total_steps * 1e4) / 1e4:g}")
        steps = f"{total_steps} step{'s' if total_steps > 1 else ''}"
        raise ParamError(f"{warmup} would warm up through the whole run of {steps}: with {steps} it must be at most "
                         f"{max(total_steps - 1, 1)}")
    if params.lr_schedule != "wsd":
        decay_steps = 0 if params.lr_schedule == "constant" else total_steps - warmup_steps
        return LrSchedule(params.lr_schedule, total_steps, warmup_steps, decay_steps, params.min_lr_ratio,
                          warmup_ratio=ratio_used)
    ratio = params.lr_decay_ratio if params.lr_decay_ratio is not None else WSD_DECAY_RATIO
    if total_steps <= 1:  # one step, taken at the peak as every schedule takes it: nothing to decay
        return LrSchedule("wsd", total_steps, warmup_steps, total_steps - warmup_steps, params.min_lr_ratio, ratio,
                          ratio_used)
    decay_steps = math.ceil(ratio * total_steps)
    # The first decay step runs at the peak: with one, the run never decays.
    if decay_steps < 2:
        raise ParamError(f"lr_schedule wsd: lr_decay_ratio {ratio:g} gives {decay_steps} decay step of the run's "
                         f"{total_steps}, taken at the peak: the rate would never fall; with {total_steps} steps "
                         f"lr_decay_ratio must be at least {smallest_decay_ratio(total_steps):g} (2 decay steps)")
    if warmup_steps + decay_steps > total_steps:  # the decay would start before the warm-up ends
        raise ParamError(f"lr_schedule wsd: {warmup_steps} warm-up steps ({warmup}) and {decay_steps} decay steps "
                         f"(lr_decay_ratio {ratio:g}) are more than the run's {total_steps}; lower one of them")
    return LrSchedule("wsd", total_steps, warmup_steps, decay_steps, params.min_lr_ratio, ratio, ratio_used)


def smallest_decay_ratio(total_steps: int) -> float:
    """The smallest lr_decay_ratio, to 4 decimals (more for a run of more than 1,000 steps), that gives wsd 2 decay
    steps of `total_steps` (at least 2)."""
    digits = max(4, len(str(total_steps)) + 1)
    ratio = math.floor(10**digits / total_steps) / 10**digits
    while math.ceil(ratio * total_steps) < 2:
        ratio = round(ratio + 10**-digits, digits)
    return ratio


def check_global_batch(units: int, params: TrainParams, unit: str) -> None:
    """One global batch takes at most an epoch's units: past them, its fill-ins would repeat the epoch within a
    single step (and a batch of 2**40 would be built in memory before the first step)."""
    if params.global_batch > units:
        raise ParamError(f"global_batch {params.global_batch:,} is more than the {units:,} {unit}: one optimizer "
                         f"step would take each of them more than once; set global_batch to at most {units:,} "
                         "(a multiple of micro_batch_per_rank x world_size), or train on more data")


def unit_name(params: TrainParams) -> str:
    """What a global batch counts, as an error names it."""
    if params.pack_sequences:
        return ("seq_len windows the train examples pack into" if as_mixture(params.data, params.examples_per_epoch)
                is None else "seq_len windows an epoch's draw packs into (the fewest of the epochs planned)")
    if params.examples_per_epoch is not None:
        return "examples an epoch draws (examples_per_epoch)"
    return "train examples"


def resume_dir(params: TrainParams) -> Path:
    """The checkpoint `resume` names: `latest` is out_dir's newest resumable one; a named one whose replacement
    a kill cut between its renames is its retired copy (cflib.atomic.live_path), as loaders take it."""
    if params.resume == "latest":
        return latest_resumable(resolve_path(params.out_dir) / "checkpoints")
    return live_path(resolve_path(params.resume))


def model_config(params: TrainParams) -> tuple[ModelConfig, str]:
    """The architecture a run would train (the start's, with the run's positions: cflib.train.positions), and where
    it comes from, read without building the model; seq_len is checked against its positions."""
    config, source = start_config(params)
    return run_config(config, params), source


def start_config(params: TrainParams) -> tuple[ModelConfig, str]:
    """The architecture a run starts from, and where it comes from, read without building the model."""
    if continues(params):
        checkpoint_dir = resume_dir(params)
        return checkpoint_config(checkpoint_dir), f"resumed from {checkpoint_dir}"
    if is_hub(params.init_checkpoint):  # its config.json alone: the weights wait for the run
        return checkpoint_config(fetch_bundle(params.init_checkpoint, weights=False)), \
            f"checkpoint {params.init_checkpoint}"
    if params.init_checkpoint is not None:
        return checkpoint_config(resolve_path(params.init_checkpoint)), f"checkpoint {params.init_checkpoint}"
    return _preset(params.model), f"preset {params.model}"


def batch_arithmetic(params: TrainParams) -> dict:
    """A run's batch, schedule and memory figures from its parameters, the model's config and the data's
    index alone: nothing is built or loaded (prepare() then checks everything for real)."""
    config, source = model_config(params)
    train_examples = count_train_examples(params)
    # Packed, the windows are fewer than the examples: prepare() checks the batch against them.
    steps_per_epoch, schedule = schedule_steps(train_examples, params, "train examples")
    device = resolve_device(params.device)
    estimate = memory_figures(config, params, device, teacher=teacher_config(params, config))
    return {"model": source, "params_total": config.num_parameters(), "world_size": params.world_size,
            "grad_accum": params.grad_accum,
            "tokens_per_step": params.global_batch * params.seq_len, "train_examples": train_examples,
            "steps_per_epoch": steps_per_epoch, "total_steps": schedule.total_steps,
            "warmup_steps": schedule.warmup_steps, "warmup_from": schedule.warmup_from,
            "lr_schedule": schedule.describe(), "device": str(device),
            "memory_estimate": estimate,
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
        + f", {figures['warmup_steps']:,} of warm-up"
        + (" (warmup_steps; warmup_ratio unused)" if figures.get("warmup_from") == "warmup_steps" else "")
        + f", then {figures['lr_schedule']}",
        f"memory estimate  {_size(memory['total_bytes'])} per rank of {_size(memory['device_bytes'])} on "
        f"{figures['device']} (model + {memory.get('optimizer', {}).get('name', 'AdamW')} "
        f"{_size(memory['model_and_optimizer_bytes'])}, activations {_size(memory['activation_bytes'])}"
        + (f", teacher {_size(memory['teacher_bytes'])}" if "teacher_bytes" in memory else "") + "); "
        + ("fits one device" if memory["fits_one_device"] else "does not fit one device")
        + (f", strategy {figures['strategy']}" if figures["world_size"] > 1 else ""),
        *([_strategy_line(memory["per_strategy"])] if "per_strategy" in memory else []),
    ])


def _strategy_line(costs: dict) -> str:
    return "per rank         " + "; ".join(
        f"{name} holds {_size(costs[name]['state_bytes'])} of weights and optimizer state, sends "
        f"{_size(costs[name]['sent_bytes_per_step'])} a step" for name in ("ddp", "fsdp"))


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def schedule_signature(run: Run) -> dict:
    """What a resumed run must share with the one it continues (cflib.train.resume_identity)."""
    return run_identity(run)


def memory_figures(config: ModelConfig, params: TrainParams, device: torch.device,
                   model: TRMoEModel | None = None, teacher: ModelConfig | None = None) -> dict:
    """The memory estimate: a LoRA run's adapters and frozen_modules' trainable weights take the 16 B/param of
    training, the frozen weights their storage alone (counted on `model` where built: cflib.train.freezing); with a
    `teacher` (its config, read and checked by cflib.train.teacher.teacher_config), its weights too."""
    settings = params.lora_settings()
    weights = (frozen_weights(params.frozen_modules, params.frozen_layers, config, model) if settings is None else
               {"trainable_params": adapter_parameter_count(config, settings),
                "frozen_params": config.num_parameters(), "frozen_dtype": settings.base_dtype, "frozen_by": "lora"})
    optimizer = optimizer_memory(params, config, model)  # None: AdamW's 16 B/param
    estimate = memory_estimate(config, params.micro_batch_per_rank, params.seq_len, params.bf16, params.grad_ckpt,
                               device_memory_bytes(device), weights=weights, optimizer=optimizer)
    if params.world_size > 1:
        estimate["per_strategy"] = strategy_costs(config, params.world_size, params.grad_accum, weights, optimizer)
    return estimate if teacher is None else with_teacher(estimate, teacher_bytes(teacher, params.bf16))


def _preset(name: str) -> ModelConfig:
    try:
        return preset(name)
    except ValueError as err:
        raise ParamError(f"model: {err}") from None
