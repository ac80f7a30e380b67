"""Causal attention over dense rows or packed documents, on the fastest backend that runs here.

A packed window holds several whole examples; `document_ids[b, t]` names the
example position t belongs to. Query t attends to key s when s <= t and both
lie in the same document, so a packed example computes exactly what it would
compute alone (its positions restart at 0 as well). The backends, fastest
first where each applies (H200, 16 x 2,048 tokens, GQA 14/2, head dim 64,
BF16, forward + backward; outputs/records/attention_200m_h200/kernels_and_loss.json):

  dense rows      fa4 (FlashAttention-4) 1.33 ms > cudnn_sdpa 1.38 ms > torch_sdpa (SDPA's own choice)
  packed windows  fa4 varlen 1.26 ms > flex (FlexAttention document block mask) 1.79 ms >
                  torch_varlen (FlashAttention-2 varlen) 1.99 ms > sdpa_mask (a boolean mask, anywhere) 3.50 ms

In the whole training step fa4 leads on both kinds of batches (docs/kernels.md).

`auto` takes the first whose checks pass for the activations' dtype; a backend
asked for by name must pass its checks or stops the run naming the one that
failed (and casts fp32 activations to bf16 where it computes in half
precision). The varlen kernels read the documents as `cu_seqlens`, built on
the host with the batch (`pack_documents`), so no step reads the device back.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cflib.errors import KernelUnavailable

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # builds without FlexAttention mask with SDPA
    flex_attention = None

ATTENTION_BACKENDS = ("auto", "fa4", "cudnn_sdpa", "torch_varlen", "flex", "sdpa_mask")
# The kernel a named backend runs on (dense rows, packed windows); None: it has no document mask. A dense row
# needs no mask, so the mask-only backends run it with SDPA.
KERNELS = {"fa4": ("fa4", "fa4_varlen"), "cudnn_sdpa": ("cudnn_sdpa", None),
           "torch_varlen": ("torch_sdpa", "torch_varlen"), "flex": ("torch_sdpa", "flex_attention"),
           "sdpa_mask": ("torch_sdpa", "sdpa_mask")}
# auto: the first of these that passes, else the last kernel, which runs anywhere.
AUTO_ORDER = {False: ("fa4", "cudnn_sdpa"), True: ("fa4", "flex", "torch_varlen")}
AUTO_LAST = {False: "torch_sdpa", True: "sdpa_mask"}
HALF = (torch.bfloat16, torch.float16)
HALF_ONLY_KERNELS = ("fa4", "fa4_varlen", "cudnn_sdpa", "torch_varlen")
# name: (what it is, the least compute capability, the widest head); head_dim must also be a multiple of 8.
GPU_NEEDS = {"fa4": ("FlashAttention-4", (9, 0), 256), "cudnn_sdpa": ("cuDNN attention", (9, 0), 128),
             "torch_varlen": ("torch.nn.attention.varlen (FlashAttention-2)", (8, 0), 256)}
# Inductor's FlexAttention kernels refuse heads narrower than this (torch 2.11: "NYI").
FLEX_MIN_HEAD_DIM = 16
# FlashAttention-4 4.0.0b36's varlen backward on Hopper returns wrong gradients for narrower heads (H200, measured
# against float64: head_dim 16 off by 100%, 32, 64 and 128 within 3e-3; its forward and the dense kernel are right).
FA4_VARLEN_MIN_HEAD_DIM = 32


# --- the packed documents ---------------------------------------------------------------------------------

@dataclass
class PackedDocuments:
    """A packed batch's documents: built once on the host with the batch, moved to the device with it."""

    document_ids: torch.Tensor  # [B, T]; each document one contiguous run of its row
    positions: torch.Tensor  # [B, T]: 0 where each document starts
    cu_seqlens: torch.Tensor  # [S + 1] int32: where each of the S documents (row after row) starts among the
    # B x T tokens, then B x T
    max_seqlen: int  # the longest document, a host int

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "PackedDocuments":
        return PackedDocuments(move(self.document_ids), move(self.positions), move(self.cu_seqlens),
                               self.max_seqlen)


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions restarting at 0 where each document starts (documents are contiguous)."""
    steps = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    return steps - torch.where(_document_starts(document_ids), steps, 0).cummax(dim=1).values


def pack_documents(document_ids: torch.Tensor) -> PackedDocuments:
    """The documents of [B, T] ids. Meant for the host, where the batch is collated: on a GPU tensor the
    document count and the longest document are read back, a sync."""
    batch, seq = document_ids.shape
    starts = _document_starts(document_ids).reshape(-1).nonzero().squeeze(1)
    cu_seqlens = torch.cat([starts, starts.new_full((1,), batch * seq)]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max()) if batch * seq else 0
    return PackedDocuments(document_ids, document_positions(document_ids), cu_seqlens, max_seqlen)


# --- which kernel runs --------------------------------------------------------------------------------------

def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # its parent package is absent, or fails to import
        return True


@functools.cache
def _import_problem(module: str) -> str | None:
    """Why an installed module fails to import (a missing dependency of it), or None."""
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001  (any failure is the reason the backend cannot run)
        return f"import {module} failed: {type(err).__name__}: {err}"
    return None


@functools.cache  # asked at every forward: the answer does not change within a process
def _install_problem(name: str) -> str | None:
    if name == "fa4":
        if _missing("flash_attn.cute"):
            return "flash-attn-4 is not installed (pip install 'flash-attn-4>=4.0.0b36', or cflib[gpu])"
        return _import_problem("flash_attn.cute")
    if name == "cudnn_sdpa" and not torch.backends.cudnn.is_available():
        return "this PyTorch build has no cuDNN"
    if name == "torch_varlen" and _missing("torch.nn.attention.varlen"):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or newer)"
    return None


def backend_problem(name: str, device: torch.device, head_dim: int, dtype: torch.dtype | None = None,
                    packed: bool = False) -> str | None:
    """Why backend `name` cannot run on `device` with heads of head_dim (and, given, activations of dtype), for
    packed windows or dense rows, or None."""
    if name == "sdpa_mask":
        return None
    if name == "flex":
        if flex_attention is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if device.type != "cuda":  # uncompiled it computes every score, and it has no backward on a CPU
            return f"no GPU: the device is {device} (FlexAttention trains compiled, on GPUs)"
        if head_dim < FLEX_MIN_HEAD_DIM:
            return f"head_dim {head_dim} < {FLEX_MIN_HEAD_DIM} (FlexAttention's GPU kernels)"
        return None
    what, least, widest = GPU_NEEDS[name]
    if device.type != "cuda":
        return f"no GPU: the device is {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < least:
        return (f"compute capability {major}.{minor} < {least[0]}.{least[1]} ({what} needs "
                f"{'Hopper' if least >= (9, 0) else 'Ampere'} or newer)")
    if head_dim % 8 or head_dim > widest:
        return f"head_dim {head_dim}: {what} takes multiples of 8 up to {widest}"
    if name == "fa4" and packed and head_dim < FA4_VARLEN_MIN_HEAD_DIM:
        return (f"head_dim {head_dim} < {FA4_VARLEN_MIN_HEAD_DIM}: {what}'s varlen backward gives wrong gradients "
                "for narrower heads")
    if dtype is not None and dtype not in HALF:
        return f"{str(dtype).removeprefix('torch.')} activations: {what} computes in bfloat16/float16 (bf16: true)"
    return _install_problem(name)


def choose_kernel(requested: str, packed: bool, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The kernel `requested` runs for dense rows or packed windows, or KernelUnavailable naming the check."""
    if requested == "auto":
        return next((KERNELS[name][packed] for name in AUTO_ORDER[packed]
                     if backend_problem(name, device, head_dim, dtype, packed) is None), AUTO_LAST[packed])
    if requested not in KERNELS:
        raise KernelUnavailable(f"attention_backend {requested!r}: expected one of {ATTENTION_BACKENDS}")
    kernel = KERNELS[requested][packed]
    if kernel is None:
        raise KernelUnavailable(f"attention_backend {requested} attends dense rows only (it has no document mask); "
                                f"packed windows take fa4, torch_varlen, flex or sdpa_mask")
    if kernel != "torch_sdpa" and (problem := backend_problem(requested, device, head_dim, packed=packed)):
        raise KernelUnavailable(f"attention_backend: {requested}, but {problem}")
    return kernel


