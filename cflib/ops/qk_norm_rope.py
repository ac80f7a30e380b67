"""QK-norm and RoPE on the fused QKV projection's output, in one kernel each way.

After the QKV GEMM every query and key head is RMS-normalised with its own
weight (QK-norm) and rotated (RoPE, rotate-half). Done apart that is four
launches forward (two norms, RoPE, plus the copies that make q and k
contiguous) and as many backward, each re-reading the heads, and on the
host the launch overhead of each: at 200M shapes the forward pass was bound by
the host. One program here takes a block of (token, head) rows straight from
the QKV output, normalises and rotates the query and key heads in fp32 and
writes q, k and v in the layout attention reads (v as it is: no separate copy
runs for it, forward or backward).

The function takes the whole QKV output and hands back v too, so backward
writes one gradient for it: q, k and v taken as three slices of it would each
send back a zero-filled QKV-sized gradient to be summed (at 200M that was
3 ms of every 107 ms step on the H200).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cflib.ops.column_sums import column_sums
from cflib.ops.interpreter import INTERPRETING

# Programs each take rows of one kind both ways (query rows, or key rows with the value rows beside), so each load
# is a block of one kind; more programs keep more loads in flight than fewer walking several blocks each. Tiles
# measured on the H200 at the 200M shapes (16 x 2,048 tokens, 14 + 2 + 2 heads of 64; a sweep of rows per block,
# blocks per backward program and warps, backward with the partials' sum); `python benchmarks/tiles.py` sweeps them.
# Triton's interpreter pays per program, not per element: its forward takes 16 times the rows a program.
FORWARD_TILE = (256, 2) if INTERPRETING else (16, 2)  # rows per program, warps
BACKWARD_TILE = (64, 1, 2)  # rows per block, blocks per program, warps
# Backward may read the rotated q and k instead of a kept qkv where each pair of columns the rotation mixes has
# weights within this factor of each other: with BF16 heads and pairs 8x apart, the input's gradient measured
# 1.06x the error of the kept qkv's against float64 (tests/ops/test_qk_norm_rope.py, docs/kernels.md).
QK_PAIR_RATIO = 8.0


@triton.jit
def _rows_of_kind(block, num_rows, heads, first_head, positions_ptr, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """One block of the (token, head) rows of one kind (query heads, or key heads from first_head on): each row's
    index among its kind's rows, its token and head in qkv, the mask, and its rotation's cos and sin halves."""
    cols = tl.arange(0, HEAD_DIM // 2)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    token, head = rows // heads, rows % heads + first_head
    position = tl.load(positions_ptr + token, mask=row_mask, other=0)
    cos = tl.load(cos_ptr + position[:, None] * HEAD_DIM + cols[None, :], mask=row_mask[:, None], other=0.0)
    sin = tl.load(sin_ptr + position[:, None] * HEAD_DIM + cols[None, :], mask=row_mask[:, None], other=0.0)
    return rows, token, head, row_mask, cos, sin


@triton.jit
def _value_rows(block, qkv_row_stride, tokens, q_heads, kv_heads, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """One block of value rows: their offsets in v's [tokens, kv_heads, hd] layout and in qkv's rows (of
    qkv_row_stride), and the mask; v and its gradient are copied between the two as they are."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    token, head = rows // kv_heads, rows % kv_heads + q_heads + kv_heads
    cols = tl.arange(0, HEAD_DIM)[None, :]
    packed = rows.to(tl.int64)[:, None] * HEAD_DIM + cols
    in_qkv = token.to(tl.int64)[:, None] * qkv_row_stride + head[:, None] * HEAD_DIM + cols
    return packed, in_qkv, (rows < tokens * kv_heads)[:, None]


