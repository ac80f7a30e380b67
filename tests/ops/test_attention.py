"""The attention backends (cflib.ops.attention): which kernel runs where, and each one beside its reference.

Where a kernel cannot run (a GPU kernel on a CPU), the choice of kernel is checked on mocked GPUs
(compute capability, installed packages), as the dispatch tests mock a missing Liger, and what cflib
hands the GPU kernels through stand-ins of their signatures; the kernels' numbers are checked
against a float64 reference wherever they run (the end of this file). A run's attention_backend,
checked before any step, is tested in tests/train/test_kernel_params.py.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
import torch
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops import attention
from cflib.ops.attention import (BACKENDS, attend, attention_batch, backend_problem,
                                 choose_kernel, pack_documents, check_attention)
from cflib.ops.dispatch import KernelUnavailable, choose_kernels

CPU, GPU = torch.device("cpu"), torch.device("cuda")
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def gpu(monkeypatch):
    """A mocked GPU: set its compute capability and whether flash-attn-4 is installed."""
    real_find_spec = importlib.util.find_spec
    state = {"capability": (9, 0), "fa4": True}

    def find_spec(name, *args):
        if name == "flash_attn.cute":
            return importlib.machinery.ModuleSpec(name, None) if state["fa4"] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(attention, "_import_problem", lambda module: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    attention._install_problem.cache_clear()  # answers from the real machine, or from another test's mock
    yield state
    attention._install_problem.cache_clear()


def test_auto_on_cpu_runs_sdpa_dense_and_the_sdpa_mask_packed():
    assert choose_kernel("auto", False, CPU, 64, FP32) == "torch_sdpa"
    assert choose_kernel("auto", True, CPU, 64, BF16) == "sdpa_mask"
    assert check_attention("auto", CPU, 64, packed=True) == ()  # no note: no GPU kernel was expected on a CPU


def test_auto_on_hopper_with_flash_attn_4_takes_it_dense_and_packed(gpu):
    assert choose_kernel("auto", False, GPU, 64, BF16) == "fa4"
    assert choose_kernel("auto", True, GPU, 64, BF16) == "fa4_varlen"
    assert choose_kernels("auto", False, GPU, "auto", 64, packed=True).attention == "auto"


def test_auto_in_an_fp32_run_keeps_attention_in_fp32(gpu):
    """The half-precision kernels are left to runs whose activations are bf16 (or fp16)."""
    assert choose_kernel("auto", False, GPU, 64, FP32) == "torch_sdpa"
    assert choose_kernel("auto", True, GPU, 64, FP32) == "flex_attention"
    assert choose_kernel("auto", True, GPU, 64, torch.float16) == "fa4_varlen"


def test_auto_falls_back_in_order_without_flash_attn_4(gpu):
    gpu["fa4"] = False
    assert choose_kernel("auto", False, GPU, 64, BF16) == "cudnn_sdpa"
    assert choose_kernel("auto", True, GPU, 64, BF16) == "flex_attention"
    assert choose_kernel("auto", True, GPU, 8, BF16) == "torch_varlen"  # heads too narrow for flex
    kernels = choose_kernels("auto", False, GPU, "auto", 64, packed=True)
    assert any("attention_backend (fa4): flash-attn-4 is not installed" in note for note in kernels.notes)
    with pytest.raises(KernelUnavailable, match="attention_backend: fa4, but flash-attn-4 is not installed"):
        check_attention("fa4", GPU, 64, packed=False)


def test_before_hopper_auto_takes_the_ampere_kernels_and_fa4_is_refused(gpu):
    gpu["capability"] = (8, 0)
    assert choose_kernel("auto", False, GPU, 64, BF16) == "torch_sdpa"
    assert choose_kernel("auto", True, GPU, 64, BF16) == "flex_attention"
    assert choose_kernel("auto", True, GPU, 8, BF16) == "torch_varlen"
    with pytest.raises(KernelUnavailable, match=r"fa4, but compute capability 8.0 < 9.0 \(FlashAttention-4 needs "
                                                r"Hopper or newer\)"):
        check_attention("fa4", GPU, 64, packed=True)


def test_flex_on_a_gpu_needs_wide_heads_and_fa4_a_multiple_of_8(gpu):
    with pytest.raises(KernelUnavailable, match="head_dim 8 < 16"):
        check_attention("flex", GPU, 8, packed=True)
    with pytest.raises(KernelUnavailable, match="head_dim 60: FlashAttention-4 takes multiples of 8 up to 256"):
        check_attention("fa4", GPU, 60, packed=False)
    assert choose_kernel("auto", True, GPU, 60, BF16) == "flex_attention"


def test_fa4_packs_no_heads_narrower_than_its_varlen_backward_computes_right(gpu):
    """FlashAttention-4's varlen backward is wrong below head_dim 32 (H200): auto packs those with FlexAttention,
    a named fa4 stops before any step; dense rows keep it."""
    assert choose_kernel("auto", True, GPU, 16, BF16) == "flex_attention"
    assert choose_kernel("auto", False, GPU, 16, BF16) == "fa4"
    assert choose_kernel("auto", True, GPU, 32, BF16) == "fa4_varlen"
    with pytest.raises(KernelUnavailable, match="fa4, but head_dim 16 < 32: FlashAttention-4's varlen backward"):
        check_attention("fa4", GPU, 16, packed=True)
    assert check_attention("fa4", GPU, 16, packed=False) == ()


def test_a_named_backend_runs_its_kernel_and_dense_rows_need_no_mask(gpu):
    assert [choose_kernel(name, True, GPU, 64, BF16) for name in ("fa4", "torch_varlen", "flex", "sdpa_mask")] == [
        "fa4_varlen", "torch_varlen", "flex_attention", "sdpa_mask"]
    assert [choose_kernel(name, False, GPU, 64, BF16) for name in ("fa4", "cudnn_sdpa", "torch_varlen", "flex")] == [
        "fa4", "cudnn_sdpa", "torch_sdpa", "torch_sdpa"]
    assert choose_kernel("fa4", False, GPU, 64, FP32) == "fa4"  # named: an fp32 run's q, k, v are cast to bf16


def test_cudnn_sdpa_cannot_attend_packed_windows(gpu):
    with pytest.raises(KernelUnavailable, match="cudnn_sdpa attends dense rows only"):
        check_attention("cudnn_sdpa", GPU, 64, packed=True)
    with pytest.raises(KernelUnavailable, match="cudnn_sdpa attends dense rows only"):
        choose_kernel("cudnn_sdpa", True, GPU, 64, BF16)


@pytest.mark.parametrize("name", ["fa4", "cudnn_sdpa", "torch_varlen", "flex"])
def test_a_gpu_backend_asked_for_on_cpu_names_the_failed_check(name):
    with pytest.raises(KernelUnavailable, match=f"attention_backend: {name}, but no GPU: the device is cpu"):
        choose_kernels("false", False, CPU, name, 64)


# --- the varlen and FlashAttention-4 calls, through stand-ins of the GPU kernels' signatures --------------------

def _segments(q, k, v, cu_seqlens):
    """Causal attention of each [start, stop) run of tokens alone: q [N, Hq, hd], k/v [N, Hkv, hd]."""
    bounds = cu_seqlens.tolist()
    parts = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
        is_causal=True, enable_gqa=True).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts).to(q.dtype)


class StandInFlashAttention4:
    """flash_attn.cute's two entry points as 4.0.0b36 defines them (layouts, keywords, dtypes, the (out, lse)
    pair), computed with SDPA: what cflib hands FlashAttention-4 is checked, not the kernel."""

    def flash_attn_func(self, q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, **rest):
        assert q.dim() == 4 and q.shape[1] == k.shape[1] and causal and q.dtype in (torch.bfloat16, torch.float16)
        batch, seq = q.shape[:2]
        cu_seqlens = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
        out = _segments(q.reshape(batch * seq, *q.shape[2:]), k.reshape(batch * seq, *k.shape[2:]),
                        v.reshape(batch * seq, *v.shape[2:]), cu_seqlens)
        return out.view(q.shape), None

    def flash_attn_varlen_func(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, causal=False, **rest):
        assert qv is None and q.dim() == 3 and causal and q.dtype in (torch.bfloat16, torch.float16)
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous() and cu_seqlens_q is cu_seqlens_k
        assert max_seqlen_q is None and max_seqlen_k is None  # a tensor fails in 4.0.0b36; None reads cu_seqlens
        return _segments(q, k, v, cu_seqlens_q), None


def stand_in_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1),
                         enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's signature (2.12+, enable_gqa) with SDPA inside."""
    assert window_size == (-1, 0) and isinstance(max_q, int) and max_q == max_k
    assert enable_gqa == (query.shape[1] != key.shape[1])
    assert max_q == int(cu_seq_q.diff().max())
    return _segments(query, key, value, cu_seq_q)


