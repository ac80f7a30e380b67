"""Residual add + RMSNorm in one pass: s = h + delta (fp32), y = rmsnorm(s) * w in the compute dtype.

Pre-norm blocks add each sub-layer's output into an fp32 residual stream and
normalise it again right away. Done apart, that is an add kernel (read h and
delta, write s), a norm (read s, write an fp32 y) and autocast's cast of y to
BF16 for the next GEMM (read, write); its backward is as long again. One kernel
reads h and delta once and writes s and the BF16 y; one backward kernel
folds the residual's incoming gradient in. Liger's fused add+RMSNorm needs both
inputs in one dtype and writes y in it, which is what this avoids.

Backward needs the normalised s. It keeps s in the compute dtype (BF16 under
autocast), as every GEMM here keeps its BF16 input: the forward is exact in
fp32; only the norm's gradient sees the rounded s. Or, with
`normed_from_output`, it keeps nothing of its own: it reads the normed output
y = s * rstd * w, which the GEMM after the norm keeps anyway, and recovers
s * rstd as y / w (as Apex's memory-efficient norms do), rounded once as the
kept s is. The forward then writes 12 bytes an element instead of 14, and a
step keeps one [tokens, hidden] BF16 tensor less per norm. A column whose
weight is zero has lost s there; its gradients come out NaN (the trainer stops
on them), so the decoder takes this only for norms with no zero weight
(cflib.model.fast).

A stream already in the compute dtype (an fp32 run's, or a half-precision
embedding's) is the sum backward keeps; its gradient and the sub-layer's are then
one tensor, written once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cflib.ops.column_sums import column_sums
from cflib.ops.interpreter import INTERPRETING


@triton.jit
def _add_rms_norm_forward(h_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, saved_ptr, rstd_ptr, num_rows, dim, eps,
                          SAVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """SAVE: write s again in the saved dtype for backward; without it (a stream in the compute dtype) the stream
    is what backward reads, and the norm is taken of s as the stream holds it."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    offsets = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    s = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = s.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + offsets, s, mask=mask)
    s = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    y = s * rstd[:, None] * weight[None, :]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
    if SAVE:
        tl.store(saved_ptr + offsets, s.to(saved_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < num_rows)


# Rows per tile and warps for backward, tried on the device at first use per width (do_bench in triton.autotune).
# At the 200M shapes on the H200 the fixed choice before (4-row tiles, 8 warps) took 166 us per call; the tuned
# one (1 row, 4 warps) 111 us, near the memory's speed.
_BACKWARD_CONFIGS = [triton.Config({"BLOCK_R": 4}, num_warps=8)] if INTERPRETING else [
    triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8), (16, 16))]


