"""The training loss: its interface, the losses a run can name, and the SFT cross-entropy on the fastest path.

A loss takes the final hidden states, the tied head's weight and the causally aligned labels of one
micro-batch, and returns the summed loss and the number of supervised targets it summed over; the trainer
divides by the step's total (or weighted mass), so micro-batches and ranks add up exactly. It never holds the
full logits. `register_loss` adds one that a run names with `loss: NAME` (docs/architecture.md shows one).
Built in: `sft_cross_entropy` (SFTLoss) and `dft` (DFTLoss, Dynamic Fine-Tuning, TRL's loss_type="dft").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from cflib.ops.dispatch import KernelChoice
from cflib.ops.gemm import step_gemms
from cflib.ops.loss import IGNORE_INDEX, chunked_cross_entropy_sum, supervised_rows


class Loss(Protocol):
    last_backend: str  # what the last call ran, for the record
    # True: the loss reads the hidden states of the supervised positions only, and takes `gathered=True`: the
    # trainer then hands it just those rows (hidden [R, D], in `supervised`'s order), and the model computes no
    # other row after the last layer's attention. A loss without the attribute gets every position.
    reads_supervised_rows_only: bool

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                 loss_chunk_tokens: int, fp32_loss: bool, token_weights: torch.Tensor | None = None,
                 supervised: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """hidden [B, T, D], head_weight [V, D], labels [B, T] (-100: not supervised); token_weights [B, T] under
        2-D weighting; supervised: the flat indices of the supervised positions, found where the batch is
        collated (None: found here, a sync on a GPU). Returns (summed loss, supervised-target count)."""
        ...


class SFTLoss:
    """Summed token cross-entropy through the tied head, on the fastest path its kernel choice allows.

    With cflib's kernels (kernels.custom), weighted or not, cflib's fused op
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
    in fp32, and follows the same design: head GEMMs over chunks of tokens, one
    Triton kernel per chunk turning logits into their gradient in place.
    """

    reads_supervised_rows_only = True
    dft = False  # DFTLoss: each token's cross-entropy scaled by its detached probability
    kind = "ce"  # the loss in the backend names the record keeps

    def __init__(self, kernels: KernelChoice) -> None:
        self.kernels = kernels
        self.gemms = step_gemms(kernels.quack_gemms)  # the head's GEMMs (cflib.ops.gemm)
        self.last_backend = "none"

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                 loss_chunk_tokens: int, fp32_loss: bool, token_weights: torch.Tensor | None = None,
                 supervised: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                 head_master: torch.Tensor | None = None, gathered: bool = False) -> tuple[torch.Tensor, int]:
        """supervised: the flat indices of labels' supervised positions (cflib.ops.loss.supervised_positions),
        computed where the batch is collated; None: found here, which on a GPU is a sync. gathered: hidden
        [R, D] holds the rows of those positions alone, in their order (a model run with `rows`). row_mask: 1.0
        for each real entry of supervised, 0.0 for padding, on cflib's fused kernel only (cflib.train.graphs
        pads the supervised positions to a static count). head_master: the FP32 weight head_weight is a
        half-precision copy of, outside autograd (cflib.model.weight_copies): cflib's fused loss writes its FP32
        gradient there, as it does into an FP32 head_weight it computes on in half precision; the other losses
        compute on the master itself."""
        liger = self.kernels.liger and token_weights is None and not self.dft
        fused = torch.is_grad_enabled() and (self.kernels.custom or liger)
        if row_mask is not None and not (fused and self.kernels.custom):
            raise ValueError("row_mask needs cflib's fused loss (use_custom_kernels) and gradients")
        if head_master is not None and not (fused and self.kernels.custom):
            head_weight, head_master = head_master, None
        if not fused:
            self.last_backend = f"torch_chunked_linear_{self.kind}" + ("_weighted" if token_weights is not None else "")
            return chunked_cross_entropy_sum(hidden, head_weight, labels, loss_chunk_tokens, fp32_loss,
                                             token_weights=token_weights, supervised=supervised, gathered=gathered,
                                             dft=self.dft)
        hidden, targets, weights = supervised_rows(hidden, labels, token_weights, supervised, row_mask, gathered)
        count = int(targets.numel())
        if count == 0:
            return hidden.sum() * 0.0 + (head_weight if head_master is None else head_master).sum() * 0.0, 0
        device_type = hidden.device.type
        # The head GEMM runs in the autocast dtype, as under autocast: the final norm's output is fp32.
        run_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        with torch.autocast(device_type, enabled=False):
            dtype = torch.float32 if fp32_loss else run_dtype
            hidden, weight = hidden.to(dtype), head_weight.to(dtype)
            if not self.kernels.custom:  # Liger's alone, unweighted
                from cflib.ops.liger import LigerFusedLinearCrossEntropyFunction
                self.last_backend = "liger_fused_linear_ce"
                out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, None, None, IGNORE_INDEX,
                                                                 0.0, 0.0, "sum")
                loss = out[0] if isinstance(out, tuple) else out
                return loss.float(), count
            from cflib.ops.cross_entropy import FusedLinearWeightedCrossEntropy
            if head_master is None and weight.dtype != head_weight.dtype:
                # The head's FP32 gradient goes to the FP32 head as it is, not rounded to the cast's dtype first.
                weight, head_master = head_weight.detach().to(dtype), head_weight
            self.last_backend = (f"cflib_triton_fused_linear_{self.kind}"
                                 + ("_weighted" if token_weights is not None else ""))
            return FusedLinearWeightedCrossEntropy.apply(hidden, weight, targets, weights, loss_chunk_tokens,
                                                         head_master, self.gemms, self.dft), count


class DFTLoss(SFTLoss):
    """Dynamic Fine-Tuning (Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective
    with Reward Rectification"; TRL's `SFTConfig(loss_type="dft")`): each supervised token's cross-entropy scaled
    by its own probability, detached, -sg(p_t) * log p_t, summed as SFTLoss sums. The trainer divides by the
    step's supervised tokens, as TRL does; under 2-D weighting each token's term is multiplied by its weight and
    the sum divided by the weighted mass, as the cross-entropy is (TRL has no token weights: with them all 1 the
    two agree). On cflib's fused kernel (weighted or not); where cflib's kernels are off, on the chunked PyTorch
    reference (cflib.ops.loss), Liger's fused CE is not used for it (cflib.train.execution says so). Held-out
    evaluation stays plain cross-entropy."""

    dft = True
    kind = "dft"


# What every process has on import; torchrun's workers import any other loss a run names (cflib.train.registered).
BUILT_IN_LOSSES: dict[str, Callable[[KernelChoice], Loss]] = {"sft_cross_entropy": SFTLoss, "dft": DFTLoss}
LOSSES: dict[str, Callable[[KernelChoice], Loss]] = dict(BUILT_IN_LOSSES)


def register_loss(name: str, build: Callable[[KernelChoice], Loss]) -> None:
    """Make `loss: NAME` a run's loss: `build(kernels)` is called once per run with its KernelChoice. A run on
    several processes needs `build` defined in a module its workers can import (cflib.train.registered)."""
    LOSSES[name] = build


def make_loss(name: str, kernels: KernelChoice) -> Loss:
    if name not in LOSSES:
        raise KeyError(f"loss {name!r}: expected one of {tuple(LOSSES)}")
    return LOSSES[name](kernels)
