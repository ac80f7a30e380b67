"""The comparison the op tests rely on (tests/kernel_checks.py) can fail: a wrong kernel, a NaN, a missing tensor."""
from __future__ import annotations

import torch
from kernel_checks import TOLERANCES, failures, norm_rel


def test_one_percent_off_fails_fp32_and_passes_bf16():
    truth = {"out": torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)}
    off = {"out": truth["out"] * 1.01}
    assert norm_rel(off["out"], truth["out"]) > TOLERANCES[torch.float32]
    assert failures(off, truth, torch.float32) and not failures(off, truth, torch.bfloat16)


def test_a_nan_or_a_missing_tensor_never_passes():
    truth = {"out": torch.ones(4, dtype=torch.float64), "d_x": torch.ones(4, dtype=torch.float64)}
    got = {"out": torch.tensor([1.0, 1.0, float("nan"), 1.0])}
    assert failures(got, truth, torch.bfloat16) == ["out: error nan > 2e-02", "d_x: missing"]


def test_tolerances_are_those_of_the_formats_page():
    """docs/formats.md#numerical-tolerances: fp32 1e-4, bf16 operands 2e-2."""
    assert TOLERANCES == {torch.float32: 1e-4, torch.bfloat16: 2e-2}
