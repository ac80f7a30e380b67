"""Steady-state training throughput of the project's paths and the peer stack, side by side in one run.

Two kinds of batches, each measured in the same run (`batches`):

- `random_rows`: every path on the same fresh random-token rows of seq_len
  (the first third of each row unsupervised), at every micro-batch;
- `realistic`: examples of realistic SFT lengths (cflib.bench.synthetic, or a
  shard the user names), the project in its release layout (packed windows,
  each example attending only to itself) and the peer fed the ways users feed
  it (cflib.bench.feeding), all on the same examples in the same order, at
  the compared micro-batch.

Every path takes real optimizer steps (forward, backward, clipping, fused
AdamW), one model at a time, each from a clean device. Warm-up steps are
excluded; each timed step is bounded by device synchronisation. The bf16
matmul ceiling is measured in the same run, FLOPs are counted as in docs/measuring.md,
and one full evaluation and one checkpoint save of each project path are timed
on their own, never inside the steady-state figure. A path whose requirements
are not met is recorded as skipped with the reason; an out-of-memory or a
failing step is recorded, and the run goes on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cflib.atomic import write_json_atomic
from cflib.bench.batches import Batches, random_rows, realistic, timing_protocol
from cflib.bench.comparison import RANDOM_ROWS, REALISTIC, _ok, compare
from cflib.bench.feeding import FEEDS, RealisticStream
from cflib.bench.peer import PathUnavailable
from cflib.bench.sessions import Session, compiled, fed_peer_session, peer_session
from cflib.bench.timing import (
    allocated_memory_gib,
    compile_totals,
    flops_per_token,
    matmul_ceiling,
    peak_memory_gib,
    profile_steps,
    release_memory,
    sustained_matmul_ceiling,
    sync,
    time_steps,
)
from cflib.jobs import error_line, guarded, job_out_dir, record_header
from cflib.model.checkpoint import save_checkpoint
from cflib.model.config import PRESETS, ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.paths import resolve_path
from cflib.progress import tqdm
from cflib.schema import Params
from cflib.train.optim import describe_optimizer, optimizer_kernel
from cflib.train.params import DEVICES, ParamError, TrainParams
from cflib.train.records import count_parameters
from cflib.train.run import prepare, resolve_device
from cflib.train.trainer import Trainer

# The project's own paths: the TrainParams that select them. What ran is read back from the model.
PROJECT_PATHS: dict[str, dict[str, Any]] = {
    "reference": {"use_custom_kernels": "false", "require_liger": False},
    "production": {"use_custom_kernels": "true", "require_liger": True},
}
# LoRA on the production kernels (cflib.model.lora), rank 16 on every target, on a frozen base that
# measure_path writes from the preset: fp32, or held in BF16 (which needs bf16: true); DoRA at rank 16 on its
# targets, the seven linear ones. Measured when named.
LORA_PATHS: dict[str, dict[str, Any]] = {
    "production_lora": {**PROJECT_PATHS["production"], "full_parameter": False, "lora_rank": 16, "lora_alpha": 32},
    "production_lora_bf16_base": {**PROJECT_PATHS["production"], "full_parameter": False, "lora_rank": 16,
                                  "lora_alpha": 32, "base_dtype": "bfloat16"},
    "production_dora": {**PROJECT_PATHS["production"], "full_parameter": False, "lora_rank": 16, "lora_alpha": 32,
                        "lora_dora": True},
}
PROJECT_PATHS.update(LORA_PATHS)


def _production_with(**kernel_overrides: Any) -> dict[str, Any]:
    return {**PROJECT_PATHS["production"], "kernel_overrides": kernel_overrides}


# Variants of production measured when named, to take a difference side by side: its last layer computing every
# row, as it does for a loss that reads every position (the SFT loss reads the supervised rows alone, so
# production computes only those after the last attention); the tied-head loss in chunks of 4,096 tokens,
# whatever loss_chunk_tokens the run sets (each chunk's head-gradient GEMM then accumulates 4x the tokens per pass
# over its FP32 sum); every plain GEMM on cuBLAS, where production (quack_gemms: auto) takes quack's kernel at the
# shapes it runs faster; the TR-MoE block's activation recomputed in backward in every layer, where production
# keeps it from forward (less memory, more traffic); the block's SwiGLU in cflib's own kernel, where production
# (epilogue_swiglu: auto) takes quack's GEMM epilogue on Hopper with quack-kernels installed; every kernel launched
# from the host, no CUDA graph replays (cflib.train.graphs); production as it ran before the BF16 weight copies
# and cflib's AdamW kernel (both on by default in one process on a GPU): autocast's casts of the FP32 masters in
# every forward, torch's fused AdamW.
VARIANT_PATHS: dict[str, dict[str, Any]] = {
    "production_every_row": PROJECT_PATHS["production"],
    "production_loss_chunk_4096": {**PROJECT_PATHS["production"], "loss_chunk_tokens": 4096},
    "production_cublas_gemms": _production_with(quack_gemms="false"),
    "production_recomputed_activation": _production_with(kept_swiglu_layers=0),
    "production_cflib_swiglu": _production_with(epilogue_swiglu="false"),
    "production_eager": _production_with(cuda_graphs="false"),
    "production_casts": _production_with(bf16_weight_copies="false", cflib_adamw="false"),
}
EVERY_ROW_PATHS = ("production_every_row",)
PROJECT_PATHS.update(VARIANT_PATHS)
# The peers as their users run them: Liger's kernels, all or its fused linear cross-entropy alone
# (cflib.bench.peer.LIGER); torch.compile of nothing, the whole model (HF Trainer's torch_compile) or the decoder
# body with the loss outside (cflib.bench.peer.COMPILE); transformers' SDPA attention or FlashAttention-4.
PEER_PATHS: dict[str, dict[str, Any]] = {
    "peer_eager": {"liger": "none", "compile": "none"},
    "peer_liger": {"liger": "all", "compile": "none"},
    "peer_liger_fa4": {"liger": "all", "compile": "none", "attention": "flash_attention_4"},
    "peer_compile": {"liger": "none", "compile": "model"},
    "peer_compile_fa4": {"liger": "none", "compile": "model", "attention": "flash_attention_4"},
    "peer_compile_fa4_flce": {"liger": "loss", "compile": "decoder", "attention": "flash_attention_4"},
    "peer_liger_compile": {"liger": "all", "compile": "model"},
}
# The kinds of batches, and the paths each runs: the project's on both, the peer's as each kind feeds it.
BATCHES: dict[str, tuple[str, ...]] = {RANDOM_ROWS: (*PROJECT_PATHS, *PEER_PATHS), REALISTIC: (*PROJECT_PATHS, *FEEDS)}
PATHS = (*PROJECT_PATHS, *PEER_PATHS, *FEEDS)
DEFAULT_PATHS = tuple(name for name in PATHS if name not in LORA_PATHS and name not in VARIANT_PATHS)


@dataclass(frozen=True)
class ThroughputParams(Params):
    """The controls of one measurement. Defaults: a CPU smoke run of a few seconds."""

    model: str = "smoke"  # a preset of cflib.model.config.PRESETS
    seq_len: int = 32
    micro_batches: tuple[int, ...] = (1, 2)  # every path on random rows is measured at each
    compare_micro_batch: int = 2  # where the ratios are taken, and realistic lengths measured; one of micro_batches
    paths: tuple[str, ...] = DEFAULT_PATHS  # of PATHS; the LoRA and variant paths when named
    batches: tuple[str, ...] = tuple(BATCHES)  # random_rows and/or realistic
    shard: str | None = None  # realistic lengths from this shard root (its train partition); None: generated
    realistic_median_length: int = 10  # generated lengths: log-normal median, capped at seq_len (300 on a GPU run)
    fed_peers_liger: bool = True  # peer_padded, peer_packed, peer_padding_free with Liger's kernels (CUDA)
    warmup_steps: int = 1  # taken, not timed
    timed_steps: int = 2
    repetitions: int = 1  # > 1: every path that many times, round robin; each entry is its fastest repetition
    bf16: bool = False
    loss_chunk_tokens: int = 1024
    fp32_loss: bool = True
    grad_ckpt: bool = False
    compile_backend: str = "eager"  # torch.compile backend of the compiled peers; inductor on a GPU
    ceiling_size: int = 128  # the matmul ceiling multiplies two square matrices of this size (bf16 when bf16)
    ceiling_repeats: int = 5
    ceiling_sustained_s: float = 0.0  # > 0: also the ceiling held that long after as long a warm-up (power-limited)
    eval_examples: int = 8  # rows of the held-out partition the timed evaluation reads
    profile_steps: int = 0  # > 0: that many more steps of each path under torch.profiler, after the timed ones
    save_optimizer_state: bool = False  # in the timed checkpoint save
    seed: int = 0
    device: str = "auto"
    out_dir: str | None = None  # None: a new outputs/runs/<time>-throughput folder

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise ParamError(f"model: unknown preset {self.model!r}; presets: {sorted(PRESETS)}")
        for name in ("seq_len", "timed_steps", "repetitions", "loss_chunk_tokens", "ceiling_size", "ceiling_repeats",
                     "eval_examples", "realistic_median_length"):
            if getattr(self, name) <= 0:
                raise ParamError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "profile_steps", "ceiling_sustained_s"):
            if getattr(self, name) < 0:
                raise ParamError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seq_len > PRESETS[self.model].max_position_embeddings:
            raise ParamError(f"seq_len {self.seq_len} exceeds model {self.model}'s max_position_embeddings "
                             f"{PRESETS[self.model].max_position_embeddings}")
        if not self.micro_batches or any(m <= 0 for m in self.micro_batches):
            raise ParamError(f"micro_batches must be one or more positive integers, got {list(self.micro_batches)}")
        if len(set(self.micro_batches)) != len(self.micro_batches):
            raise ParamError(f"micro_batches repeats a size: {list(self.micro_batches)}")
        if self.compare_micro_batch not in self.micro_batches:
            raise ParamError(f"compare_micro_batch {self.compare_micro_batch} is not one of micro_batches "
                             f"{list(self.micro_batches)}")
        bad = [name for name in self.paths if name not in PATHS]
        if bad or not self.paths:
            raise ParamError(f"paths: {bad[0]!r} is not a path; choose from {list(PATHS)}" if bad
                             else f"paths: name at least one of {list(PATHS)}")
        if len(set(self.paths)) != len(self.paths):
            raise ParamError(f"paths repeats a name: {list(self.paths)}")
        self._validate_batches()
        if self.device not in DEVICES:
            raise ParamError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not self.compile_backend.strip():
            raise ParamError("compile_backend must name a torch.compile backend, e.g. inductor")

    def _validate_batches(self) -> None:
        bad = [kind for kind in self.batches if kind not in BATCHES]
        if bad or not self.batches or len(set(self.batches)) != len(self.batches):
            raise ParamError(f"batches: name one or more of {list(BATCHES)} once each, got {list(self.batches)}")
        for kind in self.batches:
            if not set(self.paths) & set(BATCHES[kind]):
                raise ParamError(f"batches: {kind} runs {list(BATCHES[kind])}, and paths names none of them")
        if REALISTIC in self.batches and self.shard is None and self.realistic_median_length >= self.seq_len:
            raise ParamError(f"realistic_median_length {self.realistic_median_length} must be below seq_len "
                             f"{self.seq_len}: generated examples are capped at seq_len")
        if self.shard is not None:
            if REALISTIC not in self.batches:
                raise ParamError(f"shard {self.shard!r} is read by the realistic batches only; batches is "
                                 f"{list(self.batches)}")
            if not (resolve_path(self.shard) / "train").is_dir():
                raise ParamError(f"shard: {resolve_path(self.shard)} holds no train/ partition (a shard root written "
                                 "by `python -m cflib.data convert` holds train/ and eval/)")


# --- the paths ------------------------------------------------------------------------

def train_params(params: ThroughputParams, micro: int, steps: int, data_root: Path, out_dir: Path,
                 kernels: dict[str, Any], packed: bool = False) -> TrainParams:
    """The TrainParams of one measured project run; the peers train with the same optimizer settings."""
    return TrainParams.from_dict({
        "model": params.model, "data": str(data_root), "out_dir": str(out_dir), "seed": params.seed,
        "seq_len": params.seq_len, "micro_batch_per_rank": micro, "global_batch": micro, "max_steps": steps,
        "lr": 2e-5, "bf16": params.bf16, "loss_chunk_tokens": params.loss_chunk_tokens,
        "fp32_loss": params.fp32_loss, "grad_ckpt": params.grad_ckpt, "eval_at_start": False,
        "eval_micro_batch": micro, "exact_match_limit": 0, "save_optimizer_state": params.save_optimizer_state,
        "device": params.device, "pack_sequences": packed, **kernels})


def project_session(name: str, tparams: TrainParams, stream: RealisticStream | None = None) -> Session:
    """One of the project's paths ready to step: the run `tparams` prepares, its trainer's step, its counts."""
    run = prepare(tparams)
    if name in EVERY_ROW_PATHS:  # as for a loss that reads every position
        run.plan = dataclasses.replace(run.plan, supervised_rows_only=False)
    trainer = Trainer(run, progress=False)
    training = trainer.training_step
    model, p = run.model, run.params
    counts = count_parameters(model)
    active = model.config.active_parameters()
    step = trainer.train_step
    if stream is not None:  # the release layout: the stream's windows, which are the windows prepare() planned
        if not np.array_equal(run.packed.members, stream.plan.members):
            raise RuntimeError("the run's pack plan differs from the measured stream's: the paths would not train "
                               "the same examples")

        def step_counting_real_tokens(windows: np.ndarray, next_windows: np.ndarray | None = None) -> dict:
            """The trainer's step, with the tokens of the examples its windows hold (padding aside)."""
            return {**trainer.train_step(windows, next_windows),
                    "real_tokens": int(stream.data.lengths[stream.plan.examples_of(windows)].sum())}
        step = step_counting_real_tokens
    return Session(step, lambda: {**model.kernel_path(), "optimizer": optimizer_kernel(training.optimizer),
                                  "gemms": training.gemms.describe()},
                   trainer=trainer, facts={
        **counts, "params_active": active,
        "model_flops_per_token": flops_per_token(active, model.config.num_hidden_layers, model.config.hidden_size,
                                                 p.seq_len),
        "requested": {**PROJECT_PATHS[name], "pack_sequences": p.pack_sequences},
        "precision": "bf16-autocast" if p.bf16 else "fp32",
        "loss_precision": "fp32" if p.fp32_loss else ("bf16" if p.bf16 else "fp32"),
        "loss_chunk_tokens": p.loss_chunk_tokens,
        "grad_ckpt": run.plan.grad_ckpt,
        "compiled": compiled(training.train_model),
        "optimizer": describe_optimizer(training.optimizer),
    })


