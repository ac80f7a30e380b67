"""BF16 weight copies (cflib.model.weight_copies): under BF16 autocast the fused GEMMs read them and compute what
autocast's per-forward casts compute, the forward and every gradient alike; a master moved in place is copied
again before the next forward, and one moved silently (as torch's fused AdamW moves it) after `refresh`."""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE, needs_quack_on_gpu, random_ids, tiny_config

from cflib.model.fast import attach_weight_copies, build_model, detach_weight_copies
from cflib.ops.dispatch import KernelChoice

PRODUCTION = KernelChoice(liger=True, custom=True)


def _models(use_qk_norm: bool = True, kernels: KernelChoice = PRODUCTION):
    """The production model twice, the same weights; the second reads weight copies."""
    torch.manual_seed(0)
    config = tiny_config(use_qk_norm=use_qk_norm)
    plain = build_model(config, kernels).to(KERNEL_DEVICE).train()
    copied = build_model(config, kernels).to(KERNEL_DEVICE).train()
    copied.load_state_dict(plain.state_dict())
    return plain, copied, attach_weight_copies(copied)


def _step(model, ids, bf16: bool = True) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model(ids)
    loss = (hidden.float() @ model.head_weight.t()).logsumexp(-1).mean()
    loss.backward()
    return loss.detach()


def _same(a: torch.Tensor, b: torch.Tensor, name: str = "", rtol: float = 1e-4) -> None:
    """Bitwise on the CPU; on a GPU within rounding, as FlashAttention's backward adds into dQ atomically, in an
    order that varies from run to run."""
    if a.device.type == "cpu":
        assert torch.equal(a, b), name
    else:
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-5 * float(a.abs().max()), msg=name)


