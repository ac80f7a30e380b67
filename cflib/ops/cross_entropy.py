"""Fused linear cross-entropy with per-token weights, for the tied head.

Liger's fused linear CE takes class weights, not token weights (its
reduction="none" path recomputes the whole head in backward). The weighted SFT
loss needs sum_i w_i * CE_i at the speed of the unweighted one, so this op
follows the same design as cflib.ops.loss's reference: head GEMMs over chunks of
tokens (cflib.ops.gemm's), and per chunk one Triton kernel that turns the logits, in
place, into w_i * (softmax - onehot) while writing w_i * CE_i. No fp32 copy of
a chunk's logits is ever made, and the gradients are done when forward ends.

`dft`: Dynamic Fine-Tuning (Wu et al. 2025; TRL's loss_type="dft"), each token's cross-entropy scaled by its own
probability p_i = exp(-CE_i), detached: the kernel writes w_i * p_i * CE_i and w_i * p_i * (softmax - onehot),
the same row scale on the gradient the weights already are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cflib.ops.gemm import TORCH_GEMMS, Gemms
from cflib.ops.interpreter import INTERPRETING
from cflib.ops.loss import saved_gradients

# Logits per block and warps, tried on the device at first use per vocabulary size (do_bench in triton.autotune,
# the logits restored between tries: the kernel overwrites them). Each program reads its row twice; with fewer,
# wider programs fewer rows are in flight, and the second read can come from L2.
# The interpreter takes the widest block that fits the row, untimed.
_CONFIGS = [triton.Config({"BLOCK_V": block}, num_warps=4) for block in (16, 256, 4096)] if INTERPRETING else [
    triton.Config({"BLOCK_V": block}, num_warps=warps) for block in (2048, 4096, 8192) for warps in (4, 8, 16, 32)]


def _fitting(configs: list, named_args: dict, **kwargs) -> list:
    """The blocks no wider than the row (a narrow vocabulary in tests), at least the narrowest."""
    width = triton.next_power_of_2(named_args["vocab_size"])
    fitting = [c for c in configs if c.kwargs["BLOCK_V"] <= width] or configs[:1]
    return [max(fitting, key=lambda c: c.kwargs["BLOCK_V"])] if INTERPRETING else fitting


@triton.autotune(_CONFIGS, key=["vocab_size", "HAS_WEIGHTS", "DFT"], prune_configs_by={"early_config_prune": _fitting},
                 restore_value=["logits_ptr"])
@triton.jit
def _weighted_cross_entropy(logits_ptr, row_stride, targets_ptr, weights_ptr, loss_ptr, vocab_size,
                            HAS_WEIGHTS: tl.constexpr, DFT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    target = tl.load(targets_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32) if HAS_WEIGHTS else 1.0
    running_max = tl.zeros([], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):  # online log-sum-exp: one read of the row
        cols = start + tl.arange(0, BLOCK_V)
        logits = tl.load(row_ptr + cols, mask=cols < vocab_size, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    log_z = running_max + tl.log(running_sum)
    target_logit = tl.load(row_ptr + target).to(tl.float32)
    loss = log_z - target_logit
    if DFT:  # the row's scale times its probability p = exp(-CE), a constant to the gradient
        weight = weight * tl.exp(-loss)
    tl.store(loss_ptr + row, weight * loss)
    for start in range(0, vocab_size, BLOCK_V):  # second read: the gradient, written over the logits
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        logits = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(logits - log_z) - tl.where(cols == target, 1.0, 0.0)
        tl.store(row_ptr + cols, (weight * grad).to(logits_ptr.dtype.element_ty), mask=mask)


def weighted_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor,
                            weights: torch.Tensor | None, dft: bool = False) -> torch.Tensor:
    """Per-row w_i * CE_i (fp32), or under `dft` w_i * sg(p_i) * CE_i; overwrites `logits` [n, V] with
    d(sum)/d(logits)."""
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0] == 0:
        return losses
    _weighted_cross_entropy[(logits.shape[0],)](
        logits, logits.stride(0), targets.contiguous(), weights.contiguous() if weights is not None else losses,
        losses, logits.shape[1], HAS_WEIGHTS=weights is not None, DFT=dft)
    return losses


class FusedLinearWeightedCrossEntropy(torch.autograd.Function):
    """The summed loss of hidden @ weight.T; its head gradient (FP32, accumulated by the GEMMs) goes to `weight`,
    or, given `master` (the FP32 tensor whose half-precision copy `weight` is), to the master as it is: a
    gradient handed back to a half-precision input would be rounded to its dtype first. `gemms`: how the head's
    GEMMs run (cflib.ops.gemm). `dft`: each token's loss scaled by its detached probability (module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                token_weights: torch.Tensor | None, chunk_tokens: int, master: torch.Tensor | None = None,
                gemms: Gemms = TORCH_GEMMS, dft: bool = False) -> torch.Tensor:
        ctx.to_master = master is not None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # A frozen head (LoRA's base, frozen embeddings) takes no gradient: neither its buffer nor its GEMMs.
        head_trains = ctx.needs_input_grad[5 if master is not None else 1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if head_trains else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            logits = gemms.linear(h, weight)
            chunk_weights = token_weights[start:start + chunk_tokens] if token_weights is not None else None
            loss_sum += weighted_cross_entropy_(logits, targets[start:start + chunk_tokens], chunk_weights,
                                                dft).sum()
            gemms.matmul(logits, weight, out=grad_hidden[start:start + chunk_tokens])
            if head_trains:
                gemms.accumulate(grad_weight, logits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = saved_gradients(ctx, grad_output)
        if ctx.to_master:
            return grad_hidden, None, None, None, None, grad_weight, None, None
        return grad_hidden, grad_weight, None, None, None, None, None, None