@triton.autotune(_BACKWARD_CONFIGS, key=["dim", "HAS_GRAD_SUM", "ONE_GRADIENT", "FROM_OUTPUT"])
@triton.jit
def _add_rms_norm_backward(grad_out_ptr, grad_sum_ptr, saved_ptr, rstd_ptr, weight_ptr, grad_s_ptr, grad_delta_ptr,
                           grad_weight_ptr, num_rows, dim, rows_per_program, HAS_GRAD_SUM: tl.constexpr,
                           ONE_GRADIENT: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each program walks rows_per_program rows, accumulating its share of d(weight) in registers. ONE_GRADIENT:
    the stream and the sub-layer's output share a dtype, so their gradient is one tensor, written once.
    FROM_OUTPUT: saved holds the normed output y, and s * rstd is y / weight."""
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if FROM_OUTPUT:  # a zero weight gives 0 * inf = NaN: the norm lost s there (cflib.model.fast avoids it)
        inverse = 1.0 / tl.load(weight_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = tl.program_id(0) * rows_per_program
    for start in range(first, first + rows_per_program, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_mask = (rows < num_rows) & (rows < first + rows_per_program)
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * dim + cols[None, :]
        grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        normed = tl.load(saved_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if FROM_OUTPUT:
            normed = normed * inverse[None, :]
        else:
            normed = normed * rstd[:, None]
        grad_weight += tl.sum(grad_out * normed, axis=0)
        scaled = grad_out * weight[None, :]
        grad_s = rstd[:, None] * (scaled - normed * (tl.sum(scaled * normed, axis=1) / dim)[:, None])
        if HAS_GRAD_SUM:
            grad_s += tl.load(grad_sum_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_s_ptr + offsets, grad_s.to(grad_s_ptr.dtype.element_ty), mask=mask)
        if not ONE_GRADIENT:
            tl.store(grad_delta_ptr + offsets, grad_s.to(grad_delta_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_weight_ptr + tl.program_id(0) * dim + cols, grad_weight, mask=col_mask)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_tile(dim: int) -> tuple[int, int]:
    """Rows per program and warps of the forward kernel for rows of `dim` elements: about 4,096 elements a
    program (cflib.bench.tiles sweeps the alternatives)."""
    return max(1, 4096 // triton.next_power_of_2(dim)), 8


def add_rms_norm_forward(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: torch.dtype, tile: tuple[int, int] | None = None,
                         keep_sum: bool = True) -> tuple[torch.Tensor, ...]:
    """The forward kernel on contiguous [rows, dim] h and delta: the sum in h's dtype (the stream), the normed
    output, what backward reads (the stream itself when it is in out_dtype; else the sum in out_dtype, or without
    keep_sum the normed output) and each row's rstd."""
    num_rows, dim = h.shape
    total = torch.empty(num_rows, dim, dtype=h.dtype, device=h.device)
    out = torch.empty(num_rows, dim, dtype=out_dtype, device=h.device)
    if h.dtype == out_dtype:
        saved = total
    else:
        saved = torch.empty(num_rows, dim, dtype=out_dtype, device=h.device) if keep_sum else out
    rstd = torch.empty(num_rows, dtype=torch.float32, device=h.device)
    block_r, warps = tile or forward_tile(dim)
    _add_rms_norm_forward[(triton.cdiv(num_rows, block_r),)](
        h, delta, weight, total, out, saved, rstd, num_rows, dim, float(eps),
        SAVE=saved is not total and saved is not out,
        BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(dim), num_warps=warps)
    return total, out, saved, rstd


class AddRMSNorm(torch.autograd.Function):
    """(h, delta, weight) -> (s = h + delta, rmsnorm(s) * weight in out_dtype), h the residual stream.
    from_output: backward reads the normed output, not a kept sum (the module docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype, from_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dim = delta.shape, delta.shape[-1]
        stream, delta = h.reshape(-1, dim).contiguous(), delta.reshape(-1, dim).contiguous()
        total, out, saved, rstd = add_rms_norm_forward(stream, delta, weight, eps, out_dtype,
                                                       keep_sum=not from_output)
        ctx.from_output = saved is out
        ctx.save_for_backward(saved, rstd, weight)
        ctx.dtypes = (stream.dtype, delta.dtype)
        return total.view(shape), out.view(shape)

    @staticmethod
    def backward(ctx, grad_sum: torch.Tensor | None, grad_out: torch.Tensor):
        saved, rstd, weight = ctx.saved_tensors
        shape, dim = grad_out.shape, grad_out.shape[-1]
        grad_out = grad_out.reshape(-1, dim).contiguous()
        num_rows = grad_out.shape[0]
        if grad_sum is not None:  # None: s unused
            grad_sum = grad_sum.reshape(-1, dim).contiguous()
        grad_s = torch.empty(num_rows, dim, dtype=ctx.dtypes[0], device=grad_out.device)
        one_gradient = ctx.dtypes[0] == ctx.dtypes[1]
        grad_delta = grad_s if one_gradient else torch.empty(num_rows, dim, dtype=ctx.dtypes[1],
                                                             device=grad_out.device)
        # Enough programs to keep loads in flight on every SM; each sums its rows' d(weight) in registers.
        programs = 8 * _multiprocessors(grad_out.device) if grad_out.is_cuda else 4
        rows_per_program = triton.cdiv(num_rows, programs)
        partial = torch.empty(programs, dim, dtype=torch.float32, device=grad_out.device)
        _add_rms_norm_backward[(programs,)](
            grad_out, grad_sum if grad_sum is not None else grad_out, saved, rstd, weight, grad_s, grad_delta, partial,
            num_rows, dim, rows_per_program, HAS_GRAD_SUM=grad_sum is not None, ONE_GRADIENT=one_gradient,
            FROM_OUTPUT=ctx.from_output, BLOCK_D=triton.next_power_of_2(dim))
        return grad_s.view(shape), grad_delta.view(shape), column_sums(partial).to(weight.dtype), None, None, None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 normed_from_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(new residual in h's dtype, normed input of the next GEMM in the autocast dtype). normed_from_output:
    backward recovers the normalised sum from the output (needs no zero in `weight`; the module docstring)."""
    device_type = h.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    if delta is None:  # the first layer: nothing to add yet (one cheap zero tensor keeps a single kernel)
        delta = torch.zeros_like(h, dtype=out_dtype)
    return AddRMSNorm.apply(h, delta, weight, eps, out_dtype, normed_from_output)
