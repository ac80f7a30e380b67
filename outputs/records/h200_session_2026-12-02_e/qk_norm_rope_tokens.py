"""The candidate layout of the QK-norm + RoPE kernels that qk_norm_rope_ab.py measured against cflib's (and
that lost both ways): each program takes a block of tokens and every head of each, reads a token's cos and
sin once for all its heads, and reads and writes each head as one contiguous 64-column row, its rotate-half
partner columns re-read from L1. rstd is [tokens, Hq + Hkv]. Only the kernels and their launchers are kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cflib.ops import interpreter  # noqa: F401

# The tiles the A/B ran (not swept).
FORWARD_TILE = (4, 4)  # tokens per program, warps
BACKWARD_TILE = (2, 4, 4)  # tokens per block, blocks per program, warps


@triton.jit
def _head_columns(HEAD_DIM: tl.constexpr):
    """[1, 1, hd] column offsets, their rotate-half partners' and the sign each partner enters with."""
    cols = tl.arange(0, HEAD_DIM)[None, None, :]
    return cols, (cols + HEAD_DIM // 2) % HEAD_DIM, tl.where(cols < HEAD_DIM // 2, -1.0, 1.0)


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, positions_ptr, token, token_mask, cols, HEAD_DIM: tl.constexpr):
    """cos and sin [T, 1, hd] of each token's position, shared by all its heads."""
    position = tl.load(positions_ptr + token, mask=token_mask, other=0)
    table = position[:, None, None] * HEAD_DIM + cols
    mask = token_mask[:, None, None]
    return tl.load(cos_ptr + table, mask=mask, other=0.0), tl.load(sin_ptr + table, mask=mask, other=0.0)


@triton.jit
def _norm_rotate(src, mask, weight_ptr, cols, partner, sign, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """Heads [T, H, hd] at src normalised (their rstd [T, H]) and rotated; each partner column is re-read (from
    L1) rather than shuffled across threads."""
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=2) / HEAD_DIM + eps)
    n = x * rstd[:, :, None] * tl.load(weight_ptr + cols)
    n_partner = x_partner * rstd[:, :, None] * tl.load(weight_ptr + partner)
    return n * cos + sign * n_partner * sin, rstd  # rotate-half: cos and sin repeat across the halves


@triton.jit
def _qk_norm_rope_forward(qkv_ptr, qkv_row_stride, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr,
                          q_ptr, k_ptr, v_ptr, rstd_ptr, num_tokens, eps, Q_HEADS: tl.constexpr,
                          KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_T: tl.constexpr):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = token < num_tokens
    cols, partner, sign = _head_columns(HEAD_DIM)
    cos, sin = _rope_tables(cos_ptr, sin_ptr, positions_ptr, token, token_mask, cols, HEAD_DIM)
    token64 = token.to(tl.int64)
    row = qkv_ptr + token64[:, None, None] * qkv_row_stride
    q_heads, kv_heads = tl.arange(0, Q_PAD)[None, :], tl.arange(0, KV_PAD)[None, :]
    q_mask = token_mask[:, None] & (q_heads < Q_HEADS)
    kv_mask = token_mask[:, None] & (kv_heads < KV_HEADS)
    rstd_row = rstd_ptr + token64[:, None] * (Q_HEADS + KV_HEADS)
    y, rstd = _norm_rotate(row + q_heads[:, :, None] * HEAD_DIM, q_mask[:, :, None], q_weight_ptr, cols, partner,
                           sign, cos, sin, eps, HEAD_DIM)
    tl.store(q_ptr + (token64[:, None, None] * Q_HEADS + q_heads[:, :, None]) * HEAD_DIM + cols,
             y.to(q_ptr.dtype.element_ty), mask=q_mask[:, :, None])
    tl.store(rstd_row + q_heads, rstd, mask=q_mask)
    y, rstd = _norm_rotate(row + (Q_HEADS + kv_heads[:, :, None]) * HEAD_DIM, kv_mask[:, :, None], k_weight_ptr,
                           cols, partner, sign, cos, sin, eps, HEAD_DIM)
    kv_dst = (token64[:, None, None] * KV_HEADS + kv_heads[:, :, None]) * HEAD_DIM + cols
    tl.store(k_ptr + kv_dst, y.to(k_ptr.dtype.element_ty), mask=kv_mask[:, :, None])
    tl.store(rstd_row + Q_HEADS + kv_heads, rstd, mask=kv_mask)
    v = tl.load(row + (Q_HEADS + KV_HEADS + kv_heads[:, :, None]) * HEAD_DIM + cols, mask=kv_mask[:, :, None])
    tl.store(v_ptr + kv_dst, v, mask=kv_mask[:, :, None])  # v as it is: exact in its own dtype


@triton.jit
def _norm_rotate_backward(grad_src, x_src, rstd, mask, weight_ptr, cols, partner, sign, cos, sin,
                          HEAD_DIM: tl.constexpr):
    """The gradient [T, H, hd] of heads at x_src from that of their normed, rotated output at grad_src, and the
    norm weight's gradient summed over them [hd]."""
    g = tl.load(grad_src + cols, mask=mask, other=0.0).to(tl.float32)
    g_partner = tl.load(grad_src + partner, mask=mask, other=0.0).to(tl.float32)
    d = g * cos - sign * g_partner * sin  # the rotation's transpose
    xhat = tl.load(x_src + cols, mask=mask, other=0.0).to(tl.float32) * rstd[:, :, None]
    s = d * tl.load(weight_ptr + cols)
    mean = tl.sum(s * xhat, axis=2) / HEAD_DIM
    return rstd[:, :, None] * (s - xhat * mean[:, :, None]), tl.sum(tl.sum(d * xhat, axis=1), axis=0)


