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

Each backend is one `Backend` record, registered at the end of this module in the
order `auto` tries them: its kernels for dense rows and packed windows, its checks,
and the masks its kernels build; `register_backend` adds another (docs/architecture.md).
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

HALF = (torch.bfloat16, torch.float16)
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


# --- the kernels and the backends -------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """One attention kernel, named as records report it."""

    name: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "AttentionBatch"], torch.Tensor]  # q, k, v [B, H, T, hd]
    half_only: bool = False  # computes in bfloat16/float16: fp32 activations are cast for it and back
    mask: Callable[["PackedDocuments"], Any] | None = None  # built once per forward, read by every layer
    component: str | None = None  # its name among validate_kernels' components (cflib.bench.components)
    # Its launches can be recorded in a CUDA graph: it reads its documents from device tensors only, builds no
    # mask, and takes no length from the host (cflib.train.graphs)
    capturable: bool = False


@dataclass(frozen=True)
class Backend:
    """What `attention_backend` may name: the kernel it runs on dense rows and on packed windows (None: it has
    no document mask), why it cannot run here (None: it can), and the kinds of rows `auto` tries it for."""

    name: str
    what: str
    dense: Kernel
    packed: Kernel | None
    problem: Callable[[torch.device, int, bool], str | None]  # (device, head_dim, packed) -> why not, or None
    auto_for: tuple[bool, ...] = ()  # False: dense rows, True: packed windows; tried in registry order


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add an attention backend: `attention_backend: NAME` and `auto` (in registration order) find it, runs check
    it before any step, the decoder attends with it, and validate_kernels checks its kernels (docs/architecture.md
    shows one added). A run on several processes carries it to torchrun's workers by the module-level name a module
    they can import binds it to (cflib.train.registered): define it in such a module and register it from there."""
    BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    return ("auto", *BACKENDS)


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


def _gpu_problem(what: str, least: tuple[int, int], widest: int, device: torch.device, head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"no GPU: the device is {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < least:
        return (f"compute capability {major}.{minor} < {least[0]}.{least[1]} ({what} needs "
                f"{'Hopper' if least >= (9, 0) else 'Ampere'} or newer)")
    if head_dim % 8 or head_dim > widest:
        return f"head_dim {head_dim}: {what} takes multiples of 8 up to {widest}"
    return None


@functools.cache  # asked at every forward: the answer does not change within a process
def _install_problem(module: str) -> str | None:
    if _missing(module):
        return f"{module} is not installed"
    return _import_problem(module)


def _fa4_problem(device: torch.device, head_dim: int, packed: bool) -> str | None:
    what = "FlashAttention-4"
    if problem := _gpu_problem(what, (9, 0), 256, device, head_dim):
        return problem
    if packed and head_dim < FA4_VARLEN_MIN_HEAD_DIM:
        return (f"head_dim {head_dim} < {FA4_VARLEN_MIN_HEAD_DIM}: {what}'s varlen backward gives wrong gradients "
                "for narrower heads")
    if problem := _install_problem("flash_attn.cute"):
        return problem.replace("flash_attn.cute is not installed",
                               "flash-attn-4 is not installed (pip install 'flash-attn-4>=4.0.0b36', or cflib[gpu])")
    return None


def _cudnn_problem(device: torch.device, head_dim: int, packed: bool) -> str | None:
    if problem := _gpu_problem("cuDNN attention", (9, 0), 128, device, head_dim):
        return problem
    return None if torch.backends.cudnn.is_available() else "this PyTorch build has no cuDNN"


def _torch_varlen_problem(device: torch.device, head_dim: int, packed: bool) -> str | None:
    if problem := _gpu_problem("torch.nn.attention.varlen (FlashAttention-2)", (8, 0), 256, device, head_dim):
        return problem
    if _missing("torch.nn.attention.varlen"):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or newer)"
    return None


def _flex_problem(device: torch.device, head_dim: int, packed: bool) -> str | None:
    if flex_attention is None:
        return f"torch {torch.__version__} has no FlexAttention"
    if device.type != "cuda":  # uncompiled it computes every score, and it has no backward on a CPU
        return f"no GPU: the device is {device} (FlexAttention trains compiled, on GPUs)"
    if head_dim < FLEX_MIN_HEAD_DIM:
        return f"head_dim {head_dim} < {FLEX_MIN_HEAD_DIM} (FlexAttention's GPU kernels)"
    return None


def backend_problem(name: str, device: torch.device, head_dim: int, dtype: torch.dtype | None = None,
                    packed: bool = False) -> str | None:
    """Why backend `name` cannot run on `device` with heads of head_dim (and, given, activations of dtype), for
    packed windows or dense rows, or None."""
    backend = BACKENDS[name]
    if problem := backend.problem(device, head_dim, packed):
        return problem
    kernel = backend.packed if packed else backend.dense
    if kernel is not None and kernel.half_only and dtype is not None and dtype not in HALF:
        return (f"{str(dtype).removeprefix('torch.')} activations: {backend.what} computes in bfloat16/float16 "
                "(bf16: true)")
    return None


def packed_problem(name: str) -> str | None:
    """Why backend `name` cannot attend packed windows (it has no document mask), or None."""
    backend = BACKENDS.get(name)
    if backend is None or backend.packed is not None:
        return None
    able = ", ".join(n for n in backend_names() if n == "auto" or BACKENDS[n].packed is not None)
    return f"attention_backend {name} attends dense rows only (it has no document mask); packed windows take {able}"


def _auto(packed: bool, device: torch.device, head_dim: int, dtype: torch.dtype) -> Kernel:
    for backend in BACKENDS.values():
        if packed in backend.auto_for and backend_problem(backend.name, device, head_dim, dtype, packed) is None:
            return backend.packed if packed else backend.dense
    return SDPA_MASK if packed else TORCH_SDPA  # they run anywhere


def choose_kernel(requested: str, packed: bool, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The kernel `requested` runs for dense rows or packed windows, or KernelUnavailable naming the check."""
    return _choose(requested, packed, device, head_dim, dtype).name


