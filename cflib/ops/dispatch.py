"""Which kernels run: the checks behind `use_custom_kernels` / `require_liger`, and the loss dispatch.

`auto` takes a fast path only where every check passes and otherwise stays on
PyTorch; `true` (and `require_liger: true`) stops before any training step with
the check that failed. The kernels that actually ran are read back from the
modules after a forward (`TRMoEModel.kernel_path()`, `SFTLoss.last_backend`),
never inferred from these flags.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from cflib.errors import KernelUnavailable
from cflib.ops.attention import plan_attention
from cflib.ops.loss import IGNORE_INDEX, chunked_cross_entropy_sum, supervised_rows


@dataclass(frozen=True)
class KernelPlan:
    liger: bool  # Liger's RMSNorm, RoPE, SwiGLU and fused linear CE
    custom: bool  # cflib's Triton TR-MoE block, QKV/norm kernels and fused linear CE
    notes: tuple[str, ...] = ()  # why `auto` left a fast path off
    attention: str = "auto"  # attention_backend, checked here (cflib.ops.attention)

    def describe(self) -> str:
        chosen = [name for name, on in (("Liger", self.liger), ("cflib Triton", self.custom)) if on]
        text = " + ".join(chosen) if chosen else "PyTorch reference"
        return text + "".join(f"; {note}" for note in self.notes)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_problem(device: torch.device, rocm_opt_in: bool) -> str | None:
    """Why Triton kernels cannot run on `device`, or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if triton_interpreting():
        return None if device.type == "cpu" else f"TRITON_INTERPRET=1 runs kernels on the CPU, not on {device}"
    if device.type != "cuda":
        return f"no GPU: the device is {device} (set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)"
    if torch.version.hip is not None and not rocm_opt_in:
        return "ROCm device: the kernels are tuned and validated on CUDA; use true to opt in"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (bfloat16 Triton kernels need Ampere or newer)"
    return None


def liger_problem() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def plan_kernels(use_custom_kernels: str, require_liger: bool, device: torch.device,
                 attention_backend: str = "auto", head_dim: int = 64, packed: bool = False) -> KernelPlan:
    """Resolve the flags against this device, or raise KernelUnavailable naming the check.

    Shapes need no check here but attention's (head_dim; packed: whether training rows are packed windows):
    every valid ModelConfig (even head_dim) runs on every other path."""
    notes: list[str] = list(plan_attention(attention_backend, device, head_dim, packed))

    def decide(flag_name: str, mode: str, problem: str | None) -> bool:
        if mode == "false":
            return False
        if problem is None:
            return True
        if mode == "true":
            raise KernelUnavailable(f"{flag_name}: true, but {problem}")
        notes.append(f"{flag_name}: {problem}")
        return False

    common = triton_problem(device, rocm_opt_in=use_custom_kernels == "true")
    if common is None and device.type == "cpu" and not require_liger and use_custom_kernels != "true":
        # The interpreter proves kernels correct at a snail's pace: only an explicit request runs it.
        common = "no GPU: Triton's interpreter runs only when a fast path is required (true)"
    custom = decide("use_custom_kernels", use_custom_kernels, common)
    # use_custom_kernels: true requires cflib's kernels; Liger is required only by require_liger.
    # The reference path (use_custom_kernels: false) is plain PyTorch unless Liger is required.
    liger_mode = "true" if require_liger else ("false" if use_custom_kernels == "false" else "auto")
    liger = decide("require_liger" if require_liger else "use_custom_kernels (Liger)", liger_mode,
                   common or liger_problem())
    return KernelPlan(liger=liger, custom=custom, notes=tuple(notes), attention=attention_backend)


class SFTLoss:
    """Summed token cross-entropy through the tied head, on the fastest path the plan allows.

    With cflib's kernels (plan.custom), weighted or not, cflib's fused op
    (cflib.ops.cross_entropy); with Liger's alone, Liger's fused linear CE for
    the unweighted loss. Both return (sum, count) like
    cflib.ops.loss.chunked_cross_entropy_sum, the reference they are tested against.

    Why cflib's op, not Liger's, serves the unweighted loss too: Liger's
    (liger-kernel 0.8.5, ops/fused_linear_cross_entropy.py) reads the count
    of supervised targets back to the host in forward (`target_mask.sum().item()`)
    and compares the incoming gradient with 1.0 on the host in backward
    (`torch.equal`), two syncs a step that stall the host's queue of kernels
    mid-step; it also accumulates the head's gradient in the head's dtype
    (bf16 here). cflib's op has no host read (the count is the index tensor's
    length, known on the host: `supervised` below), accumulates that gradient
    in fp32, and follows the same plan: head GEMMs over chunks of tokens, one
    Triton kernel per chunk turning logits into their gradient in place.
    """

    def __init__(self, plan: KernelPlan) -> None:
        self.plan = plan
        self.last_backend = "none"

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                 loss_chunk_tokens: int, fp32_loss: bool, token_weights: torch.Tensor | None = None,
                 supervised: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """supervised: the flat indices of labels' supervised positions (cflib.ops.loss.supervised_positions),
        computed where the batch is collated; None: found here, which on a GPU is a sync."""
        fused = torch.is_grad_enabled() and (self.plan.custom or (self.plan.liger and token_weights is None))
        if not fused:
            self.last_backend = "torch_chunked_linear_ce" + ("_weighted" if token_weights is not None else "")
            return chunked_cross_entropy_sum(hidden, head_weight, labels, loss_chunk_tokens, fp32_loss,
                                             token_weights=token_weights, supervised=supervised)
        hidden, targets, weights = supervised_rows(hidden, labels, token_weights, supervised)
        count = int(targets.numel())
        if count == 0:
            return hidden.sum() * 0.0 + head_weight.sum() * 0.0, 0
        device_type = hidden.device.type
        # The head GEMM runs in the autocast dtype, as under autocast: the final norm's output is fp32.
        run_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        with torch.autocast(device_type, enabled=False):
            dtype = torch.float32 if fp32_loss else run_dtype
            hidden, weight = hidden.to(dtype), head_weight.to(dtype)
            if not self.plan.custom:  # Liger's alone, unweighted
                from cflib.ops.liger import LigerFusedLinearCrossEntropyFunction
                self.last_backend = "liger_fused_linear_ce"
                out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, None, None, IGNORE_INDEX,
                                                                 0.0, 0.0, "sum")
                loss = out[0] if isinstance(out, tuple) else out
                return loss.float(), count
            from cflib.ops.cross_entropy import FusedLinearWeightedCrossEntropy
            self.last_backend = "cflib_triton_fused_linear_ce" + ("_weighted" if weights is not None else "")
            return FusedLinearWeightedCrossEntropy.apply(hidden, weight, targets, weights, loss_chunk_tokens), count
