"""The largest per-rank microbatch that fits a memory budget, in a few measured probes.

A probe is real training: the model, optimizer and step that `cflib.train`
builds (`prepare`, `Trainer.train_step`: forward, backward, optimizer step)
on full-length rows whose every position is supervised, the worst case a
microbatch of real data can reach. One warm-up step (optimizer state,
allocator growth, kernel selection), then the peak of `probe_steps` measured
steps (`cflib.bench.memory`), all under the budget enforced as a hard cap.
The search itself is cflib.bench.search.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
import weakref
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import matplotlib.pyplot as plt
import numpy as np
import torch
import yaml

from cflib.atomic import scratch_folder
from cflib.bench.memory import PeakMemory, free_device_memory, measure_name
from cflib.bench.plots import plot_microbatch_memory
from cflib.bench.search import GIB, Probe, Search, search, sweep
from cflib.data.shards import Example, write_partition
from cflib.export.pull import checkpoint_folder, is_hub, resolve_start
from cflib.jobs import ANYTHING, job_out_dir, record_header, refuse_existing
from cflib.locks import exclusive_output
from cflib.model.config import ConfigError, ModelConfig, preset
from cflib.progress import tqdm
from cflib.schema import composed, parsed_by
from cflib.train.distributed import DDP_BUCKET_BYTES_PER_PARAM, TRAINING_BYTES_PER_PARAM
from cflib.train.params import DEVICES, Model, ParamError, TrainParams, gradient_accumulation, kernel_choice
from cflib.train.positions import run_config
from cflib.train.run import prepare, resolve_device
from cflib.train.trainer import Trainer

# A probe trains every weight (no frozen_modules, no LoRA), so the numbers are the run's memory estimate's
# (cflib.train.distributed) for such a run. At every optimizer step fp32 weights, gradients and both AdamW moments
# coexist: a floor under any peak.
FIXED_BYTES_PER_PARAM = TRAINING_BYTES_PER_PARAM
# Weights and moments outlive every step; gradients come and go. The floor under the fixed part of the fit.
PERSISTENT_BYTES_PER_PARAM = 12
# DDP keeps a flat copy of the fp32 gradients in its all-reduce buckets on every rank
# (distributed.DDP_BUCKET_BYTES_PER_PARAM, imported above).
# Above any one device's memory: a larger budget (a typo such as 1e30) would let every microbatch "fit".
MAX_BUDGET_GIB = 4096
# Far beyond what a real model's microbatch reaches on one device; the probe shard holds this many rows.
MAX_MICRO_BATCH = 65_536
# The probe shard (max_micro_batch rows of seq_len tokens, uint32 ids + int32 labels) is written to the
# temporary folder before the first probe: bound it so a large setting cannot fill the disk.
PROBE_SHARD_BYTES_PER_TOKEN = 8
PROBE_SHARD_MAX_BYTES = 4 * GIB


@dataclass(frozen=True)
class Tuning:
    """What a probe trains and how the search goes. (The model section's init_checkpoint gives the architecture
    only: weights do not change memory.)"""

    out_dir: str | None = None  # None: a new outputs/tune/<time>-<model> folder
    seed: int = 0
    seq_len: int = 64
    budget_gib: float | None = None  # None: the CUDA device's memory; required on CPU
    headroom: float = 0.05  # fraction of budget_gib kept free of the measured peak
    global_batch: int = 32
    world_size: int = 1  # data-parallel ranks, each with this microbatch
    bf16: bool = False
    fp32_loss: bool = True
    loss_chunk_tokens: int = 1024
    grad_ckpt: bool = False
    use_custom_kernels: str = parsed_by(kernel_choice, "auto")
    require_liger: bool = False
    device: str = "auto"
    max_probes: int = 4  # probes the search may use (the exhaustive sweep is extra)
    max_micro_batch: int = 256  # the search never probes beyond this
    probe_steps: int = 2  # measured steps per probe, after one warm-up step
    exhaustive_sweep: bool = False  # also probe 1, 2, 3, ... up to the first that does not fit


@dataclass(frozen=True)
class TuneParams(composed(Model, Tuning)):
    """The controls of one tuning run; the notebook's parameters cell."""

    def validate(self) -> None:
        if not 0.0 <= self.headroom < 1.0:  # written so that NaN fails too
            raise ParamError(f"headroom must be in [0, 1): the fraction of budget_gib kept free, got {self.headroom}")
        if self.budget_gib is not None and not 0.0 < self.budget_gib <= MAX_BUDGET_GIB:
            raise ParamError(f"budget_gib must be a positive number of GiB up to {MAX_BUDGET_GIB} (or None: the "
                             f"device's memory), got {self.budget_gib}")
        for name in ("world_size", "global_batch", "max_micro_batch", "probe_steps"):
            if getattr(self, name) < 1:
                raise ParamError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_micro_batch > MAX_MICRO_BATCH:
            raise ParamError(f"max_micro_batch must be at most {MAX_MICRO_BATCH:,}, got {self.max_micro_batch:,}")
        shard_bytes = self.max_micro_batch * self.seq_len * PROBE_SHARD_BYTES_PER_TOKEN
        if shard_bytes > PROBE_SHARD_MAX_BYTES:
            raise ParamError(f"max_micro_batch {self.max_micro_batch:,} x seq_len {self.seq_len:,} needs a probe "
                             f"shard of {shard_bytes / GIB:.1f} GiB (limit {PROBE_SHARD_MAX_BYTES / GIB:.0f} "
                             "GiB): lower max_micro_batch")
        if self.max_probes < 2:
            raise ParamError(f"max_probes must be at least 2 (microbatch 1, then a prediction), got {self.max_probes}")
        if self.global_batch % self.world_size:
            raise ParamError(f"global_batch {self.global_batch} is not a multiple of world_size {self.world_size}: "
                             "no microbatch can make global_batch = micro_batch_per_rank x world_size x grad_accum")
        if self.device not in DEVICES:
            raise ParamError(f"device must be one of {DEVICES}, got {self.device!r}")
        self.train_params(micro=1, data="embedded")  # the settings shared with a run: checked as a run checks them

    def train_params(self, micro: int, data: str) -> TrainParams:
        """The run of one probe: `micro` examples per step, no evaluation, nothing saved."""
        return TrainParams.from_dict({
            **{field.name: getattr(self, field.name) for field in fields(Model)}, "data": data, "seed": self.seed,
            "seq_len": self.seq_len, "micro_batch_per_rank": micro, "global_batch": micro,
            "max_steps": 1 + self.probe_steps, "bf16": self.bf16, "fp32_loss": self.fp32_loss,
            "loss_chunk_tokens": self.loss_chunk_tokens, "grad_ckpt": self.grad_ckpt,
            "use_custom_kernels": self.use_custom_kernels, "require_liger": self.require_liger,
            "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False, "device": self.device,
        }, source="tuning parameters")