def _choose(requested: str, packed: bool, device: torch.device, head_dim: int, dtype: torch.dtype) -> Kernel:
    if requested == "auto":
        return _auto(packed, device, head_dim, dtype)
    if requested not in BACKENDS:
        raise KernelUnavailable(f"attention_backend {requested!r}: expected one of {backend_names()}")
    backend = BACKENDS[requested]
    kernel = backend.packed if packed else backend.dense
    if kernel is None:
        raise KernelUnavailable(packed_problem(requested))
    if kernel is not TORCH_SDPA and (problem := backend.problem(device, head_dim, packed)):
        raise KernelUnavailable(f"attention_backend: {requested}, but {problem}")
    return kernel


def check_attention(requested: str, device: torch.device, head_dim: int, packed: bool) -> tuple[str, ...]:
    """A run's attention_backend checked before any step: KernelUnavailable naming the failed check, or, for
    auto, notes on the fast kernel it leaves off on this GPU (the activations' dtype is judged at each forward)."""
    if requested == "auto":
        if device.type != "cuda":
            return ()
        first = next(iter(BACKENDS.values()))
        problem = backend_problem(first.name, device, head_dim, packed=packed)
        return (f"attention_backend ({first.name}): {problem}",) if problem else ()
    if requested in BACKENDS and (problem := backend_problem(requested, device, head_dim, packed=packed)):
        raise KernelUnavailable(f"attention_backend: {requested}, but {problem}")
    _choose(requested, packed, device, head_dim, torch.bfloat16)  # a kind of row it cannot attend
    return ()


def capturable(requested: str, packed: bool, device: torch.device, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel `requested` runs for these rows can be recorded in a CUDA graph."""
    return _choose(requested, packed, device, head_dim, dtype).capturable


def kernel_named(name: str) -> Kernel:
    for backend in BACKENDS.values():
        for kernel in (backend.dense, backend.packed):
            if kernel is not None and kernel.name == name:
                return kernel
    raise KeyError(f"no attention backend has a kernel named {name!r}")


def kernels_of(packed: bool) -> dict[str, str | None]:
    """Every kernel that attends this kind of rows -> the backend that names it (None: SDPA, which needs none)."""
    found: dict[str, str | None] = {}
    for backend in BACKENDS.values():
        kernel = backend.packed if packed else backend.dense
        if kernel is not None:
            found.setdefault(kernel.name, None if kernel is TORCH_SDPA else backend.name)
    return found


# --- attending ----------------------------------------------------------------------------------------------

@dataclass
class AttentionBatch:
    """What every layer of one forward attends with, built once per forward."""

    kernel: str  # what runs, as the record reports it
    documents: PackedDocuments | None = None
    mask: Any = None  # whatever the kernel's mask builder made (a boolean mask, a BlockMask)
    run: Callable[..., torch.Tensor] | None = None  # None: causal SDPA
    half_only: bool = False


def attention_batch(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    documents: PackedDocuments | None = None) -> AttentionBatch:
    """The kernel for this forward's rows (packed when documents are given) and the mask it needs, if any."""
    kernel = kernel_named(choose_kernel(requested, documents is not None, device, head_dim, dtype))
    mask = kernel.mask(documents) if kernel.mask is not None else None
    return AttentionBatch(kernel.name, documents, mask, kernel.run, kernel.half_only)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch | None = None) -> torch.Tensor:
    """q [B, Hq, T, hd], k/v [B, Hkv, T, hd] (GQA when Hq > Hkv) -> [B, Hq, T, hd], with batch's kernel."""
    batch = DENSE_SDPA if batch is None else batch
    if batch.half_only and q.dtype not in HALF:  # asked for by name in an fp32 run
        return attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), batch).to(q.dtype)
    return (batch.run or _sdpa)(q, k, v, batch)


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


