"""NEFTune: uniform noise on the token embeddings of training forwards (Jain et al. 2023, "NEFTune: Noisy
Embeddings Improve Instruction Finetuning"; TRL's `neftune_noise_alpha`).

A training forward adds to each token's embedding `U(-1, 1)^d x alpha / sqrt(L x d)`, d the hidden size. The
paper's L is the sequence length; transformers' hook (TRL's) takes the embedding output's second dimension: the
padded length of the batch, a packed window, or under padding-free packing the whole micro-batch, so a short
example's noise shrinks with what it happens to be batched with, and would shrink again with the padding a CUDA
graph's static shape adds. Here, as in the authors' training code, L is the token count of the example each token belongs to (its `num_tokens`, the
real tokens of its dense row or of its document in a packed window; the separator after it in a window takes
its L too): the noise an example gets does not depend on its batch, the padding, packing or CUDA graphs, and a
batch of equal-length rows gets TRL's. The training step works the lengths out on the host with the batch
(`example_lengths`, [B, T]; a window's padding takes the window's length); a forward that gives none (a caller
of its own, in training mode) takes the row length T, TRL's choice.

Evaluation, held-out loss, generation and export never see the noise: the module adds none outside training
mode, and only the training step passes the lengths. The noise is drawn from the module's own generator, which
the training step seeds per rank from the run's seed (`noise_generator`) and checkpoints keep, so that every rank
draws its own noise and a resumed run draws the noise the uninterrupted one drew; inside a CUDA graph the
generator is registered with the capture and each replay draws afresh. The module holds no tensor: the state dict,
checkpoints and adapters do not change with it. The execution plan attaches it (cflib.train.execution).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cflib.seeds import stream_seed

# The generator's stream among the run's: a constant of its own, so that no other seeded stream coincides with it.
NOISE_STREAM = 0x4E45_4654  # "NEFT"


class EmbeddingNoise(nn.Module):
    """NEFTune's noise, added to the token embeddings `h` [B, T, d] of a training forward (module docstring)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"neftune_noise_alpha must be a positive finite number, got {alpha}")
        self.alpha = float(alpha)
        self.generator: torch.Generator | None = None  # None: torch's default generator of h's device
        self.last_form = "none"  # what the last forward did, for the run record's kernel path

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"

    def bound(self, h: torch.Tensor, example_lengths: torch.Tensor | None) -> torch.Tensor:
        """alpha / sqrt(L x d) for each token, [B, T, 1] in float32: the largest noise any coordinate gets."""
        batch, seq, width = h.shape
        if example_lengths is None:
            lengths = torch.full((batch, seq), float(seq), device=h.device)
        else:
            lengths = example_lengths.to(h.device, torch.float32).clamp(min=1.0)
        return (self.alpha / torch.sqrt(lengths * width))[..., None]

    def forward(self, h: torch.Tensor, example_lengths: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training:
            self.last_form = "none"
            return h
        uniform = torch.rand(h.shape, generator=self.generator, device=h.device, dtype=torch.float32)
        self.last_form = "neftune"
        # The noise carries no gradient: the embedding's gradient is the one of h, as without noise.
        return h + ((uniform * 2 - 1) * self.bound(h, example_lengths)).to(h.dtype)


def attach_noise(model: nn.Module, alpha: float | None) -> nn.Module:
    """`model` (a TRMoEModel) adding NEFTune's noise of `alpha` to its training forwards' embeddings, or none
    (alpha None or 0); in place."""
    model.embedding_noise = EmbeddingNoise(alpha).train(model.training) if alpha else None
    return model


def embedding_noise(model: nn.Module) -> EmbeddingNoise | None:
    return getattr(model, "embedding_noise", None)


def noise_seed(seed: int, rank: int, step: int = 0) -> int:
    """The noise generator's seed for `rank` of a run of `seed`, from `step` (0: the run's start; a resume whose
    checkpoint kept no generator state starts a stream of its own at its step): each rank its own stream."""
    return stream_seed(seed, rank, step, NOISE_STREAM)


def noise_generator(device: torch.device, seed: int, rank: int) -> torch.Generator:
    """A generator on `device` seeded for `rank` at the run's start (noise_seed)."""
    return torch.Generator(device=device).manual_seed(noise_seed(seed, rank))
