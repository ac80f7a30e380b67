"""The fast paths against the PyTorch reference, and the dispatch that chooses them.

Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from tiny_models import random_ids, tiny_config

from cflib.bench.components import COMPONENTS, TOLERANCES, Shape, shapes_for
from cflib.bench.validate import check, compare, validate
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.model.fast import use_kernels
from cflib.ops.dispatch import KernelPlan, KernelUnavailable, plan_kernels
from cflib.ops.sft_loss import SFTLoss
from cflib.ops.loss import supervised_positions
from cflib.train import prepare, train
from cflib.train.params import TrainParams

CPU = torch.device("cpu")
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else CPU
TINY = shapes_for(CPU)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.name)
def test_fast_path_matches_reference_forward_and_backward(component, dtype):
    rows, skipped = validate(DEVICE, dtypes=(dtype,), shapes=[TINY], components=[component])
    if skipped:
        pytest.skip(skipped[0]["reason"])
    check(rows)  # raises, naming every broken tolerance
    assert {r["tensor"] for r in rows} >= {"out"} and len(rows) >= 2  # the output and at least one gradient
    assert all(r["backend"] == component.backend for r in rows)


def test_a_broken_kernel_is_caught(monkeypatch):
    """The comparison can fail: a fast path off by 1% breaks the fp32 tolerance."""
    trmoe = next(c for c in COMPONENTS if c.name == "trmoe")
    broken = type(trmoe)(**{**trmoe.__dict__, "fast": lambda inputs: (lambda out, b: (out * 1.01, b))(
        *trmoe.fast(inputs))})
    rows = compare(broken, TINY, "float32", DEVICE)
    assert not any(r["passed"] for r in rows if r["tensor"] == "out")
    with pytest.raises(AssertionError, match="trmoe out"):
        check(rows)


def test_trmoe_kernel_takes_unequal_route_weights_and_repeated_routes():
    """Primary and other route weights differ, and a token routed twice to one expert gets both weights."""
    config = ModelConfig(**{**TINY.config.to_dict(), "num_experts_per_tok": 3, "top_k_primary_weight": 0.6})
    trmoe = next(c for c in COMPONENTS if c.name == "trmoe")

    def inputs(shape, gen, device):
        found = trmoe.inputs(shape, gen, device)
        found["route_table"] = found["route_table"].clone()
        found["route_table"][2, ::2] = found["route_table"][0, ::2]  # every other token: its primary expert twice
        return found

    rows = compare(dataclasses.replace(trmoe, inputs=inputs), Shape("routes", config, 2, 12), "float32", DEVICE)
    check(rows)


def _loss_and_grads(model: TRMoEModel, plan: KernelPlan, ids, labels, document_ids=None, token_weights=None):
    loss_fn = SFTLoss(plan)
    use_kernels(model, plan)
    loss, count = loss_fn(model(ids, document_ids), model.head_weight, labels, 8, True, token_weights=token_weights)
    model.zero_grad()
    (loss / count).backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, loss_fn.last_backend


def test_whole_model_production_path_matches_reference():
    torch.manual_seed(0)
    model = TRMoEModel(tiny_config()).to(DEVICE)
    ids = random_ids(model.config.vocab_size, 2, 12).to(DEVICE)
    labels = random_ids(model.config.vocab_size, 2, 12, seed=1).to(DEVICE)
    labels[:, :4] = -100
    ref_loss, ref_grads, ref_backend = _loss_and_grads(model, KernelPlan(liger=False, custom=False), ids, labels)
    fast_loss, fast_grads, fast_backend = _loss_and_grads(model, KernelPlan(liger=True, custom=True), ids, labels)
    path = model.kernel_path()
    assert path["moe"] == "triton_fused" and path["rmsnorm"] == "cflib_add_rmsnorm"
    assert path["rope"] == path["qk_norm"] == "cflib_qk_norm_rope"
    assert path["qkv"] == "fused_gemm" and (ref_backend, fast_backend) == ("torch_chunked_linear_ce",
                                                                           "cflib_triton_fused_linear_ce")
    assert fast_loss == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_and_weighted_production_path_matches_reference():
    """Packed windows (positions restart per document) and per-token weights through every fast path."""
    torch.manual_seed(0)
    model = TRMoEModel(tiny_config()).to(DEVICE)
    ids = random_ids(model.config.vocab_size, 2, 12).to(DEVICE)
    labels = random_ids(model.config.vocab_size, 2, 12, seed=1).to(DEVICE)
    document_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5], device=DEVICE)
    weights = torch.rand(2, 12, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 3
    ref = _loss_and_grads(model, KernelPlan(liger=False, custom=False), ids, labels, document_ids, weights)
    fast = _loss_and_grads(model, KernelPlan(liger=True, custom=True), ids, labels, document_ids, weights)
    assert (ref[2], fast[2]) == ("torch_chunked_linear_ce_weighted", "cflib_triton_fused_linear_ce_weighted")
    assert model.kernel_path()["rope"] == "cflib_qk_norm_rope"
    assert fast[0] == pytest.approx(ref[0], rel=1e-5)
    for name, grad in ref[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_auto_falls_back_on_cpu(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)  # the interpreter runs only when a fast path is required
    plan = plan_kernels("auto", False, CPU)
    assert not plan.liger and not plan.custom
    assert any("no GPU" in note for note in plan.notes)
    assert plan_kernels("false", False, CPU) == KernelPlan(False, False)


@pytest.mark.parametrize("flags, message", [
    ({"use_custom_kernels": "true"}, "use_custom_kernels: true, but no GPU"),
    ({"require_liger": True}, "require_liger: true, but no GPU"),
])
def test_required_fast_path_stops_before_training(monkeypatch, tmp_path, flags, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out_dir = tmp_path / "run"
    params = TrainParams.from_dict({"model": "smoke", "device": "cpu", "out_dir": str(out_dir), **flags})
    with pytest.raises(KernelUnavailable, match=message):
        prepare(params)
    assert not out_dir.exists()


def test_require_liger_names_the_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    with pytest.raises(KernelUnavailable, match="liger-kernel is not installed"):
        plan_kernels("false", True, DEVICE)
    plan = plan_kernels("true", False, DEVICE)  # cflib's kernels alone still run
    assert plan.custom and not plan.liger


def test_training_records_the_kernels_that_ran(tmp_path):
    record = train({"model": "smoke", "seq_len": 32, "micro_batch_per_rank": 2, "global_batch": 2, "max_steps": 2,
                    "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False,
                    "device": DEVICE.type, "out_dir": str(tmp_path / "run"),
                    "use_custom_kernels": "true", "require_liger": True}, progress=False)
    assert record["kernel_path"]["moe"] == "triton_fused"
    assert record["kernel_path"]["rmsnorm"] == "cflib_add_rmsnorm" and record["kernel_path"]["qk_norm"] == "cflib_qk_norm_rope"
    assert record["kernel_path"]["loss"] == "cflib_triton_fused_linear_ce"
    assert record["kernel_path"]["attention"] == "torch_sdpa"
    assert record["kernels_requested"] == {"use_custom_kernels": "true", "require_liger": True,
                                           "attention_backend": "auto", "notes": []}


def test_tolerances_are_stated_per_dtype():
    assert TOLERANCES["float32"] < TOLERANCES["bfloat16"] <= 2e-2


@pytest.mark.parametrize("plan", [KernelPlan(liger=True, custom=False), KernelPlan(liger=True, custom=True)],
                         ids=["liger", "cflib"])
def test_fused_losses_take_host_computed_supervised_positions(plan):
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
        loss_fn = SFTLoss(plan)
        loss, count = loss_fn(h, w, labels.to(DEVICE), 8, True, supervised=supervised)
        loss.backward()
        results.append({"loss": loss.detach(), "count": count, "d_hidden": h.grad, "d_head": w.grad,
                        "backend": loss_fn.last_backend})
    found, given = results
    assert found["count"] == given["count"] == 14 and found["backend"] == given["backend"]
    for name in ("loss", "d_hidden", "d_head"):
        assert torch.equal(found[name], given[name]), name
