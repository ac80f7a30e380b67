"""Knowledge distillation from a teacher of the same vocabulary, neither model's full logits ever held.

Over the supervised tokens i of a micro-batch, with s_i and t_i the student's and the teacher's logits (each from
its own final hidden states through its own tied head), r the ratio and tau the temperature:

    loss = sum_i w_i [(1 - r) CE_i + r tau^2 KL_i],   KL_i = KL(softmax(t_i / tau) || softmax(s_i / tau))

the forward KL from the teacher's distribution to the student's (Hinton et al. 2015; at tau 1 torchtune's ForwardKLLoss,
the teacher's cross-entropy against the student, less the teacher's entropy, a constant; TRL's GKD with beta 0). CE_i is the SFT
cross-entropy, sg(p) CE_i under DFT (cflib.ops.loss); w_i a token's weight under 2-D weighting, else 1. tau^2 keeps
the KL term's gradient, (q_i - p_i) tau, the size of the cross-entropy's whatever tau. The caller divides the sum by
the step's supervised tokens (or weighted mass), as it divides the cross-entropy's.

Both heads' GEMMs and both terms run over chunks of `loss_chunk_tokens` supervised tokens, their gradients computed in
forward as cflib.ops.loss computes the cross-entropy's: at most one chunk of each model's logits is alive. There is no
fused kernel for it: cflib's and Liger's fused losses compute the cross-entropy alone (cflib.train.execution says so
in a run's plan). At r = 0 the loss and its gradients are the chunked cross-entropy's, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cflib.ops.loss import cross_entropy_and_gradient, head_operands, head_precision, saved_gradients, supervised_rows


@dataclass(frozen=True)
class Mix:
    """What the chunks compute: the KL term's share `ratio`, its `temperature`, and whether the cross-entropy term
    is DFT's."""

    ratio: float
    temperature: float
    dft: bool = False


def kl_and_gradient(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KL(softmax(t / tau) || softmax(s / tau)) of fp32 logits [N, V], and the gradient of tau^2 x KL
    with respect to the student's logits s: tau (softmax(s / tau) - softmax(t / tau))."""
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits / temperature, dim=-1)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(dim=-1)
    return kl, log_q.exp_().sub_(p).mul_(temperature)


def _chunk(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None,
           mix: Mix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed loss, summed cross-entropy and KL (each token weighted), and the loss's gradient with
    respect to the student's logits."""
    losses, grad_logits = cross_entropy_and_gradient(logits, targets, mix.dft)
    kl, grad_kl = kl_and_gradient(logits, teacher_logits, mix.temperature)
    # (1 - r) CE + r tau^2 KL; at r = 0 both products are exact (x 1.0, + 0.0): the cross-entropy's own numbers
    scale = mix.ratio * mix.temperature ** 2
    combined = losses * (1.0 - mix.ratio) + kl * scale
    grad_logits = grad_logits * (1.0 - mix.ratio) + grad_kl * mix.ratio
    if weights is not None:  # d(sum w loss)/d logits = w d loss/d logits
        combined, losses, kl = combined * weights, losses * weights, kl * weights
        grad_logits *= weights[:, None]
    return combined.sum(), losses.sum(), kl.sum(), grad_logits


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                teacher_weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None,
                chunk_tokens: int, fp32_loss: bool, mix: Mix) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)  # loss, cross-entropy, KL
        grad_hidden = torch.empty_like(hidden)
        head_trains = ctx.needs_input_grad[1]  # a frozen head (LoRA's base) takes no gradient: no buffer, no GEMM
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if head_trains else None
        with head_precision(hidden.device, fp32_loss):
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                h, w = head_operands(hidden[start:end], weight, fp32_loss)
                teacher_h, teacher_w = head_operands(teacher_hidden[start:end], teacher_weight, fp32_loss)
                chunk_weights = None if token_weights is None else token_weights[start:end]
                *chunk_sums, grad_logits = _chunk((h @ w.t()).float(), (teacher_h @ teacher_w.t()).float(),
                                                  targets[start:end], chunk_weights, mix)
                sums += torch.stack(chunk_sums)
                grad_logits = grad_logits.to(h.dtype)
                grad_hidden[start:end] = grad_logits @ w
                if head_trains:
                    grad_weight += (grad_logits.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        loss, terms = sums[0].clone(), sums[1:].clone()
        ctx.mark_non_differentiable(terms)
        return loss, terms

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, _grad_terms: torch.Tensor):
        return *saved_gradients(ctx, grad_output), None, None, None, None, None, None, None


class DistillationLoss:
    """The training loss of a run with a teacher (cflib.train.teacher): the chunked sum above, and the count of
    supervised targets it summed over, as the SFT losses return them (cflib.ops.sft_loss). It reads the supervised
    rows alone (`gathered`, as SFTLoss). `last_terms` holds the last call's summed cross-entropy and KL [2],
    detached on the device (no sync), for the run's metrics."""

    reads_supervised_rows_only = True

    def __init__(self, ratio: float, temperature: float, dft: bool = False) -> None:
        if not 0.0 <= ratio <= 1.0 or not temperature > 0.0:
            raise ValueError(f"distillation needs a ratio in [0, 1] and a positive temperature, got {ratio}, "
                             f"{temperature}")
        self.mix = Mix(ratio, temperature, dft)
        self.last_backend = "none"
        self.last_terms: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                 teacher_head: torch.Tensor, labels: torch.Tensor, loss_chunk_tokens: int, fp32_loss: bool,
                 token_weights: torch.Tensor | None = None, supervised: torch.Tensor | None = None,
                 gathered: bool = False) -> tuple[torch.Tensor, int]:
        """hidden and teacher_hidden: each model's final hidden states, [B, T, D] and [B, T, D_teacher], or with
        `gathered` the supervised rows alone (supervised_rows); head_weight [V, D] and teacher_head [V, D_teacher]
        their tied heads; the rest as SFTLoss takes it."""
        if loss_chunk_tokens <= 0:
            raise ValueError(f"loss_chunk_tokens must be positive, got {loss_chunk_tokens}")
        if teacher_head.shape[0] != head_weight.shape[0]:
            raise ValueError(f"the teacher's vocabulary has {teacher_head.shape[0]} tokens, the student's "
                             f"{head_weight.shape[0]}")
        hidden, targets, weights = supervised_rows(hidden, labels, token_weights, supervised, gathered=gathered)
        teacher_rows, _, _ = supervised_rows(teacher_hidden, labels, None, supervised, gathered=gathered)
        self.last_backend = (f"torch_chunked_linear_{'dft' if self.mix.dft else 'ce'}_kl"
                             + ("_weighted" if weights is not None else ""))
        count = int(targets.numel())
        if count == 0:
            self.last_terms = torch.zeros(2, dtype=torch.float32, device=hidden.device)
            return hidden.sum() * 0.0 + head_weight.sum() * 0.0, 0
        if head_weight.dtype != hidden.dtype:  # as the chunked cross-entropy: autocast leaves the head fp32
            head_weight = head_weight.to(hidden.dtype)
        # The teacher's operands once in the student's dtype: the teacher may be held in BF16 (bf16: true).
        teacher_rows, teacher_head = teacher_rows.detach().to(hidden.dtype), teacher_head.detach().to(hidden.dtype)
        loss, self.last_terms = _ChunkedDistillation.apply(hidden, head_weight, teacher_rows, teacher_head, targets,
                                                           weights, loss_chunk_tokens, fp32_loss, self.mix)
        return loss, count