@pytest.mark.parametrize("kernel", ["fa4", "fa4_varlen", "torch_varlen"])
def test_the_model_hands_the_gpu_kernels_what_they_take(monkeypatch, kernel):
    """The whole model (packed windows for the varlen kernels) through stand-ins of FlashAttention-4 and
    torch's varlen_attn: the loss and every gradient those of SDPA with a document mask, up to the bf16 cast
    of q, k and v that these kernels compute in."""
    from tiny_models import random_ids, tiny_model

    from cflib.ops.loss import chunked_cross_entropy_sum

    monkeypatch.setattr(attention, "_fa4", StandInFlashAttention4)
    monkeypatch.setattr(attention, "_torch_varlen", lambda: (stand_in_varlen_attn, True))
    model = tiny_model(seed=4, hidden_size=64).train()  # head_dim 16
    ids, labels = random_ids(50, 2, 16), random_ids(50, 2, 16, seed=1)
    packed = kernel != "fa4"
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7]) if packed else None
    results = {}
    for name in ("reference", kernel):
        chosen = (lambda *args: name) if name != "reference" else attention.choose_kernel
        monkeypatch.setattr(attention, "choose_kernel", chosen)
        model.zero_grad()
        loss, _ = chunked_cross_entropy_sum(model(ids, document_ids), model.head_weight, labels, 8)
        loss.backward()
        assert model.kernel_path()["attention"] == (name if name != "reference" else
                                                    "sdpa_mask" if packed else "torch_sdpa")
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (want, want_grads), (got, got_grads) = results["reference"], results[kernel]
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).norm() <= 2e-2 * grad.norm() + 1e-6, name


