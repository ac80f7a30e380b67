"""Run records and metrics: what ran, on what, with which kernels, and what came out."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from cflib.jobs import record_header
from cflib.jsonio import parse_json
from cflib.model.lora import describe as describe_lora

if TYPE_CHECKING:  # the trainer builds on this module
    from cflib.train.trainer import Trainer


class MetricsLog:
    """Append-only JSON lines; each line is flushed so a crash loses at most one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.listeners: list[Callable[[dict], None]] = []  # the trackers of report_to (cflib.train.trackers)

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step`: a resumed run logs those steps again."""
        if self.path.is_file():
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= step]
            # Replaced whole: a kill while rewriting must not lose the rows kept.
            staging = self.path.with_name(f".{self.path.name}.staging-{os.getpid()}")
            with open(staging, "w") as out:
                out.writelines(json.dumps(row, default=str) + "\n" for row in kept)
                out.flush()
                os.fsync(out.fileno())
            os.replace(staging, self.path)

    def write(self, **row: Any) -> dict:
        with open(self.path, "a") as out:
            out.write(json.dumps(row, default=str) + "\n")
        for listener in self.listeners:
            listener(row)
        return row


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl; a last line cut off by a kill mid-append is dropped, any other bad line
    is a ValueError naming file and line."""
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
        rows.append(row)
    return rows


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params_total": total, "params_trainable": trainable}


def _throughput(trainer: "Trainer") -> dict:
    """The steady state's rates, its model FLOPs and the run's peak memory."""
    config, steady = trainer.model.config, trainer.steady
    steady_s = steady["seconds"]
    tokens_per_s = steady["tokens"] / steady_s if steady_s else None
    flops_per_token = (6 * config.active_parameters()
                       + 6 * config.num_hidden_layers * config.hidden_size * trainer.params.seq_len)
    return {
        "steady_state_tokens_per_s": tokens_per_s,
        "steady_state_supervised_tokens_per_s": steady["supervised_tokens"] / steady_s if steady_s else None,
        "timed_steps": steady["steps"],
        "model_flops_per_token": flops_per_token,
        "model_tflops_per_s": tokens_per_s * flops_per_token / 1e12 if tokens_per_s else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(trainer.device) / 2**30
                            if trainer.device.type == "cuda" else None),
    }


# The kernel parameters a record repeats beside what ran.
KERNELS_REQUESTED = ("use_custom_kernels", "require_liger", "attention_backend", "epilogue_swiglu", "quack_gemms",
                     "kept_swiglu_layers")


def train_record(trainer: "Trainer", final: dict, epochs_done: int, wall_s: float) -> dict:
    """record.json of a finished run: the measurement protocol's fields, then what the run did."""
    run, p, model = trainer.run, trainer.params, trainer.model
    config = model.config
    eval_block: dict[str, Any] = {"final": final, "history": trainer.evals}
    at_start = next((e for e in trainer.evals if e["tag"] == "start"), None)
    if at_start is not None:
        eval_block["at_start"] = at_start
    eval_block["epochs"] = [e for e in trainer.evals if e["tag"].startswith("epoch-")]
    return {
        **record_header("train_sft", trainer.device, run.out_dir, device_count=trainer.dist.world_size,
                        params=p),
        # measurement protocol (docs/measuring.md)
        "world_size": trainer.dist.world_size, "strategy": run.strategy,
        "memory_estimate": run.memory_estimate,
        "kernel_path": {**(trainer.train_kernel_path or model.kernel_path()), "loss": trainer.loss.last_backend,
                        "gemms": trainer.gemms.describe()},
        "kernels_requested": {**{name: getattr(p, name) for name in KERNELS_REQUESTED},
                              "notes": list(run.kernels.notes)},
        **count_parameters(model),
        "lora": None if run.lora is None else {**describe_lora(model), "base": {
            key: value for key, value in run.lora.base.items() if key != "config"}},
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
        "compiled": False, "step_capture": trainer.graphs_summary(),  # CUDA-graph replays (cflib.train.graphs)
        "timing_protocol": {
            "warmup_steps_excluded": trainer.warmup_exclude,
            "sync_boundaries": "torch.cuda.synchronize before and after each timed optimizer step"
            if trainer.device.type == "cuda" else "host timers around each optimizer step (CPU: synchronous)",
            "includes_eval": False,
            "includes_checkpoint_io": False,
            "tokens_counted": "padded tokens fed to the model",
        },
        "throughput": _throughput(trainer),
        "timing": {**trainer.timing, "wall_s": wall_s},
        # the run
        "model_source": run.model_source,
        "model_config": config.to_dict(),
        "data": {"root": str(run.data_root), "train_examples": len(run.train_data),
                 "eval_examples": len(run.eval_data), "vocab_size": run.train_data.vocab_size,
                 "eos_token_id": run.train_data.eos_token_id, "max_seq_len": run.train_data.max_seq_len,
                 "preflight": run.preflight},
        "packing": run.packing_efficiency(),
        "loss_weighting": trainer.loss_weighting(),
        "schedule": {"steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
                     "warmup_steps": run.warmup_steps, "steps_done": trainer.step, "epochs_started": epochs_done,
                     "fill_ins_per_epoch": trainer.fill_ins},
        "eval": eval_block,
        "checkpoints": trainer.checkpoints,
    }