def time_evaluation_and_checkpoint(trainer: Trainer, device: torch.device) -> dict:
    """One full held-out evaluation and one checkpoint save, each timed alone, after the steady-state steps. The
    evaluation runs twice: the first pays for its shapes' first calls (kernels compiled or chosen, in this path or
    for every later one in the process), the second is what each later evaluation costs."""
    trainer.run.out_dir.mkdir(parents=True, exist_ok=True)  # the evaluation appends its line to metrics.jsonl
    first = trainer.evaluate("timing-first", epoch=0, with_exact_match=False)
    result = trainer.evaluate("timing", epoch=0, with_exact_match=False)
    sync(device)
    start = time.perf_counter()
    trainer.save("timed-save", epoch=0)
    seconds = time.perf_counter() - start
    path = Path(trainer.checkpoints["timed-save"])
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path)  # hundreds of MB at full size; its size and time are what the record keeps
    return {"eval_s": result["seconds"], "first_eval_s": first["seconds"], "eval_examples": result["examples"],
            "eval_supervised_tokens": result["supervised_tokens"], "eval_loss": result["loss"],
            "checkpoint_save_s": seconds, "checkpoint_bytes": size,
            "checkpoint_with_optimizer_state": trainer.params.save_optimizer_state}


def _session(name: str, tparams: TrainParams, batches: Batches, steps: int, params: ThroughputParams,
             config: ModelConfig, device: torch.device, stack: contextlib.ExitStack) -> Session:
    if name in PROJECT_PATHS:
        return project_session(name, tparams, batches.stream)
    if name in PEER_PATHS:
        return peer_session(PEER_PATHS[name], tparams, config, device, batches.data, steps, params.compile_backend,
                            stack)
    return fed_peer_session(name, params.fed_peers_liger, tparams, config, device, batches.stream, steps,
                            params.compile_backend, stack)


