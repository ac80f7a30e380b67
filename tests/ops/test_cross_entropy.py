"""cflib's fused linear cross-entropy with token weights (cflib.ops.cross_entropy) beside the full-logit loss.

The op takes the supervised rows only (cflib.ops.loss.supervised_rows picks them) and returns
sum_i w_i * CE(hidden_i @ head.T, target_i), its gradients done in forward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops.cross_entropy import FusedLinearWeightedCrossEntropy
from cflib.ops.loss import IGNORE_INDEX, chunked_cross_entropy_sum

ROWS, DIM, VOCAB = 19, 16, 300  # a vocabulary below a power of two: the kernel's masked columns run too


def reference(hidden, head, token_weights=None, *, targets):
    losses = F.cross_entropy(hidden @ head.t(), targets, reduction="none")
    return (losses * token_weights).sum() if token_weights is not None else losses.sum()


def inputs(seed: int, weighted: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = {"hidden": torch.randn(ROWS, DIM, generator=gen), "head": torch.randn(VOCAB, DIM, generator=gen) * 0.4}
    if weighted:
        raw["token_weights"] = torch.rand(ROWS, generator=gen) * 3
    return raw, torch.randint(0, VOCAB, (ROWS,), generator=gen).to(KERNEL_DEVICE)


@pytest.mark.parametrize("chunk", [1, 6, 1024])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_the_full_logit_loss_forward_and_backward(dtype, weighted, chunk):
    """As SFTLoss runs it: hidden states and head in the run's dtype, the token weights in fp32."""
    raw, targets = inputs(chunk, weighted)
    dtypes = {"hidden": dtype, "head": dtype}
    rounded = {name: value.to(dtypes.get(name, value.dtype)) for name, value in raw.items()}
    grad = ("hidden", "head")
    truth = run(lambda **t: reference(**t, targets=targets),
                leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 2)
    got = run(lambda hidden, head, token_weights=None: FusedLinearWeightedCrossEntropy.apply(
        hidden, head, targets, token_weights, chunk), leaves(rounded, {}, KERNEL_DEVICE, grad), 2)
    assert got["out0"].dtype == torch.float32 and got["d_head"].dtype == dtype
    assert_matches(got, truth, dtype)


def test_a_master_takes_the_head_gradient_in_fp32_unrounded():
    """Given the FP32 master of a BF16 head, the op hands the master its FP32 gradient: the one a BF16 head
    would get, before autograd rounds it to BF16."""
    raw, targets = inputs(3, False)
    master = raw["head"].to(KERNEL_DEVICE).requires_grad_()
    hidden = raw["hidden"].to(KERNEL_DEVICE, torch.bfloat16).requires_grad_()
    copy = master.detach().bfloat16()
    FusedLinearWeightedCrossEntropy.apply(hidden, copy, targets, None, 6, master).backward()
    assert master.grad.dtype == torch.float32 and hidden.grad is not None
    assert not torch.equal(master.grad, master.grad.bfloat16().float())  # bits a BF16 gradient rounds off
    head = copy.clone().requires_grad_()
    FusedLinearWeightedCrossEntropy.apply(hidden.detach(), head, targets, None, 6).backward()
    assert head.grad.dtype == torch.bfloat16
    torch.testing.assert_close(head.grad, master.grad.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_a_frozen_head_takes_no_gradient_buffer_and_hidden_s_gradient_is_unchanged(path):
    """A head that does not train (LoRA's base, frozen embeddings) gets no [V, D] FP32 gradient kept from forward to
    backward, and no GEMM for it; the hidden states' gradient is the one a trained head's loss gives."""
    raw, targets = inputs(4, False)
    labels = targets.clone()

    def loss_of(head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if path == "fused":
            return FusedLinearWeightedCrossEntropy.apply(hidden, head, targets, None, 6)
        return chunked_cross_entropy_sum(hidden, head, labels, loss_chunk_tokens=6, fp32_loss=True)[0]

    grads = {}
    for trains in (True, False):
        head = raw["head"].to(KERNEL_DEVICE).clone().requires_grad_(trains)
        hidden = raw["hidden"].to(KERNEL_DEVICE).clone().requires_grad_()
        loss = loss_of(head, hidden)
        _, head_gradient = loss.grad_fn.saved_tensors  # what the op keeps for backward: hidden's and the head's
        assert (head_gradient.shape, head_gradient.dtype) == ((VOCAB, DIM), torch.float32) if trains else (
            head_gradient is None)
        loss.backward()
        grads[trains] = hidden.grad
        assert (head.grad is not None) == trains
    torch.testing.assert_close(grads[False], grads[True], rtol=0, atol=0)


def test_sft_loss_in_bf16_gives_an_fp32_head_its_gradient_unrounded():
    from cflib.ops.dispatch import KernelChoice
    from cflib.ops.sft_loss import SFTLoss

    raw, targets = inputs(4, False)
    head = raw["head"].to(KERNEL_DEVICE).requires_grad_()
    hidden = raw["hidden"].to(KERNEL_DEVICE)[None]
    loss, count = SFTLoss(KernelChoice(liger=True, custom=True))(hidden.bfloat16(), head, targets[None], 8, False)
    loss.backward()
    assert count == ROWS and head.grad.dtype == torch.float32
    assert not torch.equal(head.grad, head.grad.bfloat16().float())


def dft_reference(hidden, head, token_weights=None, *, labels):
    """DFT as TRL computes it (trl SFTTrainer, loss_type="dft"): -log p times p detached, on the full logits;
    ignored labels give 0."""
    log_p = -F.cross_entropy(hidden @ head.t(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    losses = -log_p * log_p.exp().detach()
    return (losses * token_weights).sum() if token_weights is not None else losses.sum()


@pytest.mark.parametrize("custom", [True, False], ids=["fused", "chunked"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dft_matches_the_full_logit_reference_forward_and_backward(dtype, weighted, custom):
    """The `dft` loss as a run names it: cflib's fused kernel, or the chunked reference where cflib's kernels are
    off, against float64 full logits, over labels with ignored rows and (2-D weighting) token weights."""
    from cflib.ops.dispatch import KernelChoice
    from cflib.ops.sft_loss import DFTLoss, make_loss

    raw, labels = inputs(7, weighted)
    labels = labels.clone()
    labels[::3] = IGNORE_INDEX  # unsupervised rows: no loss, no gradient
    rounded = {name: value.to(dtype) if name != "token_weights" else value for name, value in raw.items()}
    grad = ("hidden", "head")
    truth = run(lambda **t: dft_reference(**t, labels=labels),
                leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 2)
    loss = make_loss("dft", KernelChoice(liger=True, custom=custom))
    assert isinstance(loss, DFTLoss)

    def fast(hidden, head, token_weights=None):
        summed, count = loss(hidden, head, labels, 6, False, token_weights)
        assert count == int((labels != IGNORE_INDEX).sum())
        return summed
    got = run(fast, leaves(rounded, {}, KERNEL_DEVICE, grad), 2)
    assert loss.last_backend == ("cflib_triton_fused_linear_dft" if custom else "torch_chunked_linear_dft") + (
        "_weighted" if weighted else "")
    assert_matches(got, truth, dtype)
    assert not got["d_hidden"][::3].any()
    with torch.no_grad():  # the loss's own value without gradients (the chunked path computes it then)
        value, _ = loss(rounded["hidden"].to(KERNEL_DEVICE), rounded["head"].to(KERNEL_DEVICE), labels, 6, False,
                        None if not weighted else rounded["token_weights"].to(KERNEL_DEVICE))
    assert_matches({"out0": value}, {"out0": truth["out0"]}, dtype)
