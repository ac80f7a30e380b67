"""Liger's ops as cflib calls them (cflib.ops.liger; cflib.model.fast, cflib.ops.dispatch) beside their
PyTorch references, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run, skip_reason
from tiny_models import KERNEL_DEVICE

from cflib.ops.liger import (LigerFusedLinearCrossEntropyFunction, LigerRMSNormFunction, LigerRopeFunction,
                             LigerSiLUMulFunction)
from cflib.ops.loss import IGNORE_INDEX

EPS, THETA = 1e-6, 10000.0


def check(fn, reference, raw, dtypes, grad, dtype, multiplies_bf16=False):
    if reason := skip_reason(dtype, multiplies_bf16, KERNEL_DEVICE):
        pytest.skip(reason)
    rounded = {name: value.to(dtypes.get(name, value.dtype)) for name, value in raw.items()}
    truth = run(reference, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 9)
    got = run(fn, leaves(rounded, {}, KERNEL_DEVICE, grad), 9)
    assert_matches(got, truth, dtype)


def randn(gen, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=gen) * scale + shift


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    raw = {"x": randn(gen, 24, 48, scale=2.0), "weight": randn(gen, 48, scale=0.1, shift=1.0)}
    check(lambda x, weight: LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "gemma", False),
          lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight,
          raw, {"x": dtype}, ("x", "weight"), dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope(dtype):
    """q [B, T, Hq, hd] and k [B, T, Hkv, hd] handed over as [B, H, T, hd] views, as the model hands them."""
    batch, seq, head_dim = 2, 7, 16
    inv_freq = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().float().to(KERNEL_DEVICE), angles.sin().float().to(KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(1)
    raw = {"q": randn(gen, batch, seq, 4, head_dim), "k": randn(gen, batch, seq, 2, head_dim)}

    def fast(q, k):
        q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    def reference(q, k):
        c, s = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    check(fast, reference, raw, {"q": dtype, "k": dtype}, ("q", "k"), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(2)
    raw = {"gate": randn(gen, 24, 40, scale=2.0), "up": randn(gen, 24, 40)}
    check(lambda gate, up: LigerSiLUMulFunction.apply(gate, up), lambda gate, up: F.silu(gate) * up, raw,
          {"gate": dtype, "up": dtype}, ("gate", "up"), dtype, multiplies_bf16=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_linear_cross_entropy(dtype):
    """Summed over the supervised targets; -100 targets count for nothing."""
    gen = torch.Generator().manual_seed(3)
    raw = {"hidden": randn(gen, 19, 16), "head": randn(gen, 300, 16, scale=0.4)}
    targets = torch.randint(0, 300, (19,), generator=gen)
    targets[::4] = IGNORE_INDEX
    targets = targets.to(KERNEL_DEVICE)

    def fast(hidden, head):
        out = LigerFusedLinearCrossEntropyFunction.apply(hidden, head, targets, None, None, IGNORE_INDEX, 0.0, 0.0,
                                                         "sum")
        return (out[0] if isinstance(out, tuple) else out).float()

    def reference(hidden, head):
        return F.cross_entropy(hidden @ head.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    check(fast, reference, raw, {"hidden": dtype, "head": dtype}, ("hidden", "head"), dtype)


@pytest.mark.slow  # a process of its own
def test_a_process_that_never_runs_liger_never_imports_it_even_under_the_interpreter():
    """Liger's modules import peft and transformers (3 s of CPU); a torchrun worker or a notebook's kernel that
    trains on PyTorch's path pays none of it, with TRITON_INTERPRET=1 (as every test process runs) too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", "import sys, cflib.train, cflib.model.fast; print(sorted(m for m in "
                           "sys.modules if m.split('.')[0] in ('liger_kernel', 'peft', 'transformers')))"],
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[:500] + done.stderr[-2000:]