def measure_path(name: str, micro: int, params: ThroughputParams, device: torch.device, config: ModelConfig,
                 batches: Batches, out_dir: Path, repetition: int = 0) -> dict:
    """One path at one micro-batch, from a clean device; never raises for the path's own failures. Profiles and
    the evaluation and checkpoint timings are taken in the first repetition only."""
    steps_batches, warmup = batches.steps_of(name, micro, params.warmup_steps, params.timed_steps)
    entry: dict[str, Any] = {"path": name, "batches": batches.kind, "micro_batch": micro}
    release_memory(device)
    entry["memory_at_start_gib"] = allocated_memory_gib(device)  # anything an earlier path left: part of the peak
    with contextlib.ExitStack() as stack:
        kernels = PROJECT_PATHS.get(name, PROJECT_PATHS["reference"])
        run_dir = out_dir / "runs" / f"{batches.kind}-{name}-mb{micro}"
        compiled_before, setup_started = compile_totals(), time.perf_counter()
        try:
            if kernels.get("full_parameter") is False:  # LoRA adapts a checkpoint: the preset's, written once
                kernels = {**kernels, "init_checkpoint": str(_lora_base(out_dir / "lora_base", config, params.seed))}
            tparams = train_params(params, micro, len(steps_batches), batches.root, run_dir, kernels,
                                   packed=batches.stream is not None)
            session = _session(name, tparams, batches, len(steps_batches), params, config, device, stack)
        except torch.cuda.OutOfMemoryError as err:
            return {**entry, "status": "oom", "reason": error_line(err), "peak_memory_gib": peak_memory_gib(device)}
        except (PathUnavailable, ParamError, ImportError) as err:  # its requirements: the reason it was skipped
            return {**entry, "status": "skipped", "reason": error_line(err)}
        except Exception as err:
            return {**entry, "status": "failed", "reason": error_line(err),
                    "traceback_tail": traceback.format_exc(limit=-3)[-2000:]}
        entry.update(session.facts)
        setup_s = time.perf_counter() - setup_started
        try:
            timing = time_steps(session.step, steps_batches, warmup, device)
            entry["startup"] = startup(setup_s, timing, compiled_before, compile_totals())
            entry["peak_memory_gib"] = peak_memory_gib(device)
            entry["kernel_path"] = session.kernel_path()  # what the forward passes used, read back
            if session.trainer is not None:
                entry["step_capture"] = session.trainer.training_step.graphs_summary()
        except torch.cuda.OutOfMemoryError as err:
            return {**entry, "status": "oom", "reason": error_line(err), "peak_memory_gib": peak_memory_gib(device)}
        except Exception as err:
            return {**entry, "status": "failed", "reason": error_line(err),
                    "traceback_tail": traceback.format_exc(limit=-3)[-2000:]}
        entry.update(status="ok", steps=len(steps_batches), **timing)
        if batches.stream is None:
            entry["model_tflops_per_s"] = timing["tokens_per_s"] * entry["model_flops_per_token"] / 1e12
        else:  # the work the timed examples need, each alone; the same for every path
            useful = batches.stream.useful_flops(entry["params_active"], config.num_hidden_layers, config.hidden_size)
            entry["model_flops_per_token"] = useful / batches.source["timed_example_tokens"]
            entry["model_tflops_per_s"] = useful / sum(timing["step_seconds"]) / 1e12
        if params.profile_steps and micro == params.compare_micro_batch and not repetition:
            # Profiles and the evaluation and checkpoint timings are apart from the steady state: their failure
            # is theirs.
            entry["profile"] = guarded(lambda: profile_steps(
                session.step, steps_batches[:params.profile_steps], device,
                out_dir / "profiles" / f"{batches.kind}-{name}-mb{micro}.txt"))
        if session.trainer is not None and batches.stream is None and micro == params.compare_micro_batch \
                and not repetition:
            entry["evaluation_and_checkpoint"] = guarded(
                lambda: time_evaluation_and_checkpoint(session.trainer, device))
    return entry


