"""Data parallelism: the process group, the wrapping strategy, and each rank's share of a step.

One shuffled stream per epoch (seeded by seed and epoch) is cut into global
batches; rank r takes the r-th contiguous slice of every global batch and
splits it into its microbatches. The stream is padded to a whole number of
global batches with examples from its own start (fill-ins), so every example
is seen every epoch and every rank runs the same number of steps.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cflib.model.config import ModelConfig
from cflib.model.lora import base_bytes

# fp32 weights + fp32 gradients + AdamW's two fp32 moments.
TRAINING_BYTES_PER_PARAM = 16
WEIGHT_AND_GRADIENT_BYTES_PER_PARAM = 8  # another optimizer's state counted on its own (training_state_bytes)
# Activation bytes per token per layer per hidden unit held for backward by this
# reference path: 36.0 GiB peak for the 200M preset at 16 x 2,048 in BF16 on an
# H200 (outputs/records/train_sft_200m_1gpu_h200.json) less 3.0 GiB of state
# gives ~70; fp32 doubles it; checkpointing keeps each layer's input and one layer.
ACTIVATION_BYTES = {"bf16": 72, "fp32": 144, "grad_ckpt": 8}
# memory_estimate's DDP condition: model, optimizer state and activations within this share of one device.
DEVICE_SHARE = 0.9
# DDP's gradient buckets: a flat fp32 copy of every trainable gradient, all-reduced bucket by bucket.
DDP_BUCKET_BYTES_PER_PARAM = 4
# FSDP gathers weights as they are stored (fp32 here: no mixed-precision policy) and reduce-scatters fp32 gradients.
GATHERED_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class DistContext:
    """Where this process stands; the single-process default needs no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def agree(self, decision: bool) -> bool:
        """Rank 0's decision, on every rank: branches around collectives must not diverge."""
        if not self.active:
            return decision
        flag = [decision]
        dist.broadcast_object_list(flag, src=0)
        return bool(flag[0])

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def gather(self, value: Any) -> list:
        """Every rank's `value` (picklable), in rank order, on every rank: a collective every rank calls."""
        if not self.active:
            return [value]
        values: list = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def init_from_torchrun(device_type: str, timeout_s: int) -> DistContext:
    """Join the process group torchrun describes in the environment (NCCL on GPUs, gloo on CPU)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    # A timeout on every collective: a dead or stuck peer ends the job instead of hanging it.
    device_id = torch.device("cuda", local_rank) if device_type == "cuda" else None
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank)


def epoch_stream(num_examples: int, seed: int, epoch: int, global_batch: int) -> tuple[np.ndarray, int]:
    """The epoch's shuffled example order padded to whole global batches, and the fill-in count."""
    return whole_batches(np.random.default_rng([seed, epoch]).permutation(num_examples), global_batch)


def whole_batches(order: np.ndarray, global_batch: int) -> tuple[np.ndarray, int]:
    """An epoch's order padded to whole global batches with units from its own start, and the fill-in count."""
    fill_ins = -len(order) % global_batch
    if fill_ins:
        order = np.concatenate([order, np.resize(order, fill_ins)])
    return order, fill_ins


def rank_share(step_examples: np.ndarray, ctx: DistContext) -> np.ndarray:
    """This rank's contiguous slice of one global batch."""
    per_rank = len(step_examples) // ctx.world_size
    return step_examples[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]


def training_state_bytes(config: ModelConfig, weights: dict | None = None, optimizer: dict | None = None
                         ) -> tuple[int, int]:
    """The bytes of the whole model's weights and optimizer state, and the bytes each weight is stored in: 16 B
    per trainable parameter (fp32 weights, grads, AdamW moments). `weights` ({trainable_params, frozen_params,
    frozen_dtype, frozen_by}; None: every weight trains) splits them: a frozen weight (a LoRA run's base, or what
    frozen_modules freezes) is held as frozen_bytes says, with no gradient and no moments.
    `optimizer` (cflib.train.optimizer_choice.optimizer_memory; None: AdamW): another optimizer's state, in bytes
    (`state_bytes`), in place of AdamW's moments: 8 B per trainable parameter, then, and that state."""
    per_param, state = ((TRAINING_BYTES_PER_PARAM, 0) if optimizer is None else
                        (WEIGHT_AND_GRADIENT_BYTES_PER_PARAM, optimizer["state_bytes"]))
    if weights is None:
        return per_param * config.num_parameters() + state, GATHERED_BYTES_PER_PARAM
    stored = 2 if weights["frozen_dtype"] == "bfloat16" else 4
    return frozen_bytes(config, weights) + per_param * weights["trainable_params"] + state, stored