# --- each kernel beside its reference, where it runs -----------------------------------------------------------

# (attention_backend, packed): every kernel the backends run (auto on dense rows: torch_sdpa on a CPU).
KERNEL_CASES = [("auto", False), ("sdpa_mask", True), ("fa4", False), ("fa4", True), ("cudnn_sdpa", False),
                ("torch_varlen", True), ("flex", True)]
BATCH, SEQ, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 12, 4, 2, 32
DOCUMENT_IDS = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 8 + [1] * 4])


def attention_truth(document_ids):
    """Causal attention of each document alone, with GQA, an explicit softmax and scale 1/sqrt(hd)."""
    def attend_each(q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        if document_ids is not None:
            allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
        scores = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        return scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1) @ v
    return attend_each


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend, packed", KERNEL_CASES, ids=[f"{b}-{'packed' if p else 'dense'}"
                                                              for b, p in KERNEL_CASES])
def test_each_kernel_matches_the_reference_forward_and_backward(backend, packed, dtype):
    if problem := backend_problem(backend, KERNEL_DEVICE, HEAD_DIM, packed=packed) if backend != "auto" else None:
        pytest.skip(problem)
    kernel = (BACKENDS[backend].packed if packed else BACKENDS[backend].dense) if backend in BACKENDS else None
    if dtype == torch.float32 and kernel is not None and kernel.half_only:
        pytest.skip(f"{backend} computes in bfloat16/float16: checked in bfloat16")
    gen = torch.Generator().manual_seed(len(backend) + packed)
    raw = {name: torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen).to(dtype)
           for name, heads in (("q", Q_HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    documents = pack_documents(DOCUMENT_IDS).moved(lambda t: t.to(KERNEL_DEVICE)) if packed else None
    ran = []

    def fast(q, k, v):
        batch = attention_batch(backend, q.device, q.dtype, HEAD_DIM, documents)
        ran.append(batch.kernel)
        return attend(q, k, v, batch)
    grad = ("q", "k", "v")
    truth = run(attention_truth(DOCUMENT_IDS if packed else None),
                leaves(raw, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 4)
    got = run(fast, leaves(raw, {}, KERNEL_DEVICE, grad), 4)
    want = (kernel.name if backend != "auto" else choose_kernel("auto", packed, KERNEL_DEVICE, HEAD_DIM, dtype))
    assert ran == [want]  # the kernel asked for ran, not a fallback
    assert_matches(got, truth, dtype)