def startup(setup_s: float, timing: dict, compiled_before: dict, compiled_after: dict) -> dict:
    """What a path costs before its steady state, apart from it: building it (model, optimizer, kernel choices;
    torch.compile wraps lazily), its first step, and the time its warm-up steps took beyond as many steady-state
    steps (compiling, CUDA-graph capture, autotuning, kernels JIT-compiled; the first path of a run also pays for
    kernels every later one finds compiled), with torch.compile's own seconds, graphs and graph breaks in it."""
    warmup = timing["warmup_step_seconds"]
    steady = float(np.median(timing["step_seconds"]))
    return {"setup_s": setup_s, "first_step_s": warmup[0] if warmup else None,
            "warmup_beyond_steady_s": sum(warmup) - len(warmup) * steady,
            "compile_s": timing["warmup_compile_s"] + timing["timed_compile_s"],
            "compile_s_in_timed_steps": timing["timed_compile_s"],
            "graphs": compiled_after["graphs"] - compiled_before["graphs"],
            "graph_breaks": compiled_after["graph_breaks"] - compiled_before["graph_breaks"]}


def _lora_base(path: Path, config: ModelConfig, seed: int) -> Path:
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(seed)
        save_checkpoint(TRMoEModel(config), path)
    return path


# --- the run ----------------------------------------------------------------------------