@triton.jit
def _norm_rope_rows_forward(block, qkv_ptr, qkv_row_stride, weight_ptr, cos_ptr, sin_ptr, positions_ptr, out_ptr,
                            rstd_ptr, num_rows, heads, first_head, normed_heads, eps, HEAD_DIM: tl.constexpr,
                            BLOCK_R: tl.constexpr):
    """One block of the (token, head) rows of one kind (query heads, or key heads from first_head on): normed
    and rotated into out [tokens, heads, hd], each row's rstd at its (token, head) among the normed heads."""
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    rows, token, head, row_mask, cos, sin = _rows_of_kind(block, num_rows, heads, first_head, positions_ptr, cos_ptr,
                                                          sin_ptr, HEAD_DIM, BLOCK_R)
    mask = row_mask[:, None]
    src = qkv_ptr + token.to(tl.int64)[:, None] * qkv_row_stride + head[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
    tl.store(rstd_ptr + token.to(tl.int64) * normed_heads + head, rstd, mask=row_mask)
    n1 = x1 * rstd[:, None] * tl.load(weight_ptr + cols)[None, :]
    n2 = x2 * rstd[:, None] * tl.load(weight_ptr + half + cols)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :]
    # rotate-half: cos and sin repeat across the halves
    tl.store(dst, (n1 * cos - n2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (n2 * cos + n1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_forward(qkv_ptr, qkv_row_stride, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                          q_ptr, k_ptr, v_ptr, rstd_ptr, tokens, q_heads, kv_heads, q_programs, eps,
                          HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """The first q_programs programs take query rows, the rest key rows and the value rows beside them (v
    copied as it is, exact in its own dtype): each program one kind, so every load is a block of one kind."""
    normed_heads = q_heads + kv_heads  # each token's rstd: one per query and key head
    program = tl.program_id(0)
    if program < q_programs:
        _norm_rope_rows_forward(program, qkv_ptr, qkv_row_stride, q_weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                                q_ptr, rstd_ptr, tokens * q_heads, q_heads, 0, normed_heads, eps, HEAD_DIM, BLOCK_R)
    else:
        block = program - q_programs
        _norm_rope_rows_forward(block, qkv_ptr, qkv_row_stride, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                                k_ptr, rstd_ptr, tokens * kv_heads, kv_heads, q_heads, normed_heads, eps, HEAD_DIM,
                                BLOCK_R)
        packed, in_qkv, mask = _value_rows(block, qkv_row_stride, tokens, q_heads, kv_heads, HEAD_DIM, BLOCK_R)
        tl.store(v_ptr + packed, tl.load(qkv_ptr + in_qkv, mask=mask, other=0.0), mask=mask)


@triton.jit
def _norm_rope_rows_backward(block, grad_ptr, saved_ptr, qkv_row_stride, weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                             rstd_ptr, grad_x_ptr, grad_x_row_stride, num_rows, heads, first_head, normed_heads,
                             HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, FROM_OUTPUT: tl.constexpr):
    """One block of the (token, head) rows of one kind (query heads, or key heads from first_head on): their
    gradient through RoPE and the norm, written into qkv's gradient; returns the block's d(weight) halves.
    saved_ptr: the QKV output, or with FROM_OUTPUT this kind's rotated output [tokens, heads, hd]."""
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    rows, token, head, row_mask, cos, sin = _rows_of_kind(block, num_rows, heads, first_head, positions_ptr, cos_ptr,
                                                          sin_ptr, HEAD_DIM, BLOCK_R)
    mask = row_mask[:, None]
    src = grad_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :]
    g1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    d1, d2 = g1 * cos + g2 * sin, g2 * cos - g1 * sin  # the rotation's transpose
    rstd = tl.load(rstd_ptr + token.to(tl.int64) * normed_heads + head, mask=row_mask, other=0.0)
    w1, w2 = tl.load(weight_ptr + cols)[None, :], tl.load(weight_ptr + half + cols)[None, :]
    if FROM_OUTPUT:  # undo the rotation, then the weight: x * rstd
        y = saved_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :]
        y1 = tl.load(y, mask=mask, other=0.0).to(tl.float32)
        y2 = tl.load(y + half, mask=mask, other=0.0).to(tl.float32)
        xhat1, xhat2 = (y1 * cos + y2 * sin) / w1, (y2 * cos - y1 * sin) / w2
    else:
        x = saved_ptr + token.to(tl.int64)[:, None] * qkv_row_stride + head[:, None] * HEAD_DIM + cols[None, :]
        xhat1 = tl.load(x, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        xhat2 = tl.load(x + half, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    s1, s2 = d1 * w1, d2 * w2
    mean = (tl.sum(s1 * xhat1, axis=1) + tl.sum(s2 * xhat2, axis=1)) / HEAD_DIM
    dst = grad_x_ptr + token.to(tl.int64)[:, None] * grad_x_row_stride + head[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dst, (rstd[:, None] * (s1 - xhat1 * mean[:, None])).to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (rstd[:, None] * (s2 - xhat2 * mean[:, None])).to(grad_x_ptr.dtype.element_ty), mask=mask)
    return tl.sum(d1 * xhat1, axis=0), tl.sum(d2 * xhat2, axis=0)  # masked rows load zeros: they add nothing


@triton.jit
def _qk_norm_rope_backward(grad_q_ptr, grad_k_ptr, grad_v_ptr, q_saved_ptr, k_saved_ptr, qkv_row_stride, q_weight_ptr,
                           k_weight_ptr, cos_ptr, sin_ptr, positions_ptr, rstd_ptr, grad_x_ptr, grad_x_row_stride,
                           grad_w_ptr, tokens, q_heads, kv_heads, q_programs, HEAD_DIM: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, FROM_OUTPUT: tl.constexpr):
    """The first q_programs programs take query rows, the rest key rows and the value rows beside them (v's
    gradient as it came): each program one kind, so every load is a whole block of one gradient. Each writes
    its d(weight) to its own row of [program, {q, k}, HEAD_DIM], zeros on the other kind's half. The saved
    pointers: the QKV output twice, or with FROM_OUTPUT the rotated q and k."""
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    normed_heads = q_heads + kv_heads  # each token's rstd: one per query and key head
    dw1, dw2 = tl.zeros([half], dtype=tl.float32), tl.zeros([half], dtype=tl.float32)
    program = tl.program_id(0)
    if program < q_programs:
        for i in range(BLOCKS):
            part1, part2 = _norm_rope_rows_backward(
                program * BLOCKS + i, grad_q_ptr, q_saved_ptr, qkv_row_stride, q_weight_ptr, cos_ptr, sin_ptr,
                positions_ptr, rstd_ptr, grad_x_ptr, grad_x_row_stride, tokens * q_heads, q_heads, 0, normed_heads,
                HEAD_DIM, BLOCK_R, FROM_OUTPUT)
            dw1, dw2 = dw1 + part1, dw2 + part2
        own = grad_w_ptr + program * 2 * HEAD_DIM
        other = own + HEAD_DIM
    else:
        for i in range(BLOCKS):
            block = (program - q_programs) * BLOCKS + i
            part1, part2 = _norm_rope_rows_backward(
                block, grad_k_ptr, k_saved_ptr, qkv_row_stride, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                rstd_ptr, grad_x_ptr, grad_x_row_stride, tokens * kv_heads, kv_heads, q_heads, normed_heads,
                HEAD_DIM, BLOCK_R, FROM_OUTPUT)
            dw1, dw2 = dw1 + part1, dw2 + part2
            packed, in_qkv, mask = _value_rows(block, grad_x_row_stride, tokens, q_heads, kv_heads, HEAD_DIM,
                                               BLOCK_R)
            tl.store(grad_x_ptr + in_qkv, tl.load(grad_v_ptr + packed, mask=mask, other=0.0), mask=mask)
        own = grad_w_ptr + program * 2 * HEAD_DIM + HEAD_DIM
        other = grad_w_ptr + program * 2 * HEAD_DIM
    tl.store(own + cols, dw1)
    tl.store(own + half + cols, dw2)
    tl.store(other + cols, tl.zeros([half], dtype=tl.float32))
    tl.store(other + half + cols, tl.zeros([half], dtype=tl.float32))


def qk_norm_rope_forward(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int, eps: float,
                         tile: tuple[int, int] = FORWARD_TILE) -> tuple[torch.Tensor, ...]:
    """The forward kernel on a contiguous qkv [N, (Hq + 2 Hkv) * hd]: q, k, v and the rstd of each query and key
    head of each token, [N * (Hq + Hkv)]."""
    head_dim, tokens = q_weight.shape[0], qkv.shape[0]
    q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k, v = (torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device) for _ in range(2))
    rstd = torch.empty(tokens * (q_heads + kv_heads), dtype=torch.float32, device=qkv.device)
    block_rows, warps = tile
    q_programs = triton.cdiv(tokens * q_heads, block_rows)
    programs = q_programs + triton.cdiv(tokens * kv_heads, block_rows)
    _qk_norm_rope_forward[(programs,)](
        qkv, qkv.stride(0), q_weight, k_weight, cos, sin, positions, q, k, v, rstd, tokens, q_heads, kv_heads,
        q_programs, float(eps), HEAD_DIM=head_dim, BLOCK_R=block_rows, num_warps=warps)
    return q, k, v, rstd


def qk_norm_rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
                          saved: torch.Tensor | tuple[torch.Tensor, torch.Tensor], q_weight: torch.Tensor,
                          k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          rstd: torch.Tensor, q_heads: int, kv_heads: int,
                          tile: tuple[int, int, int] = BACKWARD_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel: qkv's gradient and the FP32 [2, hd] gradients of the q and k norm weights. saved: the
    contiguous QKV output the forward read, or the forward's q and k, from which the kernel recovers each
    head's x * rstd (the rotation undone, divided by the weight: no weight may be zero)."""
    from_output = isinstance(saved, tuple)
    q_saved, k_saved = saved if from_output else (saved, saved)
    head_dim, tokens = q_weight.shape[0], grad_q.shape[0]
    block_rows, blocks, warps = tile
    q_programs = triton.cdiv(tokens * q_heads, block_rows * blocks)
    programs = q_programs + triton.cdiv(tokens * kv_heads, block_rows * blocks)
    grad_qkv = torch.empty(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=grad_q.dtype, device=grad_q.device)
    partial = torch.empty(programs, 2, head_dim, dtype=torch.float32, device=grad_q.device)
    _qk_norm_rope_backward[(programs,)](
        grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous(), q_saved, k_saved, q_saved.stride(0),
        q_weight, k_weight, cos, sin, positions, rstd, grad_qkv, grad_qkv.stride(0), partial, tokens, q_heads,
        kv_heads, q_programs, HEAD_DIM=head_dim, BLOCK_R=block_rows, BLOCKS=blocks, FROM_OUTPUT=from_output,
        num_warps=warps)
    return grad_qkv, column_sums(partial.view(programs, 2 * head_dim)).view(2, head_dim)


class QKVNormRope(torch.autograd.Function):
    """qkv [N, (Hq + 2 Hkv) * hd] -> q [N, Hq, hd], k [N, Hkv, hd] normed and rotated, v [N, Hkv, hd] as it is.

    normed_from_output: backward reads q and k, which attention keeps anyway, instead of keeping qkv (at 200M,
    2 x 1,152 bytes a token a layer freed after forward). Their BF16 rounding then reaches the gradients
    through the rotation, which mixes each head's columns j and j + hd/2: an error of one part in 2^9 of the
    pair's size, divided by the weight of the smaller. cflib.model.fast takes it only where every such pair
    of weights is within QK_PAIR_RATIO of each other."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int, eps: float,
                normed_from_output: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = qkv.contiguous()
        q, k, v, rstd = qk_norm_rope_forward(qkv, q_weight, k_weight, cos, sin, positions, q_heads, kv_heads, eps)
        saved = (q, k) if normed_from_output else (qkv,)
        ctx.save_for_backward(*saved, q_weight, k_weight, cos, sin, positions, rstd)
        ctx.heads = (q_heads, kv_heads)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        *saved, q_weight, k_weight, cos, sin, positions, rstd = ctx.saved_tensors
        grad_qkv, grad_w = qk_norm_rope_backward(grad_q, grad_k, grad_v, tuple(saved) if len(saved) == 2 else saved[0],
                                                 q_weight, k_weight, cos, sin, positions, rstd, *ctx.heads)
        return (grad_qkv, grad_w[0].to(q_weight.dtype), grad_w[1].to(k_weight.dtype)) + (None,) * 7


def normed_from_output_fits(weight: torch.Tensor) -> bool:
    """Whether backward may recover a head norm's normed heads from its rotated output: no weight zero, and the
    weights of each pair (j, j + hd/2) within QK_PAIR_RATIO of each other. One host read."""
    if weight.is_meta:
        return False
    first, second = weight.detach().float().abs().chunk(2)
    smaller, larger = torch.minimum(first, second), torch.maximum(first, second)
    return bool(((smaller > 0) & (smaller * QK_PAIR_RATIO >= larger)).all())


@functools.lru_cache(maxsize=8)
def _positions(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    # Made outside inference mode even under it: cached, it is saved for backward by later training steps.
    with torch.inference_mode(False):
        return torch.arange(seq, device=device, dtype=torch.int32).repeat(batch)


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, batch: int, seq: int, q_heads: int, kv_heads: int, eps: float,
                  normed_from_output: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, hd], k and v [B, T, Hkv, hd] from qkv [B*T, (Hq + 2 Hkv) * hd]; normed_from_output: see
    QKVNormRope.

    cos/sin [T, hd]: positions 0..T-1 in every row; [B, T, hd] (packed windows, positions restarting
    per example): each token reads its own row of the flattened tables.
    """
    if cos.dim() == 3:
        cos, sin, positions = cos.reshape(batch * seq, -1), sin.reshape(batch * seq, -1), _positions(1, batch * seq,
                                                                                                       qkv.device)
    else:
        positions = _positions(batch, seq, qkv.device)
    q, k, v = QKVNormRope.apply(qkv, q_weight, k_weight, cos.contiguous(), sin.contiguous(), positions, q_heads,
                                kv_heads, eps, normed_from_output)
    return q.view(batch, seq, q_heads, -1), k.view(batch, seq, kv_heads, -1), v.view(batch, seq, kv_heads, -1)