def frozen_bytes(config: ModelConfig, weights: dict) -> int:
    """The frozen weights' bytes as held: a LoRA run's base as attach_lora holds it (its layers' matrices in
    base_dtype, its embeddings and norms in float32: cflib.model.lora.base_bytes, which counts a distillation
    teacher too), what frozen_modules freezes at 4 B per parameter."""
    if weights["frozen_by"] == "lora":
        return base_bytes(config, weights["frozen_dtype"])
    return 4 * weights["frozen_params"]


def memory_estimate(config: ModelConfig, micro_batch_per_rank: int, seq_len: int, bf16: bool, grad_ckpt: bool,
                    device_memory_bytes: int, weights: dict | None = None, optimizer: dict | None = None) -> dict:
    """Bytes one rank needs to hold a whole model and its optimizer state (the DDP condition).

    `weights` (training_state_bytes'): the frozen weights take 4 or 2 B/param (no gradient, no moments), and
    only the trainable ones the 16 B/param of training; the estimate keeps the split. `optimizer`
    (training_state_bytes'): another optimizer's state in place of AdamW's moments, kept in the estimate too."""
    state, stored = training_state_bytes(config, weights, optimizer)
    trained_bytes, kept = ("16 B", "fp32 weights, grads, AdamW moments") if optimizer is None else (
        "8 B", "fp32 weights, grads")
    if weights is None:
        rule = f"{trained_bytes}/param ({kept})"
    else:
        frozen = (f"LoRA: frozen base {frozen_bytes(config, weights):,} B ({weights['frozen_params']:,} parameters, "
                  f"the layers' matrices in {weights['frozen_dtype']}, embeddings and norms in float32"
                  if weights["frozen_by"] == "lora" else f"{weights['frozen_by']}: frozen weights {stored} B/param "
                  f"({weights['frozen_params']:,} in {weights['frozen_dtype']}")
        trained = "adapter parameter" if weights["frozen_by"] == "lora" else "trainable parameter"
        rule = (f"{frozen}, no gradient, no moments) + {trained_bytes} per {trained} "
                f"({weights['trainable_params']:,}: {kept})")
    if optimizer is not None:
        rule += f" + {optimizer['rule']}"
    per_unit = ACTIVATION_BYTES["grad_ckpt" if grad_ckpt else ("bf16" if bf16 else "fp32")]
    activations = per_unit * micro_batch_per_rank * seq_len * config.num_hidden_layers * config.hidden_size
    need = state + activations
    return {"model_and_optimizer_bytes": state, "activation_bytes": activations, "total_bytes": need,
            "device_bytes": device_memory_bytes, "fits_one_device": need <= DEVICE_SHARE * device_memory_bytes,
            **({} if weights is None else {"weights": dict(weights)}),
            **({} if optimizer is None else {"optimizer": dict(optimizer)}),
            "rule": rule + " + activations (72 B per token x layer x hidden in BF16, 144 in fp32, 8 with "
                    "checkpointing, measured on the reference path); DDP when it fits 90% of one device"}


