"""The peer's paths ready to step: on the project's random rows, and fed realistic lengths as users feed it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from cflib.bench.feeding import FEEDS, RealisticStream
from cflib.bench.peer import (
    PeerTrainer,
    build_llama,
    check_attention,
    check_liger,
    gradient_checkpointing,
    liger_applied,
    peer_kernel_path,
    varlen_attention,
)
from cflib.bench.timing import flops_per_token
from cflib.data.shards import ShardPartition
from cflib.model.config import ModelConfig
from cflib.train.optim import describe_optimizer
from cflib.train.params import TrainParams
from cflib.train.records import count_parameters
from cflib.train.trainer import Trainer


@dataclass
class Session:
    """A path ready to step: its step function, how to read its kernels back, and what the record says of it."""

    step: Callable[[np.ndarray, np.ndarray | None], dict]  # (units, the next step's units or None) -> its row
    kernel_path: Callable[[], dict]
    facts: dict
    trainer: Trainer | None = None


def compiled(module: torch.nn.Module) -> bool:
    """Whether torch.compile wraps the module or one of its submodules (torch.compile(m) or m.compile())."""
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(m, "_compiled_call_impl", None) is not None
               for m in [module, *module.modules()])


def _compiled_as(trainer: PeerTrainer, backend: str | None) -> str | bool:
    """What the record says of the peer's compilation: the backend, and the decoder body when only it is compiled."""
    if not compiled(trainer.train_model):
        return False
    return backend if trainer.train_model is not trainer.model else f"{backend} (decoder body)"


def _peer_facts(model: torch.nn.Module, trainer: PeerTrainer, tparams: TrainParams, requested: dict,
                liger: str, compile_backend: str | None) -> dict:
    counts = count_parameters(model)
    llama = model.config
    return {
        **counts, "params_active": counts["params_trainable"],
        "model_flops_per_token": flops_per_token(counts["params_trainable"], llama.num_hidden_layers,
                                                 llama.hidden_size, tparams.seq_len),
        "requested": requested,
        "precision": "bf16-autocast" if tparams.bf16 else "fp32",
        "loss_precision": "fp32 inside Liger's fused kernel" if liger != "none" else "fp32 (logits upcast)",
        "loss_chunk_tokens": None,
        "grad_ckpt": gradient_checkpointing(model),
        "compiled": _compiled_as(trainer, compile_backend),
        "optimizer": describe_optimizer(trainer.optimizer),
        "peer_config": {key: getattr(llama, key) for key in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "tie_word_embeddings")},
    }


def _peer(config: ModelConfig, tparams: TrainParams, device: torch.device, data: ShardPartition, steps: int,
          attention: str, liger: str, compile_target: str, compile_backend: str,
          stack: contextlib.ExitStack) -> tuple[torch.nn.Module, PeerTrainer, str | None]:
    """The peer model built, Liger applied and torch.compile set as asked (each undone when `stack` closes), and
    its trainer; the backend it compiles with, or None."""
    if liger != "none":
        check_liger(device)
    model = build_llama(config, device, tparams.seed, attention)
    if liger != "none":
        stack.enter_context(liger_applied(model, device, liger))
    backend = compile_backend if compile_target != "none" else None
    if backend is not None:
        stack.callback(torch._dynamo.reset)  # the next path starts without this one's compiled graphs
    return model, PeerTrainer(model, tparams, device, data, steps, backend, compile_target), backend


def peer_session(variant: dict[str, Any], tparams: TrainParams, config: ModelConfig, device: torch.device,
                 data: ShardPartition, steps: int, compile_backend: str, stack: contextlib.ExitStack) -> Session:
    """A peer on the project's rows, collated as the project collates them; Liger, torch.compile and
    transformers' attention implementation as `variant` asks (cflib.bench.throughput.PEER_PATHS)."""
    attention = variant.get("attention", "sdpa")
    if attention != "sdpa":
        check_attention(attention, device)
    model, trainer, backend = _peer(config, tparams, device, data, steps, attention, variant["liger"],
                                    variant["compile"], compile_backend, stack)
    return Session(trainer.train_step, lambda: peer_kernel_path(model),
                   facts=_peer_facts(model, trainer, tparams, variant, variant["liger"], backend))


def fed_peer_session(name: str, liger: bool, tparams: TrainParams, config: ModelConfig, device: torch.device,
                     stream: RealisticStream, steps: int, compile_backend: str, stack: contextlib.ExitStack) -> Session:
    """A peer fed realistic lengths one of the ways users feed it (cflib.bench.feeding.FEEDS). The compiled feed
    takes the whole model under torch.compile without Liger, whose kernels do not trace there."""
    feed = FEEDS[name]
    attention = varlen_attention(device) if feed.varlen else "sdpa"
    kernels = "none" if feed.compiled or not liger else "all"
    model, trainer, backend = _peer(config, tparams, device, stream.data, steps, attention, kernels,
                                    "model" if feed.compiled else "none", compile_backend, stack)

    def step(units: np.ndarray, next_units: np.ndarray | None = None) -> dict[str, Any]:
        row = trainer.step_on(lambda some: feed.collate(stream.data, stream.plan, some), units, next_units)
        row["real_tokens"] = int(stream.data.lengths[stream.examples(units, feed.unit)].sum())
        return row

    requested = {"liger": kernels, "attn_implementation": attention, "compile": "model" if feed.compiled else "none",
                 "micro_batch_counts": feed.unit}
    return Session(step, lambda: peer_kernel_path(model),
                   facts={**_peer_facts(model, trainer, tparams, requested, kernels, backend),
                          "feed": feed.description})
