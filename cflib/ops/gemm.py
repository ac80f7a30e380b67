"""GEMMs the fast paths share: weight gradients written in FP32, and the SwiGLU GEMM with quack's epilogue.

`gated_gemm` is x @ W.T for a gate|up weight whose rows interleave gate and up (row 2j gate column j, row 2j + 1
its up column) with SwiGLU applied in the GEMM's epilogue: it writes the pre-activation (for backward) and
silu(gate) * up, so no kernel reads the [N, 2C] pre-activation back forward. On CUDA it is quack-kernels'
(quack.gemm_interface.gemm_gated, Hopper); elsewhere the same function in PyTorch. The tests check it through
the block that uses it against its float64 formula.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch 2.8+: mm(..., out_dtype=)


def weight_gradient(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_out [N, out] and x [N, in] -> the FP32 weight gradient [out, in]. On CUDA the GEMM writes FP32 from
    its FP32 accumulator; elsewhere (no such GEMM) it is the half-precision product cast, as autocast's."""
    if grad_out.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(grad_out.t(), x, out_dtype=torch.float32)
    return (grad_out.t() @ x).float()


def master_gradients(full: Callable[[], torch.Tensor], regions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                     needed: Sequence[bool]) -> list[torch.Tensor | None]:
    """Each master's gradient, its region of the FP32 weight gradient `full()` (computed only if one is needed):
    a slice of rows as it is, contiguous; any other view copied out."""
    if not any(needed):
        return [None] * len(regions)
    whole = full()
    return [region(whole).contiguous() if need else None for region, need in zip(regions, needed)]


def gated_gemm(x: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] and an interleaved gate|up weight [2C, D] (one 16-bit dtype) -> (pre-activation [N, 2C],
    silu(gate) * up [N, C]); on CUDA the activation comes from the FP32 accumulator, rounded once."""
    if x.is_cuda:
        from quack.gemm_interface import gemm_gated
        return gemm_gated(x, gate_up.t(), activation="swiglu", tuned=False)
    preact = F.linear(x, gate_up)
    gate, up = preact.float().unflatten(1, (-1, 2)).unbind(2)
    return preact, (F.silu(gate) * up).to(x.dtype)