def strategy_costs(config: ModelConfig, world_size: int, micro_steps: int, weights: dict | None = None,
                   optimizer: dict | None = None) -> dict:
    """What one rank holds and sends per optimizer step under DDP and under FSDP, computed, not measured.

    Ring collectives: a rank sends (W-1)/W of the buffer in an all-gather or a reduce-scatter, twice that in an
    all-reduce. DDP all-reduces the trainable gradients once a step (the micro-steps before the last skip the
    sync) and holds the whole state plus its buckets. FSDP (`fully_shard` per layer, then the root) holds 1/W of
    the state; every micro-step gathers each layer's weights twice (forward, and again in backward: they are
    resharded after forward) and the root's (embedding, final norm) once, and the last one reduce-scatters the
    gradients; at a time it holds the root and about two layers gathered (the one running and the one prefetched).
    `weights` as memory_estimate's: frozen weights are gathered in their dtype and carry no gradient (DDP's
    buckets and both strategies' reductions hold the trainable gradients alone); `optimizer` as memory_estimate's."""
    params = config.num_parameters()
    # The root (the embeddings, also the tied head, and the final norm) is held in fp32 whatever the base's dtype;
    # the layers as their weights are held (a LoRA run's BF16 base: its matrices in BF16, its norms in fp32).
    root = 4 * (config.vocab_size * config.hidden_size + config.hidden_size)
    layers = base_bytes(config, "float32" if weights is None else weights["frozen_dtype"]) - root
    per_layer = layers // config.num_hidden_layers
    trainable = params if weights is None else weights["trainable_params"]
    state, _ = training_state_bytes(config, weights, optimizer)
    share = (world_size - 1) / world_size
    gathered_per_micro_step = 2 * layers + root
    return {
        "world_size": world_size, "micro_steps": micro_steps,
        "ddp": {"state_bytes": state + DDP_BUCKET_BYTES_PER_PARAM * trainable,
                "sent_bytes_per_step": round(2 * share * GATHERED_BYTES_PER_PARAM * trainable)},
        "fsdp": {"state_bytes": round(state / world_size + root + 2 * per_layer),
                 "sent_bytes_per_step": round(share * (micro_steps * gathered_per_micro_step
                                                       + GATHERED_BYTES_PER_PARAM * trainable))},
        "rule": "ring collectives; DDP: the state + 4 B/param of buckets, an fp32 all-reduce of the trainable "
                "gradients a step; FSDP: the state / world_size + the root and two layers gathered, each "
                "micro-step gathering the layers twice and the root once, one fp32 reduce-scatter a step",
    }


def with_teacher(estimate: dict, teacher_bytes: int) -> dict:
    """memory_estimate's figures (and strategy_costs', under `per_strategy`) with a distillation teacher's weights
    beside the model (cflib.train.teacher): every rank holds a whole copy, which FSDP does not shard, and which takes
    no gradient, optimizer state or activation kept for backward."""
    total = estimate["total_bytes"] + teacher_bytes
    found = {**estimate, "teacher_bytes": teacher_bytes, "total_bytes": total,
             "fits_one_device": total <= DEVICE_SHARE * estimate["device_bytes"],
             "rule": estimate["rule"] + "; + the teacher's weights, whole on every rank"}
    if "per_strategy" in estimate:
        costs = estimate["per_strategy"]
        found["per_strategy"] = {**costs, **{name: {**costs[name], "state_bytes": costs[name]["state_bytes"]
                                                    + teacher_bytes} for name in ("ddp", "fsdp")}}
    return found


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_strategy(requested: str, estimate: dict) -> str:
    if requested != "auto":
        return requested
    return "ddp" if estimate["fits_one_device"] else "fsdp"


def wrap_model(model: torch.nn.Module, strategy: str, ctx: DistContext, device: torch.device) -> torch.nn.Module:
    """The module the training step calls: DDP around the model, or the model sharded in place."""
    if not ctx.active:
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        # Buffers (route tables, RoPE frequencies) are identical by construction: no per-step broadcast. Newer
        # torch names the switch forward_sync_buffers (and deprecates the old name); either way none is synced.
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
            torch.nn.parallel.DistributedDataParallel).parameters else {"broadcast_buffers": False})
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **no_buffer_sync)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # FSDP's default mesh is on the accelerator whenever one exists: a CPU run on a machine with fewer GPUs
    # than ranks would ask for a GPU per rank ("invalid device ordinal"), so the mesh names the run's device.
    mesh = init_device_mesh(device.type, (ctx.world_size,))
    for layer in model.layers:  # one all-gather per layer keeps the peak at one layer's weights
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
