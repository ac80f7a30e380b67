"""The sum over rows of a [P, C] FP32 tensor: the per-program partials of a norm weight's gradient.

The norm kernels' backward programs each sum their rows' share of d(weight) in registers and write one partial
row, so a step ends with P partials to add per norm (P about 1,000 to 8,000, C the weight's width). PyTorch's
`partial.sum(0)` spends about 12 us on that at the 200M shapes on the H200: a reduction down the columns of a
tall, narrow tensor keeps few loads in flight. Here one launch sums groups of rows on many programs and a
second adds the groups, in a fixed order (the same bits every run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cflib.ops import interpreter  # noqa: F401

ROWS_PER_GROUP = 64


@triton.jit
def _column_sums(in_ptr, out_ptr, num_rows, num_cols, rows_per_program, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Program (g, c) writes the sum of rows [g * rows_per_program, (g + 1) * rows_per_program) of column block c
    to row g of out."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_cols
    first = tl.program_id(0) * rows_per_program
    total = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(first, first + rows_per_program, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = ((rows < num_rows) & (rows < first + rows_per_program))[:, None] & col_mask[None, :]
        total += tl.load(in_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + tl.program_id(0) * num_cols + cols, tl.sum(total, axis=0), mask=col_mask)


def _sum_groups(partial: torch.Tensor, rows_per_program: int) -> torch.Tensor:
    num_rows, num_cols = partial.shape
    groups = triton.cdiv(num_rows, rows_per_program)
    out = torch.empty(groups, num_cols, dtype=torch.float32, device=partial.device)
    block_c = min(128, triton.next_power_of_2(num_cols))
    _column_sums[(groups, triton.cdiv(num_cols, block_c))](
        partial, out, num_rows, num_cols, rows_per_program, BLOCK_R=16, BLOCK_C=block_c, num_warps=4)
    return out


def column_sums(partial: torch.Tensor) -> torch.Tensor:
    """[P, C] FP32, contiguous -> [C]: the sum of its rows."""
    if partial.dim() != 2 or partial.dtype != torch.float32 or not partial.is_contiguous():
        raise ValueError(f"column_sums takes a contiguous 2-D FP32 tensor, got {partial.dtype} "
                         f"{tuple(partial.shape)}")
    groups = _sum_groups(partial, ROWS_PER_GROUP) if partial.shape[0] > ROWS_PER_GROUP else partial
    return _sum_groups(groups, groups.shape[0])[0]