def batches_of_kind(kind: str, params: ThroughputParams, config: ModelConfig, out_dir: Path) -> Batches:
    """Random rows or realistic lengths, as `params` sizes them, written under out_dir."""
    if kind == RANDOM_ROWS:
        return random_rows(out_dir / "random_tokens", config.vocab_size, params.seq_len,
                           max(params.micro_batches) * (params.warmup_steps + params.timed_steps),
                           params.eval_examples, params.seed)
    return realistic(params.shard, out_dir / "realistic_lengths", config.vocab_size, params.seq_len,
                     params.realistic_median_length, params.compare_micro_batch, params.warmup_steps,
                     params.timed_steps, params.eval_examples, params.seed)


def _measure_paths(kinds: list[Batches], params: ThroughputParams, device: torch.device, config: ModelConfig,
                   out_dir: Path, ceiling: dict, log: Callable[[str], None]) -> list[dict]:
    """Every path on each kind of batches at each micro-batch, `repetitions` rounds of them in turn, so that each
    path meets the device's drifting clocks as often as the others; one entry per measurement."""
    entries = []
    # A widget in JupyterLab, a text bar under papermill; the lines above it say what each run measured.
    runs = tqdm([(batches, name, micro, repetition) for repetition in range(params.repetitions) for batches in kinds
                 for name in params.paths if name in BATCHES[batches.kind]
                 for micro in batches.micro_batches(params.micro_batches, params.compare_micro_batch)], desc="paths")
    for batches, name, micro, repetition in runs:
        label = f"{name}{' realistic' if batches.stream is not None else ''}"
        runs.set_postfix_str(f"{label} mb{micro}")
        path_started = time.perf_counter()
        entry = measure_path(name, micro, params, device, config, batches, out_dir, repetition)
        entry["wall_s"] = time.perf_counter() - path_started  # build, compile, every step, any extra timing
        if params.repetitions > 1:
            entry["repetition"] = repetition
        if entry["status"] == "ok":
            entry["mfu"] = entry["model_tflops_per_s"] / ceiling["tflops_per_s"]
            memory = f"{entry['peak_memory_gib']:.1f} GiB" if entry["peak_memory_gib"] is not None else "-"
            log(f"{label:>28} mb{micro:<3} {entry['tokens_per_s']:>12,.0f} tokens/s "
                f"{entry['supervised_tokens_per_s']:>12,.0f} supervised/s  {entry['model_tflops_per_s']:7.3g} "
                f"TFLOP/s  MFU {entry['mfu']:.1%}  peak {memory}")
        else:
            log(f"{label:>28} mb{micro:<3} {entry['status']}: {entry['reason']}")
        entries.append(entry)
        # A run cut short (a time limit, a lost machine) still leaves what it measured.
        write_json_atomic(out_dir / "progress.json", {"matmul_ceiling": ceiling, "paths": entries})
    return entries


