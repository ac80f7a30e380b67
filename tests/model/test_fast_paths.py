"""The whole model on its fast paths (cflib.model.fast.use_kernels) against the same model on its PyTorch
reference: the loss and every parameter's gradient, and the kernels read back from every layer.

Each kernel alone is tested beside its reference in tests/ops/. Without a GPU the Triton kernels run in
Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE, random_ids, tiny_config

from cflib.model.decoder import TRMoEModel
from cflib.model.fast import use_kernels
from cflib.ops.dispatch import KernelChoice
from cflib.ops.loss import supervised_positions
from cflib.ops.rows import Rows
from cflib.ops.sft_loss import SFTLoss

DEVICE = KERNEL_DEVICE


def _loss_and_grads(model: TRMoEModel, kernels: KernelChoice, ids, labels, document_ids=None, token_weights=None):
    loss_fn = SFTLoss(kernels)
    use_kernels(model, kernels)
    loss, count = loss_fn(model(ids, document_ids), model.head_weight, labels, 8, True, token_weights=token_weights)
    model.zero_grad()
    (loss / count).backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, loss_fn.last_backend


def _model_and_rows() -> tuple[TRMoEModel, torch.Tensor, torch.Tensor]:
    """A tiny model on the device, two rows of 12 tokens, their labels with the first 4 of each unsupervised."""
    torch.manual_seed(0)
    model = TRMoEModel(tiny_config()).to(DEVICE)
    ids = random_ids(model.config.vocab_size, 2, 12).to(DEVICE)
    labels = random_ids(model.config.vocab_size, 2, 12, seed=1).to(DEVICE)
    labels[:, :4] = -100
    return model, ids, labels


def test_whole_model_production_path_matches_reference():
    model, ids, labels = _model_and_rows()
    ref_loss, ref_grads, ref_backend = _loss_and_grads(model, KernelChoice(liger=False, custom=False), ids, labels)
    fast_loss, fast_grads, fast_backend = _loss_and_grads(model, KernelChoice(liger=True, custom=True), ids, labels)
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
    ref = _loss_and_grads(model, KernelChoice(liger=False, custom=False), ids, labels, document_ids, weights)
    fast = _loss_and_grads(model, KernelChoice(liger=True, custom=True), ids, labels, document_ids, weights)
    assert (ref[2], fast[2]) == ("torch_chunked_linear_ce_weighted", "cflib_triton_fused_linear_ce_weighted")
    assert model.kernel_path()["rope"] == "cflib_qk_norm_rope"
    assert fast[0] == pytest.approx(ref[0], rel=1e-5)
    for name, grad in ref[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_production_path_on_the_supervised_rows_alone_matches_reference():
    """The trainer's production step: the last layer computes the supervised rows alone, padded as a CUDA graph
    pads them (entries repeating a position, weight and mask 0), and the fused loss takes them gathered: the
    reference's loss and gradients over every row."""
    model, ids, labels = _model_and_rows()
    ref_loss, ref_grads, _ = _loss_and_grads(model, KernelChoice(liger=False, custom=False), ids, labels)
    kernels = KernelChoice(liger=True, custom=True)
    use_kernels(model, kernels)
    supervised = supervised_positions(labels)
    count = supervised.numel()
    padded = torch.cat([supervised, supervised[:1].expand(5)])
    row_mask = torch.cat([torch.ones(count), torch.zeros(5)]).to(DEVICE)
    hidden = model(ids, rows=Rows(padded, row_mask))
    assert hidden.shape == (count + 5, model.config.hidden_size)
    loss, _ = SFTLoss(kernels)(hidden, model.head_weight, labels, 8, True, supervised=padded, row_mask=row_mask,
                            gathered=True)
    model.zero_grad()
    (loss / count).backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6, msg=name)


def test_under_bf16_the_supervised_rows_alone_give_the_every_row_gradients_on_the_fast_path():
    """Under BF16 autocast the FP32 stream's gradient reaches the last layer's gathered rows and is scattered
    back: the same gradients as the model computing every row, and the record names the stream and the rows."""
    model, ids, labels = _model_and_rows()
    use_kernels(model, KernelChoice(liger=True, custom=True))
    supervised, grads = supervised_positions(labels), []
    for rows in (None, Rows(supervised)):
        model.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            hidden = model(ids, rows=rows)
        hidden = hidden if rows is not None else hidden.reshape(-1, hidden.shape[-1])[supervised]
        hidden.float().square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.kernel_path()["last_layer_rows"] == "selected" and model.kernel_path()["residual"] == "float32"
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=2e-2, atol=1e-5, msg=name)