def plan_attention(requested: str, device: torch.device, head_dim: int, packed: bool) -> tuple[str, ...]:
    """A run's attention_backend checked before any step: KernelUnavailable naming the failed check, or, for
    auto, notes on the fast kernel it leaves off on this GPU (the activations' dtype is judged at each forward)."""
    if requested == "auto":
        problem = backend_problem("fa4", device, head_dim, packed=packed) if device.type == "cuda" else None
        return (f"attention_backend (fa4): {problem}",) if problem else ()
    if requested in KERNELS and (problem := backend_problem(requested, device, head_dim, packed=packed)):
        raise KernelUnavailable(f"attention_backend: {requested}, but {problem}")
    choose_kernel(requested, packed, device, head_dim, torch.bfloat16)  # a kind of row it cannot attend
    return ()


# --- attending ----------------------------------------------------------------------------------------------

@dataclass
class AttentionBatch:
    """What every layer of one forward attends with, built once per forward."""

    kernel: str  # what runs, as the record reports it
    documents: PackedDocuments | None = None
    mask: Any = None  # sdpa_mask: a boolean [B, 1, T, T] mask; flex_attention: a BlockMask


DENSE_SDPA = AttentionBatch("torch_sdpa")


def attention_batch(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    documents: PackedDocuments | None = None) -> AttentionBatch:
    """The kernel for this forward's rows (packed when documents are given) and the mask it needs, if any."""
    kernel = choose_kernel(requested, documents is not None, device, head_dim, dtype)
    if kernel == "flex_attention":
        return AttentionBatch(kernel, documents, _block_mask(documents.document_ids))
    if kernel == "sdpa_mask":
        ids = documents.document_ids
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        return AttentionBatch(kernel, documents, ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None])
    return AttentionBatch(kernel, documents)