def batch_plan(global_batch: int, micro: int, world_size: int) -> dict:
    """global_batch = micro_batch_per_rank x world_size x grad_accum, with the largest fitting micro that divides."""
    try:
        return {"micro_batch_per_rank": micro, "grad_accum": gradient_accumulation(global_batch, micro, world_size),
                "global_batch": global_batch, "world_size": world_size, "note": None}
    except ParamError as err:
        # validate() made global_batch a multiple of world_size, so micro 1 always divides.
        chosen = max(m for m in range(1, micro + 1) if global_batch % (m * world_size) == 0)
        accum = gradient_accumulation(global_batch, chosen, world_size)
        note = (f"{err}. Written: micro_batch_per_rank {chosen}, the largest that fits and divides, with "
                f"grad_accum {accum}; to use all {micro} per rank, choose one of the global batches above")
        return {"micro_batch_per_rank": chosen, "grad_accum": accum, "global_batch": global_batch,
                "world_size": world_size, "note": note}


def loss_chunk_saturation(loss_chunk_tokens: int, seq_len: int) -> int:
    """The microbatch from which one loss chunk is full (every probe row is supervised throughout)."""
    return math.ceil(loss_chunk_tokens / seq_len)


@dataclass
class Tuning:
    """A checked tuning run: nothing measured or written yet."""

    params: TuneParams
    device: torch.device
    config: ModelConfig
    model_source: str
    budget_bytes: int
    usable_bytes: int
    ddp_bucket_bytes: int
    out_dir: Path

    @property
    def trainable_parameters(self) -> int:
        return self.config.num_parameters()

    def describe(self) -> str:
        p = self.params
        lines = [
            f"model     {self.model_source}: {self.trainable_parameters:,} trainable parameters",
            f"step      seq_len {p.seq_len}, {'bf16 autocast' if p.bf16 else 'fp32'}, loss chunks of "
            f"{p.loss_chunk_tokens} tokens (fp32_loss {p.fp32_loss}), grad_ckpt {p.grad_ckpt}, "
            f"use_custom_kernels {p.use_custom_kernels}, require_liger {p.require_liger}",
            f"device    {self.device}; memory measured as {measure_name(self.device)}",
            f"budget    {self.budget_bytes / GIB:.4g} GiB, headroom {p.headroom:.0%}: the peak must stay under "
            f"{self.usable_bytes / GIB:.4g} GiB",
            f"search    at most {p.max_probes} probes of 1 warm-up + {p.probe_steps} measured steps, microbatch "
            f"1..{p.max_micro_batch}{'; then the exhaustive sweep' if p.exhaustive_sweep else ''}",
            f"batch     global {p.global_batch} over world_size {p.world_size}",
            f"out_dir   {self.out_dir}",
        ]
        if self.ddp_bucket_bytes:
            lines.insert(4, f"ddp       {self.ddp_bucket_bytes / GIB:.4g} GiB per rank set aside for DDP's "
                            "gradient buckets (probes run one process)")
        return "\n".join(lines)