REPETITION_FIELDS = ("repetition", "status", "tokens_per_s", "supervised_tokens_per_s", "step_seconds",
                     "collector_pause_s", "memory_at_start_gib", "peak_memory_gib", "gpu_clock_mhz", "gpu_power_w")
FIRST_REPETITION_ONLY = ("profile", "evaluation_and_checkpoint")  # measured in the first repetition alone


def best_of_repetitions(entries: list[dict]) -> list[dict]:
    """One entry per kind of batches, path and micro-batch: its fastest repetition (a failed one when none ran),
    with every repetition's timing beside it under 'repetitions', and the first repetition's profile and
    evaluation and checkpoint timings."""
    groups: dict[tuple, list[dict]] = {}
    for entry in entries:
        groups.setdefault((entry["batches"], entry["path"], entry["micro_batch"]), []).append(entry)
    best_entries = []
    for group in groups.values():
        ok = [entry for entry in group if entry["status"] == "ok"]
        best = max(ok, key=lambda entry: entry["tokens_per_s"]) if ok else group[0]
        if len(group) > 1:
            first = {key: group[0][key] for key in FIRST_REPETITION_ONLY if key in group[0]}
            best = {**best, **first,
                    "repetitions": [{k: entry[k] for k in REPETITION_FIELDS if k in entry} for entry in group]}
        best_entries.append(best)
    return best_entries