def _block_mask(ids: torch.Tensor):
    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    batch, seq = ids.shape
    # Compiled: the eager build evaluates the mask at all B x T x T positions, at 16 x 2,048 on the H200
    # 5.9 ms of GPU and 7 ms of host time per forward; compiled, 1.7 ms.
    return create_block_mask(same_document_causal, batch, None, seq, seq, device=ids.device, _compile=True)


@functools.cache
def _compiled_flex_attention():
    # Uncompiled FlexAttention materialises the full score matrix; compiled, it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _fa4():
    import flash_attn.cute
    return flash_attn.cute


@functools.cache
def _torch_varlen() -> tuple[Callable, bool]:
    from torch.nn.attention.varlen import varlen_attn
    # torch 2.12+ takes Hq != Hkv only with enable_gqa=True; 2.11 has no such argument and takes GQA as it is.
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, hd] -> [B x T, H, hd]: a view when x is a transposed [B, T, H, hd] tensor, as the QKV paths give."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch = DENSE_SDPA) -> torch.Tensor:
    """q [B, Hq, T, hd], k/v [B, Hkv, T, hd] (GQA when Hq > Hkv) -> [B, Hq, T, hd], with batch.kernel."""
    kernel, gqa = batch.kernel, q.shape[1] != k.shape[1]
    if kernel in HALF_ONLY_KERNELS and q.dtype not in HALF:  # asked for by name in an fp32 run
        return attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), batch).to(q.dtype)
    if kernel == "fa4":  # FlashAttention-4 takes [B, T, H, hd]: the transposes are views
        out = _fa4().flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)[0]
        return out.transpose(1, 2)
    if kernel in ("fa4_varlen", "torch_varlen"):
        documents, (rows, heads, seq, head_dim) = batch.documents, q.shape
        cu_seqlens = documents.cu_seqlens
        if kernel == "fa4_varlen":
            # No max_seqlen: FA4 bounds its grid by the token count and reads each length from cu_seqlens on the
            # device (H200: 0.77 ms against 0.82 with the true maximum; a tensor maximum fails in 4.0.0b36).
            out = _fa4().flash_attn_varlen_func(_tokens(q), _tokens(k), _tokens(v), cu_seqlens_q=cu_seqlens,
                                                cu_seqlens_k=cu_seqlens, causal=True)[0]
        else:
            varlen_attn, takes_gqa = _torch_varlen()
            out = varlen_attn(_tokens(q), _tokens(k), _tokens(v), cu_seqlens, cu_seqlens, documents.max_seqlen,
                              documents.max_seqlen, window_size=(-1, 0),  # (-1, 0): causal
                              **({"enable_gqa": gqa} if takes_gqa else {}))
        return out.view(rows, seq, heads, head_dim).transpose(1, 2)
    if kernel == "cudnn_sdpa":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if kernel == "flex_attention":
        return _compiled_flex_attention()(q, k, v, block_mask=batch.mask, enable_gqa=gqa)
    if kernel == "sdpa_mask":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, enable_gqa=gqa)
    # Right padding needs no mask: under the causal mask no real token sees a later pad.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