def prepare_tuning(params: TuneParams) -> Tuning:
    """Every check that needs no training step: device, model, budget against the fixed memory, out_dir."""
    device = resolve_device(params.device)
    params, config, source = _model_to_tune(params)
    # The positions the probes train (a longer context through rope_scaling), seq_len checked against them
    config = run_config(config, params.train_params(micro=1, data="embedded"))
    if params.budget_gib is None:
        if device.type != "cuda":
            raise ParamError("budget_gib is required on a CPU (None means the CUDA device's memory); "
                             "params/tune_smoke.yaml sets one for the smoke model")
        budget = torch.cuda.get_device_properties(device).total_memory
    else:
        budget = int(params.budget_gib * GIB)
    trainable = config.num_parameters()
    ddp_bytes = DDP_BUCKET_BYTES_PER_PARAM * trainable if params.world_size > 1 else 0
    usable = int(budget * (1.0 - params.headroom)) - ddp_bytes
    fixed = FIXED_BYTES_PER_PARAM * trainable
    if usable <= fixed:
        raise ParamError(
            f"budget_gib {budget / GIB:.4g} leaves {usable / GIB:.4g} GiB after headroom {params.headroom}"
            f"{' and DDP buckets' if ddp_bytes else ''}, below the fixed memory of training this model: "
            f"{FIXED_BYTES_PER_PARAM} B x {trainable:,} parameters = {fixed / GIB:.4g} GiB (fp32 weights, "
            "gradients and AdamW moments) before any activation")
    out_dir = job_out_dir(params.out_dir, "tune", ANYTHING, "files", name=params.model)
    return Tuning(params, device, config, source, budget, usable, ddp_bytes, out_dir)


