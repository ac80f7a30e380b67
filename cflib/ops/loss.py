"""SFT loss from hidden states and the tied head, never materialising full logits.

The head GEMM and cross-entropy run over chunks of `loss_chunk_tokens`
supervised tokens; the gradients of each chunk are computed in the forward
pass, so at most one chunk of logits is alive at any time (autograd would
otherwise keep every chunk's logits until backward).

`dft` (Dynamic Fine-Tuning, Wu et al. 2025; TRL's loss_type="dft") scales each token's cross-entropy by its own
probability, detached: w_i * sg(p_i) * CE_i, p_i = exp(-CE_i), whose gradient is w_i * p_i * (softmax - onehot).
This is the reference cflib's fused kernel (cflib.ops.cross_entropy) is tested against.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the shard format's unsupervised label (cflib.data.shards); ops import no data code


def head_precision(device: torch.device, fp32_loss: bool) -> contextlib.AbstractContextManager:
    """fp32_loss: the head GEMMs in fp32 even under BF16 autocast, which would otherwise run them in BF16."""
    return torch.autocast(device.type, enabled=False) if fp32_loss else contextlib.nullcontext()


def head_operands(h: torch.Tensor, weight: torch.Tensor, fp32_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (h.float(), weight.float()) if fp32_loss else (h, weight)


def _loss_only(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None,
               chunk_tokens: int, fp32_loss: bool, dft: bool = False) -> torch.Tensor:
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with head_precision(hidden.device, fp32_loss):
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, w = head_operands(hidden[start:start + chunk_tokens], weight, fp32_loss)
            losses = F.cross_entropy((h @ w.t()).float(), targets[start:start + chunk_tokens], reduction="none")
            if dft:
                losses = losses * torch.exp(-losses)
            if token_weights is not None:
                losses = losses * token_weights[start:start + chunk_tokens]
            loss_sum += losses.sum()
    return loss_sum


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                token_weights: torch.Tensor | None, chunk_tokens: int, fp32_loss: bool, dft: bool = False
                ) -> torch.Tensor:
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        head_trains = ctx.needs_input_grad[1]  # a frozen head takes no gradient: no buffer, no GEMM
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if head_trains else None
        with head_precision(hidden.device, fp32_loss):
            for start in range(0, hidden.shape[0], chunk_tokens):
                h, w = head_operands(hidden[start:start + chunk_tokens], weight, fp32_loss)
                t = targets[start:start + chunk_tokens]
                losses, grad_logits = cross_entropy_and_gradient((h @ w.t()).float(), t, dft)
                if token_weights is not None:  # d(sum w CE)/d logits = w (softmax - onehot)
                    w_chunk = token_weights[start:start + chunk_tokens]
                    losses = losses * w_chunk
                    grad_logits *= w_chunk[:, None]
                loss_sum += losses.sum()
                grad_logits = grad_logits.to(h.dtype)
                grad_hidden[start:start + chunk_tokens] = grad_logits @ w
                if head_trains:
                    grad_weight += (grad_logits.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return *saved_gradients(ctx, grad_output), None, None, None, None, None


def cross_entropy_and_gradient(logits: torch.Tensor, targets: torch.Tensor, dft: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy of fp32 `logits` [N, V] (under `dft` scaled by its detached probability) and its
    gradient with respect to the logits; the logits are left as they are (the distillation loss reads them again)."""
    log_z = torch.logsumexp(logits, dim=-1)
    losses = log_z - logits.gather(1, targets[:, None]).squeeze(1)
    # d(sum CE)/d logits = softmax - onehot, from the log-partition just computed
    grad_logits = torch.exp(logits - log_z[:, None])
    grad_logits[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    if dft:  # d(sum sg(p) CE)/d logits = p (softmax - onehot), p = exp(-CE) held constant
        probability = torch.exp(-losses)
        losses = losses * probability
        grad_logits *= probability[:, None]
    return losses, grad_logits


def saved_gradients(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (hidden, head weight) gradients a fused loss computed in forward, scaled by the incoming gradient (the
    head's None where it is frozen)."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return (grad_hidden * grad_output.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_output)


def supervised_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat indices of labels' supervised positions, in order. Computed on the host where the batch is
    collated and moved with it, they let the loss gather rows without a boolean mask, whose size a GPU
    would have to report back to the host (a sync) in every step."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def supervised_rows(hidden: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor | None,
                    supervised: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                    gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Hidden states, targets and fp32 weights of the supervised positions only: prompt tokens cost no head FLOPs.

    supervised: supervised_positions(labels), already on labels' device; None: found here. row_mask: 1.0 for
    each real entry of supervised, 0.0 for padding (a CUDA graph's static shape), multiplying the weights.
    gathered: hidden [R, D] holds those rows already, in supervised's order (a model run with `rows`)."""
    if token_weights is not None and token_weights.shape != labels.shape:
        raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, labels {tuple(labels.shape)}")
    if row_mask is not None and (supervised is None or row_mask.shape != supervised.shape):
        raise ValueError("row_mask needs supervised of its shape")
    if gathered and (supervised is None or hidden.dim() != 2 or hidden.shape[0] != supervised.numel()):
        raise ValueError(f"gathered hidden states must be one row per supervised position: hidden "
                         f"{tuple(hidden.shape)}, supervised {None if supervised is None else supervised.numel()}")
    if supervised is None:
        supervised = supervised_positions(labels)
    weights = token_weights.reshape(-1).index_select(0, supervised).float() if token_weights is not None else None
    if row_mask is not None:
        weights = row_mask.float() if weights is None else weights * row_mask
    rows = hidden if gathered else hidden.reshape(-1, hidden.shape[-1]).index_select(0, supervised)
    return rows, labels.reshape(-1).index_select(0, supervised), weights


def chunked_cross_entropy_sum(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                              loss_chunk_tokens: int = 1024, fp32_loss: bool = True,
                              token_weights: torch.Tensor | None = None,
                              supervised: torch.Tensor | None = None, gathered: bool = False, dft: bool = False
                              ) -> tuple[torch.Tensor, int]:
    """Sum of (weighted) token cross-entropies over supervised positions, and their count; `dft`: each scaled by
    its detached probability first (module docstring).

    hidden: [..., D] final hidden states; labels: [...] causally aligned
    targets with -100 where unsupervised; token_weights: None, or float
    weights of labels' shape (only supervised positions are read), giving
    sum_i w_i * CE_i. Callers divide by the count, or the weighted mass, of the
    whole (accumulated) batch, so accumulation gives the exact (weighted) mean.
    supervised: the supervised positions' flat indices (supervised_positions), if known; gathered: hidden
    [R, D] holds their rows already (supervised_rows).
    """
    if loss_chunk_tokens <= 0:
        raise ValueError(f"loss_chunk_tokens must be positive, got {loss_chunk_tokens}")
    hidden, targets, token_weights = supervised_rows(hidden, labels, token_weights, supervised, gathered=gathered)
    count = int(targets.numel())
    if count == 0:
        return hidden.sum() * 0.0 + head_weight.sum() * 0.0, 0
    if head_weight.dtype != hidden.dtype:  # autocast leaves the head weight fp32, hidden bf16
        head_weight = head_weight.to(hidden.dtype)
    if not torch.is_grad_enabled():  # evaluation: no head gradients to compute or hold
        return _loss_only(hidden, head_weight, targets, token_weights, loss_chunk_tokens, fp32_loss, dft), count
    loss = _ChunkedLinearCrossEntropy.apply(hidden, head_weight, targets, token_weights, loss_chunk_tokens, fp32_loss,
                                            dft)
    return loss, count


def cross_entropy_mean(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                       loss_chunk_tokens: int = 1024, fp32_loss: bool = True) -> torch.Tensor:
    """Mean cross-entropy over the supervised tokens of one batch."""
    loss_sum, count = chunked_cross_entropy_sum(hidden, head_weight, labels, loss_chunk_tokens, fp32_loss)
    return loss_sum / max(count, 1)
