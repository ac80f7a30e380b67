"""Document-masked causal attention: in a packed window each example attends only to itself.

A packed window holds several whole examples; `document_ids[b, t]` names the
example position t belongs to. Query t may attend to key s when s <= t and
both lie in the same document, so a packed example computes exactly what it
would compute alone. On CUDA the mask is a FlexAttention block mask (blocks
that cross documents are skipped, not computed then masked); elsewhere it is a
boolean mask for PyTorch's scaled_dot_product_attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # builds without FlexAttention use the SDPA mask everywhere
    flex_attention = None

BACKENDS = ("flex_attention", "sdpa_mask")


@dataclass
class DocumentMask:
    """Built once per forward and shared by every layer."""

    backend: str  # one of BACKENDS: what attention actually runs with
    mask: "torch.Tensor | BlockMask"


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions restarting at 0 where each document starts (documents are contiguous)."""
    steps = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return steps - torch.where(starts, steps, 0).cummax(dim=1).values


# Inductor's FlexAttention kernels refuse heads narrower than this (torch 2.11: "NYI").
FLEX_MIN_HEAD_DIM = 16


def default_backend(device: torch.device, head_dim: int) -> str:
    flex = device.type == "cuda" and flex_attention is not None and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex_attention" if flex else "sdpa_mask"


def build_document_mask(document_ids: torch.Tensor, head_dim: int,
                        backend: str | None = None) -> DocumentMask:
    """The causal same-document mask of [B, T] document ids, for `document_attention` on heads of head_dim."""
    backend = backend or default_backend(document_ids.device, head_dim)
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {BACKENDS}")
    if backend == "flex_attention":
        if flex_attention is None:
            raise RuntimeError(f"torch {torch.__version__} has no FlexAttention")
        ids = document_ids

        def same_document_causal(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

        batch, seq = ids.shape
        # Compiled: the eager build evaluates the mask at all B x T x T positions, at 16 x 2,048 on the H200
        # 5.9 ms of GPU and 7 ms of host time per forward; compiled, 1.7 ms.
        return DocumentMask(backend, create_block_mask(same_document_causal, batch, None, seq, seq,
                                                       device=ids.device, _compile=True))
    causal = torch.ones(document_ids.shape[1], document_ids.shape[1], dtype=torch.bool,
                        device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return DocumentMask(backend, (same & causal)[:, None])  # [B, 1, T, T], broadcast over heads


@functools.cache
def _compiled_flex_attention():
    # Uncompiled FlexAttention materialises the full score matrix; compiled, it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """q [B, Hq, T, hd], k/v [B, Hkv, T, hd] (GQA when Hq > Hkv); returns [B, Hq, T, hd]."""
    gqa = q.shape[1] != k.shape[1]
    if mask.backend == "flex_attention":
        attend = _compiled_flex_attention() if q.is_cuda else flex_attention
        return attend(q, k, v, block_mask=mask.mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, enable_gqa=gqa)