def _model_to_tune(params: TuneParams) -> tuple[TuneParams, ModelConfig, str]:
    """The architecture the probes train, and where it comes from. A Hub start is pinned to its commit once, so
    every probe, and the parameters written for train_sft, name that commit."""
    if params.init_checkpoint is None:
        try:
            return params, preset(params.model), f"preset {params.model}"
        except ConfigError as err:
            raise ParamError(f"model: {err}") from None
    if is_hub(params.init_checkpoint):
        params = replace(params, init_checkpoint=resolve_start(params.init_checkpoint).spec)
    checkpoint = checkpoint_folder(params.init_checkpoint)
    try:
        config = ModelConfig.from_json_file(checkpoint / "config.json")
    except ConfigError as err:
        raise ParamError(f"init_checkpoint: {err}") from None
    return params, config, f"checkpoint {params.init_checkpoint if is_hub(params.init_checkpoint) else checkpoint}"


@contextlib.contextmanager
def probe_shard(config: ModelConfig, seq_len: int, rows: int, seed: int, beside: Path) -> Iterator[Path]:
    """A scratch shard of `rows` full-length rows of random tokens ending in EOS, every position supervised but
    the last (whose next token lies past the example), hidden beside `beside` and removed after the block."""
    rng = np.random.default_rng(seed)
    eos = 0
    with scratch_folder(beside) as root:
        def examples(count: int) -> Iterator[Example]:
            for _ in range(count):
                ids = np.append(rng.integers(1, config.vocab_size, size=seq_len - 1), eos)
                yield Example(ids, np.append(ids[1:], -100), {})
        for partition, count in (("train", rows), ("eval", 1)):
            write_partition(Path(root) / partition, examples(count), vocab_size=config.vocab_size,
                            eos_token_id=eos, max_seq_len=seq_len)
        yield Path(root)


def measure_probe(tuning: Tuning, shard_root: Path, micro: int) -> Probe:
    """Build the run as cflib.train does, take real steps of `micro` examples, and free it all again."""
    p = tuning.params
    meter = PeakMemory(tuning.device, tuning.budget_bytes)  # the cap: the budget itself, headroom aside
    run = trainer = None
    model_alive: Callable[[], Any] = lambda: None
    detail: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        run = prepare(p.train_params(micro, str(shard_root)))
        model_alive = weakref.ref(run.model)
        with meter.capped([*run.model.parameters(), *run.model.buffers()]):
            trainer = Trainer(run, progress=False)
            examples = np.arange(micro)
            trainer.train_step(examples, examples)  # warm-up; each step staged during the one before, as in fit()
            meter.reset()
            rows = [trainer.train_step(examples, examples) for _ in range(p.probe_steps)]
            peak = meter.peak()
        detail = {**peak, "step_seconds": [round(r["seconds"], 4) for r in rows],
                  "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
                  "kernel_path": run.model.kernel_path()}
        outcome = "fits" if peak["decides"] <= tuning.usable_bytes else "over_budget"
        peak_bytes = peak["decides"]
    except torch.OutOfMemoryError as err:
        # The traceback holds the failed step's frames and tensors; it goes with `err` at the end of this block.
        outcome, peak_bytes = "out_of_memory", None
        detail = {"error": str(err).strip().splitlines()[0][:300]}
    run = trainer = None
    free_device_memory(tuning.device)
    # A model that outlives its probe (a cache holding it) would be measured again by every later probe.
    detail["model_freed"] = model_alive() is None
    if not detail["model_freed"]:
        warnings.warn(f"probe at micro {micro}: its model is still referenced after cleanup; later probes "
                      "measure its memory too")
    if tuning.device.type == "cuda":
        detail["allocated_after_cleanup_bytes"] = torch.cuda.memory_allocated(tuning.device)
    detail["probe_seconds"] = round(time.perf_counter() - started, 3)
    return Probe(micro, outcome, peak_bytes, detail)


def tune(tuning: Tuning, progress: Callable[[str], None] = print) -> dict:
    """Search (and optionally sweep), then write record.json, the train_sft params file and the plot: all at once,
    as out_dir's only writer (a second tune into it is refused while this one runs)."""
    with exclusive_output(tuning.out_dir, lambda: refuse_existing(tuning.out_dir, ANYTHING, "files"), ParamError,
                          what="out_dir") as staging:  # the probe shard in it: gone before it is published
        return _tune(tuning, staging, progress)


