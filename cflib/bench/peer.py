"""The peer stack a user would otherwise pick: a Hugging Face transformers Llama of equal active width.

The peer is trained exactly as `cflib.train.Trainer` trains the project's model:
BF16 autocast, the loss summed over supervised tokens and divided by their
count, gradient clipping, the same fused AdamW and schedule; on random rows it
reads the same shard rows collated the same way, on realistic lengths the
batches users feed it (cflib.bench.feeding). Its loss is its own (full logits,
or Liger's fused linear cross-entropy). `transformers` and `liger-kernel` are
optional (`pip install -e ".[bench]"`); padding-free batches also need a varlen
attention kernel transformers can use (flash-attn-4 on Hopper). A peer that
cannot run here raises `PathUnavailable`.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any, Callable, Iterator

import numpy as np
import torch

from cflib.data.shards import IGNORE_INDEX, ShardPartition, collate
from cflib.model.config import ModelConfig
from cflib.train.batch import to_device
from cflib.train.held_out import autocast
from cflib.train.optim import make_optimizer
from cflib.train.params import TrainParams
from cflib.train.run import resolve_schedule
from cflib.train.step import optimizer_settings


class PathUnavailable(RuntimeError):
    """A measured path whose requirements this machine does not meet; the message says which."""


def active_ffn_width(config: ModelConfig) -> int:
    """The SwiGLU width a token passes through: the shared expert plus its top-k routed experts."""
    return config.shared_intermediate_size + config.num_experts_per_tok * config.expert_width


def llama_config(config: ModelConfig, attn_implementation: str = "sdpa") -> Any:
    """A LlamaConfig of the same depth, width, heads, vocabulary and active FFN width; tied, SDPA by default."""
    try:
        from transformers import LlamaConfig
    except ImportError as err:
        raise PathUnavailable(f"transformers is not installed ({err}); pip install -e '.[bench]'") from None
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=active_ffn_width(config),
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=True,
        attn_implementation=attn_implementation, use_cache=False)


# transformers' attention implementations that run padding-free batches with a varlen kernel, preferred first.
VARLEN_ATTENTION = ("flash_attention_4", "flash_attention_3", "flash_attention_2")


def check_attention(name: str, device: torch.device) -> None:
    """PathUnavailable unless transformers can run attn_implementation `name` (a FlashAttention) here."""
    if name not in VARLEN_ATTENTION:
        raise PathUnavailable(f"attention {name!r}: the peers take sdpa or one of {VARLEN_ATTENTION}")
    if device.type != "cuda":
        raise PathUnavailable(f"attention {name} needs a CUDA device; this run is on {device.type}")
    try:
        import transformers
        import transformers.utils as available
    except ImportError as err:
        raise PathUnavailable(f"transformers is not installed ({err}); pip install -e '.[bench]'") from None
    check = getattr(available, f"is_flash_attn_{name[-1]}_available", None)
    if check is None or not check():
        raise PathUnavailable(f"transformers {transformers.__version__} finds no {name} kernel installed here")


def varlen_attention(device: torch.device) -> str:
    """The attn_implementation that runs padding-free batches here with a varlen kernel, or PathUnavailable."""
    if device.type != "cuda":
        raise PathUnavailable(f"padding-free batches need a varlen attention kernel (FlashAttention 4, 3 or 2), "
                              f"which needs a CUDA device; this run is on {device.type}")
    try:
        import transformers
        import transformers.utils as available
    except ImportError as err:
        raise PathUnavailable(f"transformers is not installed ({err}); pip install -e '.[bench]'") from None
    for name in VARLEN_ATTENTION:
        check = getattr(available, f"is_flash_attn_{name[-1]}_available", None)
        if check is not None and check():
            return name
    raise PathUnavailable(f"no varlen attention kernel that transformers {transformers.__version__} can use is "
                          "installed: neither flash-attn-4 (flash_attn.cute), flash-attn-3 nor flash-attn 2")


def check_liger(device: torch.device) -> None:
    """Liger's kernels run here, or PathUnavailable says why (before any model is built)."""
    if device.type != "cuda":
        raise PathUnavailable(f"Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear CE) need a CUDA "
                              f"device; this run is on {device.type}")
    try:
        importlib.import_module("liger_kernel.transformers")
    except ImportError as err:
        raise PathUnavailable(f"liger-kernel is not installed ({err}); pip install -e '.[bench]'") from None


