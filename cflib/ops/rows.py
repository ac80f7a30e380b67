"""Chosen rows of a token-major activation, and their gradient put back where they came from.

The SFT loss reads the final hidden states of the supervised positions alone, and everything after the last
layer's attention works row by row (the output projection, the residual add, the norms, the TR-MoE block),
so the last layer computes those rows only (cflib.model.decoder). `gather_rows` picks them; its backward
writes each picked row's gradient back at its position and zeros elsewhere. On a GPU that is one Triton
kernel of plain stores: PyTorch's index_add adds with atomics, and on the H200 took 192 us for the 200M
model's supervised rows of one micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cflib.ops import interpreter  # noqa: F401


@dataclass(frozen=True, eq=False)
class Rows:
    """Flat positions [R] (int64, into the [B * T] tokens) whose outputs are wanted, each once among the kept;
    keep [R] (float): 0.0 marks a padding entry (a CUDA graph's static count repeats a position), which takes
    no gradient; None: every entry is kept."""

    indices: torch.Tensor
    keep: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.indices.dim() != 1:
            raise ValueError(f"Rows.indices must be 1-D, got shape {tuple(self.indices.shape)}")
        if self.keep is not None and self.keep.shape != self.indices.shape:
            raise ValueError(f"Rows.keep has shape {tuple(self.keep.shape)}, indices {tuple(self.indices.shape)}")


@triton.jit
def _scatter_rows(grad_ptr, indices_ptr, keep_ptr, out_ptr, num_picked, dim, HAS_KEEP: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    picked = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = picked < num_picked
    position = tl.load(indices_ptr + picked, mask=valid, other=0).to(tl.int64)
    if HAS_KEEP:
        valid = valid & (tl.load(keep_ptr + picked, mask=valid, other=0.0) != 0.0)
    source = grad_ptr + picked.to(tl.int64)[:, None] * dim
    destination = out_ptr + position[:, None] * dim
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (cols < dim)[None, :]
        tl.store(destination + cols[None, :], tl.load(source + cols[None, :], mask=mask), mask=mask)


def scatter_rows(grad: torch.Tensor, rows: Rows, num_rows: int) -> torch.Tensor:
    """[num_rows, D]: grad's row i at rows.indices[i] for every kept i, zeros elsewhere (the Triton kernel)."""
    out = torch.zeros(num_rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
    picked = grad.shape[0]
    if picked:
        block_d = min(1024, triton.next_power_of_2(grad.shape[1]))
        block_r = max(1, 4096 // block_d)
        _scatter_rows[(triton.cdiv(picked, block_r),)](
            grad.contiguous(), rows.indices, rows.keep if rows.keep is not None else grad, out, picked,
            grad.shape[1], HAS_KEEP=rows.keep is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out


def scatter_rows_reference(grad: torch.Tensor, rows: Rows, num_rows: int) -> torch.Tensor:
    """scatter_rows in PyTorch: an add at every kept position."""
    kept = grad if rows.keep is None else grad * rows.keep[:, None].to(grad.dtype)
    return torch.zeros(num_rows, grad.shape[1], dtype=grad.dtype, device=grad.device).index_add_(
        0, rows.indices, kept)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        ctx.rows, ctx.num_rows = rows, x.shape[0]
        return x.index_select(0, rows.indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter = scatter_rows if grad.is_cuda else scatter_rows_reference
        out = scatter(grad.reshape(grad.shape[0], -1), ctx.rows, ctx.num_rows)
        return out.view(ctx.num_rows, *grad.shape[1:]), None


def gather_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """x [B, T, ...] (token-major) seen as N = B x T rows -> its rows at rows.indices, [R, ...]."""
    return _GatherRows.apply(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), rows)