def _assert_same(plain, copied, ids, bf16: bool = True) -> None:
    _same(_step(plain, ids, bf16), _step(copied, ids, bf16), "loss")
    for (name, a), b in zip(plain.named_parameters(), copied.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert b.grad.dtype == a.dtype, name
            # On a GPU the q|k|v, o and gate|up GEMMs write the copies' weight gradients in FP32, where the
            # casting path's write BF16 and cast: within one BF16 unit of each other.
            _same(a.grad, b.grad, name, rtol=2 ** -7)


@pytest.mark.parametrize("use_qk_norm", [True, False], ids=["qk-norm", "no-qk-norm"])
def test_the_fused_gemms_read_the_copies_and_compute_autocasts_numbers(use_qk_norm):
    plain, copied, copies = _models(use_qk_norm)
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _assert_same(plain, copied, ids)
    assert copied.kernel_path()["weights"] == "bf16_copies" and "weights" not in plain.kernel_path()
    assert len(copies.copies) == 4 * len(copied.layers)  # q|k|v, o, gate|up, down per layer
    assert all(copy.tensor.dtype == torch.bfloat16 for copy in copies.copies.values())


@needs_quack_on_gpu
def test_the_swiglu_gemms_read_interleaved_copies_and_compute_their_numbers_over_the_masters():
    """The TR-MoE block through the SwiGLU GEMMs (quack's on a GPU) reads gate|up interleaved row by row."""
    plain, copied, copies = _models(kernels=KernelChoice(liger=True, custom=True, epilogue_swiglu=True))
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _assert_same(plain, copied, ids)
    assert copied.kernel_path()["swiglu"] == "quack_gemm_swiglu" and copied.kernel_path()["weights"] == "bf16_copies"
    engine = copied.layers[0].mlp["engine"]
    gate_up = copies.copies["layers.0.mlp.gate_up"].tensor
    assert torch.equal(gate_up[0::2][:engine.shared_gate.weight.shape[0]], engine.shared_gate.weight.bfloat16())
    assert torch.equal(gate_up[1::2][:engine.shared_up.weight.shape[0]], engine.shared_up.weight.bfloat16())
    with torch.no_grad():  # evaluation reads the masters through cflib's kernel
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            copied(ids)
    assert engine.ran == {"swiglu": "triton_fused", "moe": "triton_fused", "weights": "fp32_masters",
                          "swiglu_activation": "recomputed"}


def test_a_master_changed_in_place_is_copied_again_before_the_next_forward():
    plain, copied, _ = _models()
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _step(copied, ids)
    with torch.no_grad():
        for model in (plain, copied):
            model.layers[1].mlp["engine"].expert_up.mul_(1.5)  # bumps its version counter
            model.layers[0].self_attn.k_proj.weight.add_(0.25)
    _assert_same(plain, copied, ids)


def test_a_silent_update_needs_refresh_as_the_fused_optimizer_step_calls_it():
    plain, copied, copies = _models()
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _step(copied, ids)
    for model in (plain, copied):
        model.layers[0].mlp["engine"].shared_down.weight.data.mul_(2.0)  # storage written, version unchanged
    with torch.no_grad(), torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
        stale = (plain(ids).float() - copied(ids).float()).abs().max() / plain(ids).float().abs().max()
    assert stale > 1e-2  # what refresh is for
    copies.refresh()
    _assert_same(plain, copied, ids)


def test_fp32_steps_read_the_masters():
    plain, copied, _ = _models()
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _assert_same(plain, copied, ids, bf16=False)
    assert copied.kernel_path()["weights"] == "fp32_masters"


def test_the_tied_heads_copy_gives_the_embedding_table_autocasts_gradient():
    plain, copied, _ = _models()
    copies = attach_weight_copies(copied, head=True)
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    grads = []
    for model, head in ((plain, lambda: plain.head_weight), (copied, lambda: copies.weight("head"))):
        model.zero_grad(set_to_none=True)
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            logits = model(ids) @ head().to(torch.bfloat16).t()
        logits.float().logsumexp(-1).mean().backward()
        grads.append(model.embed_tokens.weight.grad)
    assert grads[1].dtype == torch.float32
    _same(grads[0], grads[1])  # the lookup's gradient and the head's, summed


def test_modules_with_adapters_read_their_masters():
    from cflib.model.lora import LoraSettings, attach_lora

    plain, copied, _ = _models()
    for model in (plain, copied):
        torch.manual_seed(1)
        attach_lora(model, LoraSettings(rank=2))
        with torch.no_grad():  # updates that are not zero, the same in both
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _assert_same(plain, copied, ids)
    assert copied.kernel_path()["weights"] == "fp32_masters"


def test_a_first_write_under_inference_mode_leaves_the_copies_trainable():
    plain, copied, copies = _models()
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    with torch.inference_mode(), torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
        copied(ids)
    assert not any(copy.tensor.is_inference() for copy in copies.copies.values())
    _assert_same(plain, copied, ids)
    copies.refresh()


def test_refresh_of_stale_copies_rewrites_only_what_moved():
    _, copied, copies = _models()
    copies.refresh()
    written = {name: copy.tensor.clone() for name, copy in copies.copies.items()}
    engine = copied.layers[0].mlp["engine"]
    with torch.no_grad():
        engine.expert_gate.add_(1.0)  # a new version
        copied.layers[1].self_attn.o_proj.weight.data.add_(1.0)  # no new version: only a full refresh sees it
    copies.refresh(stale_only=True)
    moved = {name for name, copy in copies.copies.items() if not torch.equal(copy.tensor, written[name])}
    assert moved == {"layers.0.mlp.gate_up"}
    copies.refresh()
    assert torch.equal(copies.copies["layers.1.self_attn.o"].tensor,
                       copied.layers[1].self_attn.o_proj.weight.to(torch.bfloat16))


def test_detached_modules_read_their_masters_again():
    plain, copied, _ = _models()
    detach_weight_copies(copied)
    ids = random_ids(50, 2, 12).to(KERNEL_DEVICE)
    _assert_same(plain, copied, ids)
    assert "weights" not in copied.kernel_path()