@triton.jit
def _qk_norm_rope_backward(grad_q_ptr, grad_k_ptr, grad_v_ptr, qkv_ptr, qkv_row_stride, q_weight_ptr, k_weight_ptr,
                           cos_ptr, sin_ptr, positions_ptr, rstd_ptr, grad_x_ptr, grad_x_row_stride, grad_w_ptr,
                           num_tokens, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                           KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCKS: tl.constexpr):
    cols, partner, sign = _head_columns(HEAD_DIM)
    q_heads, kv_heads = tl.arange(0, Q_PAD)[None, :], tl.arange(0, KV_PAD)[None, :]
    dwq = tl.zeros([HEAD_DIM], dtype=tl.float32)
    dwk = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for i in range(BLOCKS):
        token = (tl.program_id(0) * BLOCKS + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = token < num_tokens
        cos, sin = _rope_tables(cos_ptr, sin_ptr, positions_ptr, token, token_mask, cols, HEAD_DIM)
        token64 = token.to(tl.int64)
        row = qkv_ptr + token64[:, None, None] * qkv_row_stride
        grad_row = grad_x_ptr + token64[:, None, None] * grad_x_row_stride
        rstd_row = rstd_ptr + token64[:, None] * (Q_HEADS + KV_HEADS)
        q_mask = token_mask[:, None] & (q_heads < Q_HEADS)
        kv_mask = token_mask[:, None] & (kv_heads < KV_HEADS)
        q_offsets = q_heads[:, :, None] * HEAD_DIM
        dx, dw = _norm_rotate_backward(grad_q_ptr + (token64[:, None, None] * Q_HEADS + q_heads[:, :, None]) * HEAD_DIM,
                                       row + q_offsets, tl.load(rstd_row + q_heads, mask=q_mask, other=0.0),
                                       q_mask[:, :, None], q_weight_ptr, cols, partner, sign, cos, sin, HEAD_DIM)
        tl.store(grad_row + q_offsets + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=q_mask[:, :, None])
        dwq += dw
        kv_src = (token64[:, None, None] * KV_HEADS + kv_heads[:, :, None]) * HEAD_DIM
        k_offsets = (Q_HEADS + kv_heads[:, :, None]) * HEAD_DIM
        dx, dw = _norm_rotate_backward(grad_k_ptr + kv_src, row + k_offsets,
                                       tl.load(rstd_row + Q_HEADS + kv_heads, mask=kv_mask, other=0.0),
                                       kv_mask[:, :, None], k_weight_ptr, cols, partner, sign, cos, sin, HEAD_DIM)
        tl.store(grad_row + k_offsets + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=kv_mask[:, :, None])
        dwk += dw
        grad_v = tl.load(grad_v_ptr + kv_src + cols, mask=kv_mask[:, :, None])
        tl.store(grad_row + (Q_HEADS + KV_HEADS + kv_heads[:, :, None]) * HEAD_DIM + cols,
                 grad_v.to(grad_x_ptr.dtype.element_ty), mask=kv_mask[:, :, None])  # v's gradient as it came
    # This program's d(weight), q and k apart: [program, {q, k}, HEAD_DIM].
    partial = grad_w_ptr + tl.program_id(0) * 2 * HEAD_DIM + tl.arange(0, HEAD_DIM)
    tl.store(partial, dwq)
    tl.store(partial + HEAD_DIM, dwk)


def qk_norm_rope_forward(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int, eps: float,
                         tile: tuple[int, int] = FORWARD_TILE) -> tuple[torch.Tensor, ...]:
    """The forward kernel on a contiguous qkv [N, (Hq + 2 Hkv) * hd]: q, k, v and the rstd [N, Hq + Hkv] of each
    query and key head."""
    head_dim, tokens = q_weight.shape[0], qkv.shape[0]
    q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k, v = (torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device) for _ in range(2))
    rstd = torch.empty(tokens, q_heads + kv_heads, dtype=torch.float32, device=qkv.device)
    block_tokens, warps = tile
    _qk_norm_rope_forward[(triton.cdiv(tokens, block_tokens),)](
        qkv, qkv.stride(0), q_weight, k_weight, cos, sin, positions, q, k, v, rstd, tokens, float(eps),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, Q_PAD=triton.next_power_of_2(q_heads),
        KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, BLOCK_T=block_tokens, num_warps=warps)
    return q, k, v, rstd


def qk_norm_rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, qkv: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor, rstd: torch.Tensor, q_heads: int, kv_heads: int,
                          tile: tuple[int, int, int] = BACKWARD_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel: qkv's gradient and the FP32 [2, hd] gradients of the q and k norm weights."""
    head_dim, tokens = q_weight.shape[0], qkv.shape[0]
    block_tokens, blocks, warps = tile
    programs = triton.cdiv(tokens, block_tokens * blocks)
    grad_qkv = torch.empty_like(qkv)
    partial = torch.empty(programs, 2, head_dim, dtype=torch.float32, device=qkv.device)
    _qk_norm_rope_backward[(programs,)](
        grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous(), qkv, qkv.stride(0), q_weight, k_weight,
        cos, sin, positions, rstd, grad_qkv, grad_qkv.stride(0), partial, tokens, Q_HEADS=q_heads,
        KV_HEADS=kv_heads, Q_PAD=triton.next_power_of_2(q_heads), KV_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim, BLOCK_T=block_tokens, BLOCKS=blocks, num_warps=warps)
    return grad_qkv, partial.sum(0)