# What of Liger a peer takes: every kernel it has for Llama, or its fused linear cross-entropy alone (the loss a
# torch.compile'd decoder body leaves outside: Liger's loss does not trace under torch.compile).
LIGER = ("none", "all", "loss")


@contextlib.contextmanager
def liger_applied(model: torch.nn.Module, device: torch.device, kernels: str = "all") -> Iterator[None]:
    """Liger on `model` for the block's duration: its RMSNorm, RoPE, SwiGLU and fused linear cross-entropy
    (`kernels="all"`), or the fused linear cross-entropy alone (`"loss"`).

    Liger also patches transformers' Llama module globals (RoPE, the norm and MLP
    classes); they are put back afterwards so later peers in the same process stay plain.
    """
    if kernels not in LIGER[1:]:
        raise ValueError(f"liger_applied: kernels must be one of {LIGER[1:]}, got {kernels!r}")
    check_liger(device)
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {name: getattr(modeling_llama, name) for name in names}
    saved_forward = modeling_llama.LlamaForCausalLM.forward
    every = kernels == "all"
    try:
        apply_liger_kernel_to_llama(rope=every, rms_norm=every, swiglu=every, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
        yield
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
        modeling_llama.LlamaForCausalLM.forward = saved_forward


def function_name(function: Callable) -> str:
    """module.name of a function, or of a module standing for one: transformers 5.25+ turns its Llama RoPE into a
    `kernels` function module (it calls the plain function unless a Hub kernel is swapped in), named by its layer
    name."""
    name = getattr(function, "__name__", None)
    if name is not None:
        return f"{function.__module__}.{name}"
    kind = type(function)
    return f"{kind.__module__}.{getattr(kind, 'kernel_layer_name', None) or kind.__name__} (function module)"


def peer_kernel_path(model: torch.nn.Module) -> dict[str, str]:
    """What the peer's modules and functions are now, read back (call it while Liger's patches are in place)."""
    from transformers.models.llama import modeling_llama

    layer = model.model.layers[0]
    rope = modeling_llama.apply_rotary_pos_emb
    liger_loss = "liger" in getattr(model.forward, "__func__", model.forward).__module__
    path = {
        "attention": str(model.config._attn_implementation),
        "rmsnorm": layer.input_layernorm._get_name(),
        "rope": function_name(rope),
        "swiglu": layer.mlp._get_name(),
        "loss": "liger_fused_linear_cross_entropy" if liger_loss else "transformers ForCausalLMLoss (full fp32 logits)",
    }
    if path["attention"].startswith("flash_attention"):
        # transformers imports the flash kernels at the first forward: what it loaded is what ran
        from transformers import modeling_flash_attention_utils as flash

        varlen = getattr(flash, "_flash_varlen_fn", None)
        path["attention_kernel"] = function_name(varlen) if varlen is not None else "not loaded"
    return path


def gradient_checkpointing(model: torch.nn.Module) -> bool:
    """Read back from the model; transformers 5 renamed the property (4.x has only the old name)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


# What of the peer torch.compile takes: nothing, the whole model as HF Trainer's `torch_compile=True` does (loss
# included), or the decoder body (`model.model`), leaving the head and loss to run eagerly (Liger's fused linear
# cross-entropy, which does not trace).
COMPILE = ("none", "model", "decoder")


def compile_peer(model: torch.nn.Module, target: str, backend: str) -> torch.nn.Module:
    """The module the peer's steps call: `model`, or it compiled whole, or `model` with its decoder body compiled
    in place (its parameters and state dict unchanged)."""
    if target not in COMPILE:
        raise ValueError(f"compile target must be one of {COMPILE}, got {target!r}")
    if target == "model":
        return torch.compile(model, backend=backend)
    if target == "decoder":
        model.model.compile(backend=backend)
    return model


class PeerTrainer:
    """One optimizer step of the peer, as `Trainer.train_step` does it for the project's model."""

    def __init__(self, model: torch.nn.Module, params: TrainParams, device: torch.device, data: ShardPartition,
                 total_steps: int, compile_backend: str | None = None, compile_target: str = "model") -> None:
        self.model, self.params, self.device, self.data = model, params, device, data
        self.train_model = compile_peer(model, compile_target if compile_backend else "none", compile_backend)
        self.optimizer = make_optimizer(model, optimizer_settings(params), fused=device.type == "cuda")
        schedule = resolve_schedule(params, total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: schedule.factor(step))
        self.staged: tuple[np.ndarray, dict[str, Any]] | None = None  # the next step's batch, collated (step_on)

    def train_step(self, step_examples: np.ndarray, next_examples: np.ndarray | None = None) -> dict:
        """One step on shard rows, collated as the project collates them."""
        return self.step_on(self._collated, step_examples, next_examples)

    def _collated(self, step_examples: np.ndarray) -> dict[str, Any]:
        input_ids, labels = collate([self.data[int(i)] for i in step_examples], self.data.eos_token_id)
        return {"input_ids": input_ids, "labels": labels}

    def step_on(self, collated: Callable[[np.ndarray], dict[str, Any]], units: np.ndarray,
                next_units: np.ndarray | None = None) -> dict:
        """One step on `collated(units)`. With `next_units`, the next batch is collated and pinned while the GPU
        runs this step, as a DataLoader's workers with pinned memory would have it ready: the project's trainer
        stages its next step the same way."""
        staged, self.staged = self.staged, None
        batch = staged[1] if staged is not None and np.array_equal(staged[0], units) else collated(units)

        def stage_next() -> None:
            if next_units is not None:
                following = collated(next_units)
                if self.device.type == "cuda":
                    following = {name: value.pin_memory() if isinstance(value, torch.Tensor) else value
                                 for name, value in following.items()}
                self.staged = (np.array(next_units), following)
        return self.train_batch(batch, meanwhile=stage_next)

    def train_batch(self, batch: dict[str, Any], meanwhile: Callable[[], None] | None = None) -> dict:
        """One step on a batch of model inputs (labels causally aligned); tensors go to the device, ints stay.
        `meanwhile` runs once the step is queued, before the host waits for its loss."""
        labels = batch["labels"]
        supervised = int((labels != IGNORE_INDEX).sum())
        inputs = {name: to_device(value, self.device) if isinstance(value, torch.Tensor) else value
                  for name, value in batch.items()}
        # A tensor, not an int: torch.compile would specialise (and recompile) on each new count.
        count = torch.tensor(supervised, device=self.device)
        with autocast(self.device, self.params.bf16):
            # Our labels are already causally aligned: shift_labels stops transformers shifting them again.
            # num_items_in_batch makes the loss a sum over supervised tokens divided by their count.
            loss = self.train_model(**inputs, shift_labels=inputs["labels"], num_items_in_batch=count).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.params.max_grad_norm or math.inf)
        # As the project's step on a GPU: the update is queued without a host read; one read at the end.
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if meanwhile is not None:
            meanwhile()
        loss_value, grad_norm = torch.stack([loss.detach().float(), norm.float()]).tolist()
        return {"loss": loss_value, "grad_norm": grad_norm, "tokens": labels.numel(), "supervised_tokens": supervised}


def build_llama(config: ModelConfig, device: torch.device, seed: int,
                attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The peer model in fp32 (autocast runs it in BF16, as the project's), built on the device."""
    llama = llama_config(config, attn_implementation)
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama)
    return model.train()