def _sdpa(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    # Right padding needs no mask: under the causal mask no real token sees a later pad.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_gqa(q, k))


def _cudnn(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_gqa(q, k))


def _sdpa_mask(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, enable_gqa=_gqa(q, k))


def _boolean_mask(documents: PackedDocuments) -> torch.Tensor:
    ids = documents.document_ids
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def _block_mask(documents: PackedDocuments):
    ids = documents.document_ids

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


def _flex(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    return _compiled_flex_attention()(q, k, v, block_mask=batch.mask, enable_gqa=_gqa(q, k))


@functools.cache
def _fa4():
    import flash_attn.cute
    return flash_attn.cute


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, hd] -> [B x T, H, hd]: a view when x is a transposed [B, T, H, hd] tensor, as the QKV paths give."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _from_tokens(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    rows, heads, seq, head_dim = q.shape
    return out.view(rows, seq, heads, head_dim).transpose(1, 2)


def _run_fa4(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    # FlashAttention-4 takes [B, T, H, hd]: the transposes are views.
    out = _fa4().flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)[0]
    return out.transpose(1, 2)


def _run_fa4_varlen(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    cu_seqlens = batch.documents.cu_seqlens
    # No max_seqlen: FA4 bounds its grid by the token count and reads each length from cu_seqlens on the device
    # (H200: 0.77 ms against 0.82 with the true maximum; a tensor maximum fails in 4.0.0b36).
    out = _fa4().flash_attn_varlen_func(_tokens(q), _tokens(k), _tokens(v), cu_seqlens_q=cu_seqlens,
                                               cu_seqlens_k=cu_seqlens, causal=True)[0]
    return _from_tokens(out, q)


@functools.cache
def _torch_varlen() -> tuple[Callable, bool]:
    from torch.nn.attention.varlen import varlen_attn
    # torch 2.12+ takes Hq != Hkv only with enable_gqa=True; 2.11 has no such argument and takes GQA as it is.
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _run_torch_varlen(q, k, v, batch: AttentionBatch) -> torch.Tensor:
    documents = batch.documents
    varlen_attn, takes_gqa = _torch_varlen()
    out = varlen_attn(_tokens(q), _tokens(k), _tokens(v), documents.cu_seqlens, documents.cu_seqlens,
                      documents.max_seqlen, documents.max_seqlen, window_size=(-1, 0),  # (-1, 0): causal
                      **({"enable_gqa": _gqa(q, k)} if takes_gqa else {}))
    return _from_tokens(out, q)


TORCH_SDPA = Kernel("torch_sdpa", _sdpa, capturable=True)
SDPA_MASK = Kernel("sdpa_mask", _sdpa_mask, mask=_boolean_mask)
DENSE_SDPA = AttentionBatch("torch_sdpa")

# Registered in the order `auto` prefers them (see the module docstring for the measurements).
register_backend(Backend("fa4", "FlashAttention-4",
                         Kernel("fa4", _run_fa4, half_only=True, component="attention_fa4", capturable=True),
                         Kernel("fa4_varlen", _run_fa4_varlen, half_only=True, component="attention_fa4_varlen",
                                capturable=True),
                         _fa4_problem, auto_for=(False, True)))
register_backend(Backend("cudnn_sdpa", "cuDNN attention",
                         Kernel("cudnn_sdpa", _cudnn, half_only=True, component="attention_cudnn", capturable=True), None,
                         _cudnn_problem, auto_for=(False,)))
# On packed windows FlexAttention before torch's varlen, as measured (kernel 1.79 vs 1.99 ms, step 284k vs 282k tok/s).
register_backend(Backend("flex", "FlexAttention", TORCH_SDPA,
                         Kernel("flex_attention", _flex, mask=_block_mask, component="attention_flex"),
                         _flex_problem, auto_for=(True,)))
register_backend(Backend("torch_varlen", "torch.nn.attention.varlen (FlashAttention-2)", TORCH_SDPA,
                         Kernel("torch_varlen", _run_torch_varlen, half_only=True, component="attention_torch_varlen"),
                         _torch_varlen_problem, auto_for=(True,)))
register_backend(Backend("sdpa_mask", "SDPA with a boolean document mask", TORCH_SDPA, SDPA_MASK,
                         lambda device, head_dim, packed: None))
ATTENTION_BACKENDS = backend_names()  # the built-in names; backend_names() also lists registered ones
# What every process has on import; torchrun's workers import any other backend a run may attend with
# (cflib.train.registered).
BUILT_IN_BACKENDS: dict[str, Backend] = dict(BACKENDS)
