"""Tiny TR-MoE configurations and inputs shared by the cflib unit tests.

A plain helper module (not a conftest): the test files import it directly.
"""
from __future__ import annotations

import pytest
import torch

from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.ops.dispatch import quack_problem

# Where tests run the fast kernels: the GPU where there is one, else the CPU in Triton's interpreter (conftest.py).
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The SwiGLU GEMMs run quack's epilogues on a GPU and their PyTorch form on a CPU: on a GPU without quack (an
# image without the gpu extra) the tests that call them directly are skipped, naming why.
_QUACK = quack_problem(KERNEL_DEVICE) if KERNEL_DEVICE.type == "cuda" else None
needs_quack_on_gpu = pytest.mark.skipif(_QUACK is not None, reason=f"quack's GEMMs cannot run here: {_QUACK}")

TINY_FIELDS: dict[str, object] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=50, max_position_embeddings=64, shared_intermediate_size=48,
    num_experts=4, intermediate_size=32,
)


def tiny_config(**overrides: object) -> ModelConfig:
    """A valid config small enough for CPU tests (head_dim 8, 4 experts of width 8)."""
    return ModelConfig(**{**TINY_FIELDS, **overrides})


def tiny_model(seed: int = 0, **overrides: object) -> TRMoEModel:
    """A freshly initialised fp32 tiny model in eval mode, reproducible from `seed`."""
    torch.manual_seed(seed)
    return TRMoEModel(tiny_config(**overrides)).eval()


def random_ids(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] int64 token ids from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def logits(model: TRMoEModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full logits through the tied head (tests only: fine at tiny sizes)."""
    return model(input_ids) @ model.head_weight.t()



def trained_model(sequences: list[list[int]], vocab_size: int, steps: int = 40, seed: int = 0,
                  **overrides: object) -> TRMoEModel:
    """A tiny model trained (Adam, next-token loss) on `sequences` until it half remembers them:
    its greedy continuations vary from token to token, unlike a random model's, and are partly right."""
    model = tiny_model(seed, vocab_size=vocab_size, **overrides).train()
    width = max(len(ids) for ids in sequences)
    inputs = torch.tensor([ids[:-1] + [0] * (width - len(ids)) for ids in sequences])
    targets = torch.tensor([ids[1:] + [-100] * (width - len(ids)) for ids in sequences])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):  # right padding: no real token sees a pad, and pads are not scored
        loss = torch.nn.functional.cross_entropy(logits(model, inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
