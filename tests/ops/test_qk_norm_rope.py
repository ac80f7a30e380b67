"""cflib's QK-norm + RoPE kernel (cflib.ops.qk_norm_rope) beside its PyTorch reference, forward and backward.

RMSNorm on each query and key head with eps 1e-6, then RoPE (rotate-half, theta 10000), v passed through:
docs/formats.md#the-tr-moe-model.
"""
from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops.qk_norm_rope import qkv_norm_rope

EPS, THETA = 1e-6, 10000.0
BATCH, SEQ, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 7, 4, 2, 16


def rope_tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., hd] for the given positions, in fp32: rotate-half layout, each frequency twice."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions.double()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def reference(qkv, q_weight, k_weight, cos, sin):
    q, k, v = qkv.view(-1, cos.shape[-2], Q_HEADS + 2 * KV_HEADS, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS],
                                                                              dim=2)
    cos, sin = cos[..., None, :], sin[..., None, :]  # over the heads

    def norm_then_rotate(x, weight):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight
        return x * cos + rotate_half(x) * sin
    return norm_then_rotate(q, q_weight), norm_then_rotate(k, k_weight), v


def inputs(seed: int, packed: bool, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    if packed:  # two examples per row, positions restarting at 0 where the second starts
        positions = torch.tensor([list(range(3)) + list(range(4)), list(range(5)) + list(range(2))])
    else:
        positions = torch.arange(seq)
    cos, sin = rope_tables(positions)
    return {"qkv": torch.randn(BATCH * seq, width, generator=gen) * 3,
            "q_weight": torch.randn(HEAD_DIM, generator=gen) * 0.1 + 1.0,
            "k_weight": torch.randn(HEAD_DIM, generator=gen) * 0.1 + 1.0, "cos": cos, "sin": sin}


@pytest.mark.parametrize("packed, seq", [(False, SEQ), (True, SEQ), (False, 300)],
                         ids=["dense", "packed", "dense-many-programs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_the_reference_forward_and_backward(dtype, packed, seq):
    """As training runs it: qkv, the QKV GEMM's output, in the compute dtype; the norm weights in fp32. At 300
    tokens a row the backward's weight gradient is summed over several programs' partials."""
    raw = inputs(int(packed), packed, seq)
    dtypes = {"qkv": dtype}
    rounded = {name: value.to(dtypes.get(name, value.dtype)) for name, value in raw.items()}
    grad = ("qkv", "q_weight", "k_weight")
    truth = run(reference, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 7)
    got = run(lambda qkv, q_weight, k_weight, cos, sin: qkv_norm_rope(
        qkv, q_weight, k_weight, cos, sin, BATCH, seq, Q_HEADS, KV_HEADS, EPS),
        leaves(rounded, {}, KERNEL_DEVICE, grad), 7)
    assert [got[f"out{i}"].shape for i in range(3)] == [(BATCH, seq, Q_HEADS, HEAD_DIM),
                                                        (BATCH, seq, KV_HEADS, HEAD_DIM),
                                                        (BATCH, seq, KV_HEADS, HEAD_DIM)]
    assert got["d_qkv"].dtype == dtype
    assert torch.equal(got["out2"].cpu(), rounded["qkv"].view(BATCH, seq, -1, HEAD_DIM)[:, :, -KV_HEADS:])  # v exact
    assert_matches(got, truth, dtype)


def test_a_first_call_under_inference_mode_leaves_training_steps_their_backward():
    """The kernel's positions are cached per shape: made first under inference mode (an evaluation), they must
    still be savable for a training step's backward."""
    from cflib.ops import qk_norm_rope

    qk_norm_rope._positions.cache_clear()
    raw = {name: value.to(KERNEL_DEVICE) for name, value in inputs(3, False).items()}
    args = (raw["q_weight"], raw["k_weight"], raw["cos"], raw["sin"], BATCH, SEQ, Q_HEADS, KV_HEADS, EPS)
    with torch.inference_mode():
        qkv_norm_rope(raw["qkv"], *args)
    qkv = raw["qkv"].clone().requires_grad_(True)
    q, k, v = qkv_norm_rope(qkv, *args)
    (q.sum() + k.sum() + v.sum()).backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
