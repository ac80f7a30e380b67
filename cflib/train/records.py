"""Run records and metrics: what ran, on what, with which kernels, and what came out.

`train_record(summary)` writes record.json from a `RunSummary`, the plain data the training loop
(cflib.train.trainer) gathers at the end of a run; `MetricsLog` appends metrics.jsonl as it goes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cflib.atomic import open_append, write_text_atomic
from cflib.errors import shown
from cflib.jobs import record_header
from cflib.jsonio import parse_json


class MetricsLog:
    """Append-only JSON lines; each line is flushed so a crash loses at most one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.listeners: list[Callable[[dict], None]] = []  # the trackers of report_to (cflib.train.trackers)

    def truncate_after(self, step: int) -> list[dict]:
        """Drop rows past `step`: a resumed run logs those steps again. Returns the rows kept, the file read once
        for all a resume takes from it (the trackers' replay, an evaluation's row written before a kill)."""
        if not self.path.is_file():
            return []
        kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= step]
        # Replaced whole: a kill while rewriting must not lose the rows kept.
        write_text_atomic(self.path, "".join(json.dumps(row, default=str) + "\n" for row in kept))
        return kept

    def write(self, **row: Any) -> dict:
        with open_append(self.path) as out:
            out.write(json.dumps(row, default=str) + "\n")
        for listener in self.listeners:
            listener(row)
        return row


# What readers of a metrics.jsonl (resume, compare_runs, the curves) take from every row of these events.
ROW_FIELDS = {"train": {"step": int, "tokens": int, "loss": (int, float)}, "eval": {"step": int, "loss": (int, float)}}


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl; a last line cut off by a kill mid-append is dropped, any other bad line (not
    JSON, not an object, a train or eval row without its step, tokens or loss) is a ValueError naming file, line
    and key."""
    rows = []
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, "a metrics row", ValueError)
        except ValueError as err:
            if number == len(lines):  # no newline after it: the append a kill interrupted
                break
            raise ValueError(f"{path}:{number}: not a JSON row ({err})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        for key, kind in ROW_FIELDS.get(row.get("event"), {}).items():
            if isinstance(row.get(key), bool) or not isinstance(row.get(key), kind):
                raise ValueError(f"{path}:{number}: this {row['event']} row's {key!r} must be a number, got "
                                 f"{shown(row.get(key))}")
        rows.append(row)
    return rows


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params_total": total, "params_trainable": trainable}


@dataclass(frozen=True)
class RunSummary:
    """A finished run as plain data: what it was set to run (the prepared run's facts and execution plan) and
    what it did (steps, evaluations, checkpoints, timings, the kernels read back)."""

    params: Any  # the run's TrainParams
    device: torch.device
    out_dir: Path
    world_size: int
    strategy: str
    memory_estimate: dict
    model_source: str
    hub_start: dict | None  # init_checkpoint hub:ORG/NAME: the repository, the revision named and its commit
    model_config: dict
    params_active: int
    parameter_counts: dict[str, int]
    lora: dict | None
    kernel_path: dict[str, str]  # read back from the modules that ran a training step
    kernels_requested: dict
    execution_plan: dict
    step_capture: dict
    data: dict
    packing: dict | None
    loss_weighting: dict | None
    schedule: dict
    evals: list[dict]
    checkpoints: dict[str, str]
    timing: dict[str, float]
    steady: dict  # the steps after warm-up: tokens, supervised tokens, seconds, steps
    warmup_steps_excluded: int
    peak_memory_gib: float | None
    optimizer_groups: list[dict]
    filters: dict | None
    early_stopping: dict | None
    best_metric: dict  # its name, which way is better, the value best/ holds and its step
    registered: dict  # where the registered loss and metrics are defined (cflib.train.registered)


def _throughput(summary: RunSummary) -> dict:
    """The steady state's rates, its model FLOPs and the run's peak memory."""
    config, steady = summary.model_config, summary.steady
    steady_s = steady["seconds"]
    tokens_per_s = steady["tokens"] / steady_s if steady_s else None
    flops_per_token = (6 * summary.params_active
                       + 6 * config["num_hidden_layers"] * config["hidden_size"] * summary.params.seq_len)
    return {
        "steady_state_tokens_per_s": tokens_per_s,
        "steady_state_supervised_tokens_per_s": steady["supervised_tokens"] / steady_s if steady_s else None,
        "timed_steps": steady["steps"],
        "model_flops_per_token": flops_per_token,
        "model_tflops_per_s": tokens_per_s * flops_per_token / 1e12 if tokens_per_s else None,
        "peak_memory_gib": summary.peak_memory_gib,
    }


def _eval_block(evals: list[dict]) -> dict:
    block: dict[str, Any] = {"final": dict(evals[-1]), "history": evals}
    at_start = next((e for e in evals if e["tag"] == "start"), None)
    if at_start is not None:
        block["at_start"] = at_start
    block["epochs"] = [e for e in evals if e["tag"].startswith("epoch-")]
    return block


def _timing_protocol(summary: RunSummary) -> dict:
    cuda = summary.device.type == "cuda"
    return {"warmup_steps_excluded": summary.warmup_steps_excluded,
            "sync_boundaries": "torch.cuda.synchronize before and after each timed optimizer step" if cuda
            else "host timers around each optimizer step (CPU: synchronous)",
            "includes_eval": False, "includes_checkpoint_io": False, "tokens_counted": "padded tokens fed to the model"}


def train_record(summary: RunSummary) -> dict:
    """record.json of a finished run: the measurement protocol's fields, then what the run did."""
    p, config = summary.params, summary.model_config
    return {
        **record_header("train_sft", summary.device, summary.out_dir, device_count=summary.world_size, params=p),
        # measurement protocol (docs/measuring.md)
        "world_size": summary.world_size, "strategy": summary.strategy, "memory_estimate": summary.memory_estimate,
        "kernel_path": summary.kernel_path, "kernels_requested": summary.kernels_requested,
        "execution_plan": summary.execution_plan, **summary.parameter_counts, "lora": summary.lora,
        "params_active": summary.params_active, "vocab_size": config["vocab_size"], "seq_len": p.seq_len,
        "micro_batch_per_rank": p.micro_batch_per_rank, "global_batch": p.global_batch, "grad_accum": p.grad_accum,
        "precision": "bf16-autocast" if p.bf16 else "fp32",
        "loss_precision": "fp32" if p.fp32_loss else ("bf16" if p.bf16 else "fp32"),
        "grad_ckpt": p.grad_ckpt, "loss_chunk_tokens": p.loss_chunk_tokens,
        "telemetry": "tqdm progress + metrics.jsonl per step (host sync once per step)",
        "compiled": False, "step_capture": summary.step_capture,  # CUDA-graph replays (cflib.train.graphs)
        "timing_protocol": _timing_protocol(summary),
        "throughput": _throughput(summary),
        "timing": summary.timing,
        # the run
        "model_source": summary.model_source, "hub_start": summary.hub_start, "model_config": config,
        "data": summary.data,
        "packing": summary.packing, "loss_weighting": summary.loss_weighting, "schedule": summary.schedule,
        "eval": _eval_block(summary.evals), "checkpoints": summary.checkpoints,
        "optimizer_groups": summary.optimizer_groups, "filters": summary.filters,
        "early_stopping": summary.early_stopping, "best_metric": summary.best_metric,
        "registered": summary.registered,
    }
