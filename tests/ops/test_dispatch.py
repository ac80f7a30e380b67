"""What may run on this machine (cflib.ops.dispatch.choose_kernels) and the loss it dispatches (SFTLoss): each
choice's loss beside the full-logit reference, forward and backward.

Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops.dispatch import KernelChoice, KernelUnavailable, choose_kernels
from cflib.ops.sft_loss import SFTLoss
from cflib.ops.loss import IGNORE_INDEX, supervised_positions

CPU = torch.device("cpu")
DEVICE = KERNEL_DEVICE
PLANS = {"reference": KernelChoice(liger=False, custom=False), "liger": KernelChoice(liger=True, custom=False),
         "cflib": KernelChoice(liger=True, custom=True)}


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_auto_falls_back_on_cpu(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)  # the interpreter runs only when a fast path is required
    kernels = choose_kernels("auto", False, CPU)
    assert not kernels.liger and not kernels.custom
    assert any("no GPU" in note for note in kernels.notes)
    assert choose_kernels("false", False, CPU) == KernelChoice(False, False)


def test_on_cpu_each_kernel_family_is_interpreted_only_when_it_is_required(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    liger_only = choose_kernels("auto", True, CPU)  # Liger required: cflib's own kernels stay on PyTorch
    assert liger_only.liger and not liger_only.custom
    assert any(note.startswith("use_custom_kernels: no GPU") for note in liger_only.notes)
    custom_only = choose_kernels("true", False, CPU)
    assert custom_only.custom and custom_only.liger  # Liger's kernels are part of the fast path when it runs


def test_require_liger_names_the_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    with pytest.raises(KernelUnavailable, match="liger-kernel is not installed"):
        choose_kernels("false", True, DEVICE)
    kernels = choose_kernels("true", False, DEVICE)  # cflib's kernels alone still run
    assert kernels.custom and not kernels.liger


@pytest.mark.parametrize("kernels", [KernelChoice(liger=True, custom=False), KernelChoice(liger=True, custom=True)],
                         ids=["liger", "cflib"])
def test_fused_losses_take_host_computed_supervised_positions(kernels):
    """The loss as the trainer calls it (supervised positions computed where the batch is collated) equals the
    loss finding them itself, bit for bit, on Liger's and cflib's fused paths."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 12, 16, generator=gen).to(DEVICE)
    head = (torch.randn(40, 16, generator=gen) * 0.2).to(DEVICE)
    labels = torch.randint(0, 40, (2, 12), generator=gen)
    labels[:, :5] = -100
    results = []
    for supervised in (None, supervised_positions(labels).to(DEVICE)):
        h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        loss_fn = SFTLoss(kernels)
        loss, count = loss_fn(h, w, labels.to(DEVICE), 8, True, supervised=supervised)
        loss.backward()
        results.append({"loss": loss.detach(), "count": count, "d_hidden": h.grad, "d_head": w.grad,
                        "backend": loss_fn.last_backend})
    found, given = results
    assert found["count"] == given["count"] == 14 and found["backend"] == given["backend"]
    for name in ("loss", "d_hidden", "d_head"):
        assert torch.equal(found[name], given[name]), name


BACKENDS = {("reference", False): "torch_chunked_linear_ce", ("reference", True): "torch_chunked_linear_ce_weighted",
            ("liger", False): "liger_fused_linear_ce", ("liger", True): "torch_chunked_linear_ce_weighted",
            ("cflib", False): "cflib_triton_fused_linear_ce", ("cflib", True): "cflib_triton_fused_linear_ce_weighted"}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kernels", PLANS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_each_plans_loss_matches_the_full_logit_loss(dtype, kernels, weighted):
    """fp32 final hidden states and head, the head GEMM in the autocast dtype (fp32_loss off), a third of the
    labels unsupervised; Liger's fused loss takes no token weights, so weighted it leaves them to the reference."""
    gen = torch.Generator().manual_seed(len(kernels) + weighted)
    labels = torch.randint(0, 300, (2, 10), generator=gen)
    labels[torch.rand(2, 10, generator=gen) < 1 / 3] = IGNORE_INDEX
    labels = labels.to(DEVICE)
    raw = {"hidden": torch.randn(2, 10, 16, generator=gen), "head": torch.randn(300, 16, generator=gen) * 0.4}
    if weighted:
        raw["token_weights"] = torch.rand(2, 10, generator=gen) * 3
    loss_fn = SFTLoss(PLANS[kernels])

    def truth(hidden, head, token_weights=None):
        if dtype != torch.float32:  # the operands the head GEMM sees (their gradients passed straight through)
            hidden, head = (x + (x.to(dtype).double() - x).detach() for x in (hidden, head))
        losses = F.cross_entropy((hidden @ head.t()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none")
        return (losses * token_weights.flatten()).sum() if token_weights is not None else losses.sum()

    grad = ("hidden", "head")
    want = run(truth, leaves(raw, dict.fromkeys(raw, torch.float64), DEVICE, grad), 6)
    got = run(lambda **t: loss_fn(t["hidden"], t["head"], labels, 4, False, token_weights=t.get("token_weights"))[0],
              leaves(raw, {}, DEVICE, grad), 6, autocast_dtype=dtype if dtype != torch.float32 else None)
    assert loss_fn.last_backend == BACKENDS[kernels, weighted]
    assert_matches(got, want, dtype)
