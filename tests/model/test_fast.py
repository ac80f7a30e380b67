"""The kernel choice picks each module's class: the swap, its way back, what the records read, and the checks."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import norm_rel
from tiny_models import KERNEL_DEVICE, random_ids, tiny_model

from cflib.errors import KernelUnavailable
from cflib.model.decoder import Attention, RMSNorm, TRMoEEngine
from cflib.model.fast import (
    AddRMSNorm,
    AddRMSNormKeptSum,
    EpilogueSwiGLUEngine,
    FusedAttention,
    FusedAttentionKeptQKV,
    FusedQKVAttention,
    FusedTRMoEEngine,
    LigerRMSNorm,
    LigerRopeAttention,
    LigerSwiGLUEngine,
    keep_activations,
    swap_class,
    use_kernels,
)
from cflib.ops.dispatch import KernelChoice, choose_kernels
from cflib.ops.qk_norm_rope import QK_PAIR_RATIO

REFERENCE, LIGER, CUSTOM = (KernelChoice(liger=False, custom=False), KernelChoice(liger=True, custom=False),
                            KernelChoice(liger=True, custom=True))


def classes(model) -> dict[str, type]:
    layer = model.layers[0]
    return {"norm": type(layer.input_layernorm), "attention": type(layer.self_attn),
            "qk_norm": type(layer.self_attn.q_norm), "engine": type(layer.mlp["engine"]), "final": type(model.norm)}


@pytest.mark.parametrize("kernels, expected", [
    (REFERENCE, {"norm": RMSNorm, "attention": Attention, "qk_norm": RMSNorm, "engine": TRMoEEngine,
                 "final": RMSNorm}),
    (LIGER, {"norm": LigerRMSNorm, "attention": LigerRopeAttention, "qk_norm": LigerRMSNorm,
             "engine": LigerSwiGLUEngine, "final": LigerRMSNorm}),
    (CUSTOM, {"norm": AddRMSNorm, "attention": FusedAttention, "qk_norm": LigerRMSNorm, "engine": FusedTRMoEEngine,
              "final": AddRMSNorm}),
    (KernelChoice(liger=True, custom=True, epilogue_swiglu=True), {
        "norm": AddRMSNorm, "attention": FusedAttention, "qk_norm": LigerRMSNorm, "engine": EpilogueSwiGLUEngine,
        "final": AddRMSNorm}),
], ids=["reference", "liger", "custom", "epilogue"])
def test_the_kernel_choice_picks_every_module_s_class_and_the_state_dict_stays(kernels, expected):
    model = tiny_model()
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    use_kernels(model, kernels)
    assert classes(model) == expected
    assert all(classes(model)["engine"] is type(layer.mlp["engine"]) for layer in model.layers)
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == names


def test_a_residual_norm_with_a_zero_weight_keeps_its_sum_and_its_gradients():
    """The residual norms' backward reads their output, which a zero weight zeroes: such a norm keeps the sum
    instead, so its gradients stay the reference's, within BF16's noise, not NaN."""
    model = tiny_model().to(KERNEL_DEVICE)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight[3] = 0.0
        model.norm.weight[0] = 0.0
    ids = random_ids(model.config.vocab_size, 2, 10).to(KERNEL_DEVICE)

    def gradients():  # under BF16 autocast, where the kept sum and the output differ
        model.zero_grad()
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            loss = model(ids).float().square().mean()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    before = gradients()
    use_kernels(model, CUSTOM)
    kept = [name for name, module in model.named_modules() if type(module) is AddRMSNormKeptSum]
    assert kept == ["layers.1.post_attention_layernorm", "norm"]
    assert type(model.layers[1].input_layernorm) is AddRMSNorm
    fast = gradients()
    for name, grad in before.items():
        # Two BF16 paths through the whole model differ by a few percent; a lost sum gives NaN, which fails
        assert norm_rel(fast[name], grad) < 0.1, name


def test_attention_whose_head_norms_q_and_k_cannot_recover_keeps_qkv_and_its_gradients():
    """QK-norm's backward recovers the normed heads from q and k; a zero weight, or a pair the rotation mixes
    too far apart, makes that attention keep qkv instead, its gradients the reference's within BF16's noise."""
    model = tiny_model(num_hidden_layers=3).to(KERNEL_DEVICE)
    half = model.config.head_dim // 2
    with torch.no_grad():
        model.layers[0].self_attn.q_norm.weight[1] = 0.0
        model.layers[2].self_attn.k_norm.weight[half + 2] = 1.5 * QK_PAIR_RATIO
    ids = random_ids(model.config.vocab_size, 2, 10).to(KERNEL_DEVICE)
    # Not the square's mean: the final norm's output has a fixed mean square, which leaves gradients of noise
    probe = torch.randn(2, 10, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def gradients():
        model.zero_grad()
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            (model(ids).float() * probe.to(KERNEL_DEVICE)).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    before = gradients()
    use_kernels(model, CUSTOM)
    assert [type(layer.self_attn) for layer in model.layers] == [FusedAttentionKeptQKV, FusedAttention,
                                                                 FusedAttentionKeptQKV]
    fast = gradients()
    assert model.kernel_path()["qk_norm_backward"] == "from_output+kept_qkv"
    for name, grad in before.items():
        assert norm_rel(fast[name], grad) < 0.1, name


def test_kept_swiglu_layers_keeps_the_first_layers_activation_and_records_say_so():
    model = use_kernels(tiny_model(num_hidden_layers=3).to(KERNEL_DEVICE), CUSTOM)
    ids = random_ids(model.config.vocab_size, 2, 10).to(KERNEL_DEVICE)

    def gradients():
        model.zero_grad()
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            model(ids).float().square().mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    recomputed = gradients()
    assert model.kernel_path()["swiglu_activation"] == "recomputed"
    keep_activations(model, 2)
    assert [layer.mlp["engine"].keep_activation for layer in model.layers] == [True, True, False]
    kept = gradients()
    assert model.kernel_path()["swiglu_activation"] == "kept+recomputed"
    for name, grad in recomputed.items():  # BF16 paths apart by a rounding of the activation at most
        assert norm_rel(kept[name], grad) < 2e-2, name
    with pytest.raises(ValueError, match="kept_swiglu_layers: 4 layers, the model has 3"):
        keep_activations(model, 4)


def test_without_qk_norm_the_fused_path_keeps_one_qkv_gemm():
    model = use_kernels(tiny_model(use_qk_norm=False), CUSTOM)
    assert type(model.layers[0].self_attn) is FusedQKVAttention


def test_the_same_model_swaps_back_to_the_reference_and_computes_the_same():
    model = tiny_model().to(KERNEL_DEVICE)
    ids = random_ids(model.config.vocab_size, 2, 10).to(KERNEL_DEVICE)
    with torch.no_grad():
        before = model(ids)
        use_kernels(model, CUSTOM)
        fast = model(ids)
        assert model.kernel_path()["moe"] == "triton_fused"
        use_kernels(model, REFERENCE)
        again = model(ids)
    assert classes(model)["engine"] is TRMoEEngine and model.kernel_path()["moe"] == "torch_dense"
    torch.testing.assert_close(again, before, rtol=0, atol=0)
    torch.testing.assert_close(fast, before, rtol=1e-4, atol=1e-5)


def test_kernel_path_reads_every_layer_and_says_where_they_differ():
    model = tiny_model().to(KERNEL_DEVICE)
    ids = random_ids(model.config.vocab_size, 1, 6).to(KERNEL_DEVICE)
    swap_class(model.layers[1].mlp["engine"], LigerSwiGLUEngine)
    with torch.no_grad():
        model(ids)
    path = model.kernel_path()
    assert path["swiglu"] == "liger+torch" and path["moe"] == "torch_dense"
    assert path["rmsnorm"] == "torch" and path["qkv"] == "three_gemms" and path["qk_norm"] == "torch"
    assert path["attention"] == "torch_sdpa"


def test_a_module_cannot_become_a_class_of_another_kind():
    model = tiny_model()
    with pytest.raises(TypeError, match="a RMSNorm cannot become a FusedTRMoEEngine"):
        swap_class(model.norm, FusedTRMoEEngine)


def test_no_forward_reads_a_flag_the_swap_wrote():
    """The fast classes carry no state of their own: the swap adds no attribute to any module."""
    model = tiny_model()
    before = {name: set(vars(module)) for name, module in model.named_modules()}
    use_kernels(model, CUSTOM)
    assert {name: set(vars(module)) for name, module in model.named_modules()} == before


QUACK_FLAGS = ("epilogue_swiglu", "quack_gemms")  # quack's GPU refinements of cflib's path, planned alike


@pytest.mark.parametrize("flag", QUACK_FLAGS)
def test_quacks_gemms_are_checked_before_any_step(monkeypatch, flag):
    # The custom kernels run on the CPU in Triton's interpreter; quack's GEMMs still need a GPU.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    with pytest.raises(KernelUnavailable, match=rf"{flag}: true, but .* \(use_custom_kernels\)"):
        choose_kernels("false", False, cpu, **{flag: "true"})
    with pytest.raises(KernelUnavailable, match=f"{flag}: true, but no GPU"):
        choose_kernels("true", False, cpu, **{flag: "true"})
    kernels = choose_kernels("true", False, cpu, **{flag: "auto"})  # auto says nothing of a GPU refinement on the CPU
    assert kernels.custom and not getattr(kernels, flag) and not any(flag in note for note in kernels.notes)


@pytest.mark.parametrize("flag", QUACK_FLAGS)
def test_auto_takes_quacks_gemms_only_with_the_bf16_weight_copies(monkeypatch, flag):
    """Where quack runs (a Hopper GPU, stood in for here), `auto` takes its GEMMs in runs that read the BF16
    weight copies, as they were measured, and says why it left them off elsewhere; `true` runs them either way."""
    import cflib.ops.dispatch as dispatch

    monkeypatch.setattr(dispatch, "triton_problem", lambda device, rocm_opt_in: None)
    monkeypatch.setattr(dispatch, "quack_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "check_attention", lambda *args: ())
    gpu = torch.device("cuda")
    assert getattr(choose_kernels("true", False, gpu, **{flag: "auto"}), flag)
    kernels = choose_kernels("true", False, gpu, weight_copies_problem="2 processes (auto: one)", **{flag: "auto"})
    assert not getattr(kernels, flag)
    assert f"{flag}: it reads the BF16 weight copies, off here (2 processes (auto: one))" in kernels.notes
    assert getattr(choose_kernels("true", False, gpu, weight_copies_problem="bf16 is off", **{flag: "true"}), flag)
    assert not getattr(choose_kernels("true", False, gpu, **{flag: "false"}), flag)
    other = next(name for name in QUACK_FLAGS if name != flag)
    assert not getattr(choose_kernels("true", False, gpu, **{flag: "true"}), other)  # each flag its own
