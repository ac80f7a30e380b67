"""GEMMs the fast paths share: weight gradients written in FP32, and the SwiGLU GEMMs with quack's epilogues.

`gated_gemm` is x @ W.T for a gate|up weight whose rows interleave gate and up (row 2j gate column j, row 2j + 1
its up column) with SwiGLU applied in the GEMM's epilogue: it writes the pre-activation (for backward) and
silu(gate) * up, so no kernel reads the [N, 2C] pre-activation back forward. `dgated_gemm` is its backward
partner: grad_hidden = grad_out @ down computed in the GEMM and turned, in its epilogue, into the
pre-activation's gradient (interleaved the same way) and the activation recomputed. On CUDA both are
quack-kernels' (quack.gemm_interface.gemm_gated / gemm_dgated, Hopper); elsewhere the same functions in
PyTorch. The tests check both through the block that uses them against its float64 formula.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch 2.8+: mm(..., out_dtype=)

# quack GemmConfig fields pinned for the SwiGLU GEMMs on Hopper (None: quack's default config), from a sweep at
# the 200M block's shapes (docs/kernels.md); quack's own autotuner would compile its whole space in the first step.
GATED_TILE: dict | None = None
DGATED_TILE: dict | None = dict(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=2)


def _pinned(tile: dict | None, device: torch.device):
    if tile is None or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    from quack.gemm_config import GemmConfig
    return GemmConfig(**tile, is_dynamic_persistent=False, device_capacity=9)


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
        return gemm_gated(x, gate_up.t(), activation="swiglu", tuned=False, config=_pinned(GATED_TILE, x.device))
    preact = F.linear(x, gate_up)
    gate, up = preact.float().unflatten(1, (-1, 2)).unbind(2)
    return preact, (F.silu(gate) * up).to(x.dtype)


def dgated_gemm(grad_out: torch.Tensor, down: torch.Tensor, preact: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_out [N, D], the down weight [D, C] and gated_gemm's pre-activation [N, 2C] -> (the pre-activation's
    gradient [N, 2C], interleaved as it is, and silu(gate) * up [N, C] recomputed). The gradient is written over
    `preact` (each output tile overwrites the input tile it was computed from), which saves the block's widest
    buffer in backward; `preact`'s version is bumped, so autograd refuses a second backward through it."""
    if grad_out.is_cuda:
        from quack.gemm_interface import gemm_dgated
        _, hidden = gemm_dgated(grad_out, down, preact, activation="swiglu", dx_out=preact, tuned=False,
                                config=_pinned(DGATED_TILE, grad_out.device))
        torch.autograd.graph.increment_version(preact)
        return preact, hidden
    grad_hidden = (grad_out @ down).float()
    gate, up = preact.float().unflatten(1, (-1, 2)).unbind(2)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_gate = grad_hidden * up * sig * (1.0 + gate * (1.0 - sig))
    hidden = (silu * up).to(preact.dtype)
    preact.copy_(torch.stack([grad_gate, grad_hidden * silu], dim=2).flatten(1))
    return preact, hidden
