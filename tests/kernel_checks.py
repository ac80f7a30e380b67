"""Checking one op against its PyTorch reference: a float64 truth, per-dtype tolerances, forward and backward.

A plain helper module for tests/ops (which import neither cflib.bench nor
cflib.train): the tolerances and error measure are those of
docs/formats.md#numerical-tolerances, which validate_kernels applies too
(tests/bench/test_validate.py keeps the two equal).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from cflib.ops.interpreter import bf16_arithmetic_broken

TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPES = list(TOLERANCES)
DTYPE_IDS = ["fp32", "bf16"]


def norm_rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    """||got - truth|| / ||truth|| in float64; NaN when got is not finite, so it never passes."""
    got, truth = got.detach().double(), truth.detach().double()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    scale = torch.linalg.vector_norm(truth).item() or 1.0
    return torch.linalg.vector_norm(got - truth).item() / scale


def failures(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """Each tensor of `truth` that `got` misses, or matches worse than the dtype's tolerance."""
    tolerance, found = TOLERANCES[dtype], []
    for name, want in truth.items():
        if name not in got:
            found.append(f"{name}: missing")
            continue
        error = norm_rel(got[name], want)
        if not error <= tolerance:  # NaN fails here too
            found.append(f"{name}: error {error:.2e} > {tolerance:.0e}")
    return found


def assert_matches(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    problems = failures(got, truth, dtype)
    assert not problems, f"{dtype}: " + "; ".join(problems)


def run(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], leaves: dict[str, torch.Tensor],
        grad_seed: int, autocast_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Outputs (out0, out1, ...) of fn(**leaves) and the gradient d_<name> of every leaf that requires one,
    for random output gradients drawn from `grad_seed` (the same for the op and its truth)."""
    device = next(iter(leaves.values())).device
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    with autocast:
        outputs = fn(**leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator().manual_seed(grad_seed)
    grads = [torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype) for out in outputs]
    torch.autograd.backward(list(outputs), grads)
    found = {f"out{i}": out.detach() for i, out in enumerate(outputs)}
    found.update({f"d_{name}": leaf.grad for name, leaf in leaves.items() if leaf.requires_grad})
    return found


def leaves(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], device: torch.device,
           grad: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Fresh leaf copies of `tensors` in the given dtypes (float64 for the truth), on `device`."""
    found = {}
    for name, value in tensors.items():
        copy = value.detach().to(device=device, dtype=dtypes.get(name, value.dtype)).clone()
        found[name] = copy.requires_grad_(name in grad)
    return found


def skip_reason(dtype: torch.dtype, multiplies_bf16: bool, device: torch.device) -> str | None:
    """Why this machine cannot check an op in `dtype`: Triton's interpreter multiplies bf16 values as raw
    bits (triton 3.9), which only kernels that multiply bf16 operands (not fp32 values stored as bf16) see."""
    if dtype == torch.bfloat16 and multiplies_bf16 and device.type == "cpu" and bf16_arithmetic_broken():
        return "Triton's interpreter multiplies bfloat16 values as raw bits; checked on the GPU"
    return None