def _ceilings(params: ThroughputParams, device: torch.device, log: Callable[[str], None]) -> tuple[dict, dict | None]:
    """The matmul ceiling, in the precision the paths compute in (bf16 for the real measurement), and the rate
    held under the power limit when ceiling_sustained_s asks for it."""
    dtype = torch.bfloat16 if params.bf16 else torch.float32
    ceiling = matmul_ceiling(device, params.ceiling_size, params.ceiling_repeats, dtype)
    log(f"{ceiling['dtype']} matmul {params.ceiling_size}^3: {ceiling['tflops_per_s']:.3g} TFLOP/s (the ceiling)")
    if not params.ceiling_sustained_s:
        return ceiling, None
    sustained = sustained_matmul_ceiling(device, params.ceiling_size, params.ceiling_sustained_s, dtype)
    clock = f" at {sustained['gpu_clock_mhz']} MHz" if sustained["gpu_clock_mhz"] else ""
    log(f"  held for {sustained['seconds']:.1f} s: {sustained['tflops_per_s']:.3g} TFLOP/s{clock}")
    return ceiling, sustained


def measure(params: ThroughputParams, log: Callable[[str], None] = print) -> dict:
    """Measure every path on each kind of batches; write and return out_dir/record.json."""
    device = resolve_device(params.device)
    out_dir = job_out_dir(params.out_dir, "runs", ("record.json",), "a throughput record", name="throughput")
    config = PRESETS[params.model]
    kinds = [batches_of_kind(kind, params, config, out_dir) for kind in params.batches]  # a bad shard fails here
    started = time.perf_counter()
    release_memory(device)
    ceiling, sustained = _ceilings(params, device, log)
    entries = best_of_repetitions(_measure_paths(kinds, params, device, config, out_dir, ceiling, log))
    for entry in entries if sustained else []:
        if entry["status"] == "ok":
            entry["mfu_sustained"] = entry["model_tflops_per_s"] / sustained["tflops_per_s"]
    release_memory(device)
    record = {
        **record_header("measure_throughput", device, out_dir, packages=("transformers", "flash-attn-4")),
        # measurement protocol (docs/measuring.md)
        "model": params.model,
        "model_config": config.to_dict(),
        "vocab_size": config.vocab_size,
        "seq_len": params.seq_len,
        "batch_per_rank": list(params.micro_batches),
        "world_size": 1,
        "precision": "bf16-autocast" if params.bf16 else "fp32",
        "grad_ckpt": params.grad_ckpt,
        "loss_chunk_tokens": params.loss_chunk_tokens,
        "telemetry": "none inside timed steps: no progress bar, no metrics file; each step ends with host reads "
                     "of its loss and gradient norm, as a training step does",
        "compilation": {"project": "read back per path (entry 'compiled')",
                        "compiled_peers_backend": params.compile_backend},
        "timing_protocol": timing_protocol(params.warmup_steps, params.timed_steps, device, params.repetitions),
        "batches": list(params.batches),
        **({"realistic": kinds[-1].source} if kinds[-1].kind == REALISTIC else {}),
        "matmul_ceiling": ceiling,
        "matmul_ceiling_sustained": sustained,
        "paths": entries,
        "comparison": compare(entries, params.compare_micro_batch, ceiling),
        "wall_s": time.perf_counter() - started,
        "params": {**dataclasses.asdict(params), "micro_batches": list(params.micro_batches),
                   "paths": list(params.paths), "batches": list(params.batches)},
    }
    notes = []
    for kind in params.batches:
        references = {e["micro_batch"]: e.get("kernel_path") for e in _ok(entries, "reference", batches=kind)}
        same = [e["micro_batch"] for e in _ok(entries, "production", batches=kind)
                if e.get("kernel_path") == references.get(e["micro_batch"])]
        if same:
            notes.append(f"{kind}: production read back the same kernel path as reference at micro-batch(es) "
                         f"{same}: its ratios compare two runs of the same kernels")
    if notes:
        record["notes"] = notes
    write_json_atomic(out_dir / "record.json", record)
    (out_dir / "progress.json").unlink(missing_ok=True)
    return record