def _tune(tuning: Tuning, staging: Path, progress: Callable[[str], None]) -> dict:
    p = tuning.params
    persistent = PERSISTENT_BYTES_PER_PARAM * tuning.trainable_parameters
    started = time.perf_counter()
    with probe_shard(tuning.config, p.seq_len, p.max_micro_batch, p.seed, beside=staging / "probe") as shard:
        bar = tqdm(total=p.max_probes, desc="search", unit="probe")  # a widget in JupyterLab

        def measure(micro: int) -> Probe:
            probe = measure_probe(tuning, shard, micro)
            bar.update()
            bar.set_postfix_str(f"micro {micro}: {probe.outcome}")
            return probe

        found = search(measure, tuning.usable_bytes, tuning.budget_bytes, persistent, p.max_micro_batch,
                       p.max_probes, progress)
        bar.close()
        search_s = time.perf_counter() - started
        if p.exhaustive_sweep:
            bar = tqdm(desc="sweep", unit="probe")
            swept = sweep(measure, p.max_micro_batch, tuning.budget_bytes, progress)
            bar.close()
        else:
            swept = None
    batch = batch_plan(p.global_batch, found.micro, p.world_size)
    if batch["note"]:
        progress(batch["note"])
    record = _record(tuning, found, swept, batch, search_s, time.perf_counter() - started)
    _write_outputs(tuning, record, staging)
    return record


def _probe_row(probe: Probe) -> dict:
    return {"micro": probe.micro, "outcome": probe.outcome, "peak_bytes": probe.peak_bytes,
            "peak_gib": probe.peak_bytes / GIB if probe.peak_bytes is not None else None, **probe.detail}


def _record(tuning: Tuning, found: Search, swept: list[Probe] | None, batch: dict, search_s: float,
            wall_s: float) -> dict:
    p, line = tuning.params, found.line
    verified = next(probe for probe in found.probes if probe.micro == found.micro and probe.fits)
    fit = None
    if line is not None:
        measured = [pr for pr in found.probes if pr.peak_bytes is not None]
        fit = {"slope_bytes_per_example": line.slope, "intercept_bytes": line.intercept, "through_micro": line.through,
               "residuals_bytes": {str(pr.micro): pr.peak_bytes - line(pr.micro) for pr in measured}}
    record = {
        **record_header("tune_microbatch", tuning.device, tuning.out_dir, params=p),
        "model_source": tuning.model_source,
        "model_config": tuning.config.to_dict(),
        "params_trainable": tuning.trainable_parameters,
        "memory_measure": measure_name(tuning.device),
        "probe_rows": f"{p.seq_len} random tokens per row, every position supervised (the worst case of real "
                      "data); one warm-up step, then the peak of the measured steps",
        "budget": {"budget_bytes": tuning.budget_bytes, "budget_gib": tuning.budget_bytes / GIB,
                   "headroom": p.headroom, "usable_bytes": tuning.usable_bytes,
                   "usable_gib": tuning.usable_bytes / GIB, "cap_bytes": tuning.budget_bytes,
                   "ddp_bucket_bytes": tuning.ddp_bucket_bytes,
                   "fixed_floor_bytes": FIXED_BYTES_PER_PARAM * tuning.trainable_parameters},
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "loss_chunk_saturation_micro": loss_chunk_saturation(p.loss_chunk_tokens, p.seq_len),
        "kernel_path": verified.detail.get("kernel_path"),
        "search": {"probes": [_probe_row(pr) for pr in found.probes], "probes_used": len(found.probes),
                   "max_probes": p.max_probes, "predictions": found.predictions,
                   "stopped_because": found.stopped_because, "seconds": search_s},
        "fit": fit,
        "prediction": ({"largest_under_usable": line.largest_under(tuning.usable_bytes),
                        "peak_bytes_at_next": line(found.micro + 1)} if line is not None else None),
        "verification": {"micro": found.micro, "peak_bytes": verified.peak_bytes,
                         "peak_gib": verified.peak_bytes / GIB, **verified.detail},
        "tuned_micro_batch_per_rank": found.micro,
        "batch": batch,
        "wall_s": wall_s,
        "outputs": {"params_file": "train_sft_params.yaml", "plot": "memory_vs_microbatch.png"},
    }
    if swept is not None:
        largest = max((pr.micro for pr in swept if pr.fits), default=0)
        under_budget = max((pr.micro for pr in swept if pr.peak_bytes is not None
                            and pr.peak_bytes <= tuning.budget_bytes), default=0)
        record["sweep"] = {"probes": [_probe_row(pr) for pr in swept], "largest_fitting": largest,
                           "largest_under_budget": under_budget, "tuned": found.micro,
                           "tuned_within_one": largest - 1 <= found.micro <= largest,
                           "tuned_within_one_of_budget": under_budget - 1 <= found.micro <= under_budget,
                           "search_vs_sweep_peak": _agreement(found.probes, swept)}
    return record


def _agreement(search_probes: list[Probe], swept: list[Probe]) -> dict:
    """Relative difference of the search's and the sweep's peaks at the same microbatch: reproducibility."""
    by_micro = {pr.micro: pr.peak_bytes for pr in swept if pr.peak_bytes is not None}
    return {str(pr.micro): (pr.peak_bytes - by_micro[pr.micro]) / by_micro[pr.micro]
            for pr in search_probes if pr.peak_bytes is not None and pr.micro in by_micro}


def train_sft_params(tuning: Tuning, batch: dict) -> dict:
    """What notebooks/train_sft.ipynb needs to run as probed, at the tuned batch."""
    p = tuning.params
    source = {"init_checkpoint": p.init_checkpoint} if p.init_checkpoint is not None else {"model": p.model}
    positions = {name: getattr(p, name) for name in ("rope_scaling", "rope_theta", "max_position_embeddings")
                 if getattr(p, name) is not None}  # the positions probed, where the tuning set them
    return {**source, **positions, "seq_len": p.seq_len, "micro_batch_per_rank": batch["micro_batch_per_rank"],
            "global_batch": batch["global_batch"], "nproc_per_node": p.world_size, "bf16": p.bf16,
            "fp32_loss": p.fp32_loss, "loss_chunk_tokens": p.loss_chunk_tokens, "grad_ckpt": p.grad_ckpt,
            "use_custom_kernels": p.use_custom_kernels, "require_liger": p.require_liger,
            "device": tuning.device.type}


def _write_outputs(tuning: Tuning, record: dict, staging: Path) -> None:
    batch = record["batch"]
    header = [
        f"# Tuned by notebooks/tune_microbatch.ipynb on {record['device']['name']} ({record['created_utc']}):",
        f"# micro {record['tuned_micro_batch_per_rank']} is the largest whose peak fits "
        f"{record['budget']['usable_gib']:.4g} GiB ({record['budget']['budget_gib']:.4g} GiB less "
        f"{tuning.params.headroom:.0%} headroom); record.json beside this file.",
        f"# global_batch {batch['global_batch']} = micro {batch['micro_batch_per_rank']} x world "
        f"{batch['world_size']} x accumulation {batch['grad_accum']}; nproc_per_node x nnodes is the world size.",
        "# Layer it over a recipe: papermill notebooks/train_sft.ipynb OUT.ipynb -f RECIPE.yaml -f THIS.yaml",
    ]
    body = yaml.safe_dump(train_sft_params(tuning, batch), sort_keys=False)
    (staging / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (staging / "train_sft_params.yaml").write_text("\n".join(header) + "\n" + body)
    figure = plot_microbatch_memory(record, save_to=staging / "memory_vs_microbatch.png")
    plt.close(figure)
