"""LoRA adapters: the reference and the fused paths agree, a fresh adapter changes nothing, merging is exact.

The fused paths run cflib's Triton kernels: on the GPU where there is one, else in Triton's interpreter on the
CPU (tests/conftest.py); every model and batch here lives on KERNEL_DEVICE.
"""
from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import KERNEL_DEVICE, logits, random_ids, tiny_config

import cflib.model.lora as lora
from cflib.bench.memory import saved_for_backward
from cflib.model.decoder import TRMoEModel
from cflib.model.fast import use_kernels
from cflib.model.lora import (
    DORA_TARGETS,
    EXPERT_TARGETS,
    LINEAR_TARGETS,
    TARGETS,
    LoraSettings,
    adapter_parameter_count,
    adapter_state_dict,
    attach_lora,
    base_bytes,
    lora_kernel_path,
    merge_adapters,
)
from cflib.ops.dispatch import KernelChoice
from cflib.ops.sft_loss import SFTLoss

REFERENCE, PRODUCTION = KernelChoice(liger=False, custom=False), KernelChoice(liger=True, custom=True)


def adapted(settings: LoraSettings, seed: int = 0, trained: bool = True) -> TRMoEModel:
    """A tiny model with adapters; `trained`: B moved off zero, as after some steps."""
    torch.manual_seed(seed)
    model = TRMoEModel(tiny_config())
    attach_lora(model, settings)
    model.to(KERNEL_DEVICE)
    if trained:
        with torch.no_grad():
            for name, param in adapter_state_dict(model).items():
                if ".lora_B." in name:
                    param.normal_(0.0, 0.05)
    return model


def loss_and_grads(model: TRMoEModel, kernels: KernelChoice, ids: torch.Tensor, labels: torch.Tensor):
    use_kernels(model, kernels)
    model.zero_grad()
    loss, count = SFTLoss(kernels)(model(ids), model.head_weight, labels, 8, True)
    (loss / count).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def batch(model: TRMoEModel, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(model.config.vocab_size, 2, 12, seed=seed)
    labels = random_ids(model.config.vocab_size, 2, 12, seed=seed + 1)
    labels[:, :4] = -100
    return ids.to(KERNEL_DEVICE), labels.to(KERNEL_DEVICE)


def test_only_the_adapters_train_and_their_names_and_shapes_are_peft_s():
    model = adapted(LoraSettings(rank=4, alpha=8), trained=False)
    trainable = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name: tuple(p.shape) for name, p in adapter_state_dict(model).items()}
    assert trainable["layers.0.self_attn.q_proj.lora_A.weight"] == (4, 32)
    assert trainable["layers.0.self_attn.q_proj.lora_B.weight"] == (32, 4)
    assert trainable["layers.1.self_attn.k_proj.lora_B.weight"] == (16, 4)  # 2 kv heads x 8
    assert trainable["layers.0.mlp.engine.shared_down.lora_A.weight"] == (4, 48)
    assert trainable["layers.0.mlp.engine.expert_lora.expert_gate.lora_A.weight"] == (4, 4, 32)  # [E, r, in]
    assert trainable["layers.0.mlp.engine.expert_lora.expert_down.lora_B.weight"] == (4, 32, 4)  # [E, out, r]
    assert sum(n for n in map(lambda s: torch.Size(s).numel(), trainable.values())) == adapter_parameter_count(
        model.config, model.lora_settings)
    assert "embed_tokens.weight" in dict(model.named_parameters())  # kept, frozen
    # the base weights keep their public names
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.mlp.engine.expert_up"} <= set(model.state_dict())


def test_a_second_attach_is_refused():
    model = adapted(LoraSettings(), trained=False)
    with pytest.raises(ValueError, match="already carries"):
        attach_lora(model, LoraSettings())


@pytest.mark.parametrize("kernels", [REFERENCE, PRODUCTION], ids=["reference", "production"])
def test_a_fresh_adapter_is_exactly_the_base_model(kernels):
    torch.manual_seed(0)
    base = TRMoEModel(tiny_config()).to(KERNEL_DEVICE)
    model = attach_lora(copy.deepcopy(base), LoraSettings(rank=4, alpha=16))
    ids, _ = batch(base)
    use_kernels(base, kernels)
    use_kernels(model, kernels)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))


@pytest.mark.parametrize("targets", [tuple(TARGETS), ("q_proj", "v_proj"), ("o_proj", "shared_down", "expert_down"),
                                     EXPERT_TARGETS], ids=["all", "qv", "down", "experts"])
def test_production_path_matches_reference_with_effective_weights(targets):
    model = adapted(LoraSettings(rank=4, alpha=8, targets=targets))
    ids, labels = batch(model)
    ref_loss, ref_grads = loss_and_grads(model, REFERENCE, ids, labels)
    assert lora_kernel_path(model) == {"lora": "branch"}
    fast_loss, fast_grads = loss_and_grads(model, PRODUCTION, ids, labels)
    assert model.kernel_path()["moe"] == "triton_fused" and model.kernel_path()["qkv"] == "fused_gemm"
    assert lora_kernel_path(model) == {"lora": "effective_weight"}
    assert fast_loss == pytest.approx(ref_loss, abs=1e-5)
    assert set(fast_grads) == set(ref_grads) and ref_grads
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        assert ref_grads[name].abs().sum() > 0, name  # every adapter receives a gradient


def fixed_masks(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout whose mask depends on the input's shape only: both paths draw the same one."""
    if not (training and p > 0):
        return x
    generator = torch.Generator().manual_seed(hash(tuple(x.shape)) % 2**31)
    keep = (torch.rand(x.shape, generator=generator) >= p).to(x.device, x.dtype)
    return x * keep / (1 - p)


def fused_branches_match_reference(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Under dropout (fixed masks) the production path's separate branches give the reference's loss and gradients;
    the batch and the production loss, for what the test checks next."""
    ids, labels = batch(model)
    ref_loss, ref_grads = loss_and_grads(model, REFERENCE, ids, labels)
    fast_loss, fast_grads = loss_and_grads(model, PRODUCTION, ids, labels)
    assert lora_kernel_path(model) == {"lora": "separate_branch"}
    assert fast_loss == pytest.approx(ref_loss, abs=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    return ids, labels, fast_loss


def test_production_path_matches_reference_with_dropout(monkeypatch):
    monkeypatch.setattr(lora, "dropout_input", fixed_masks)
    model = adapted(LoraSettings(rank=4, alpha=8, dropout=0.3)).train()
    ids, labels, fast_loss = fused_branches_match_reference(model)
    monkeypatch.undo()  # real dropout: the masks differ, so the loss does, but training mode alone decides it
    torch.manual_seed(1)
    dropped, _ = loss_and_grads(model, PRODUCTION, ids, labels)
    assert dropped != pytest.approx(fast_loss, abs=1e-6)
    model.eval()
    with torch.no_grad():
        evaluated = model(ids)
        use_kernels(model, REFERENCE)
        torch.testing.assert_close(model(ids), evaluated, rtol=1e-5, atol=1e-5)


def test_the_frozen_base_gets_no_gradient_on_either_path():
    model = adapted(LoraSettings(rank=2, dropout=0.1))
    ids, labels = batch(model)
    for kernels in (REFERENCE, PRODUCTION):
        loss_and_grads(model, kernels, ids, labels)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("kernels", [REFERENCE, PRODUCTION], ids=["reference", "production"])
def test_merged_weights_give_the_adapted_model_s_logits(kernels):
    model = adapted(LoraSettings(rank=4, alpha=12)).eval()
    ids, _ = batch(model, seed=3)
    use_kernels(model, kernels)
    with torch.no_grad():
        expected = logits(model, ids)
    torch.manual_seed(0)
    plain = TRMoEModel(tiny_config()).to(KERNEL_DEVICE).eval()  # the same base weights: the same seed, nothing attached
    merge_adapters(plain, {k: v.detach() for k, v in adapter_state_dict(model).items()}, model.lora_settings)
    use_kernels(plain, kernels)
    with torch.no_grad():
        torch.testing.assert_close(logits(plain, ids), expected, rtol=0, atol=1e-5)
        assert (logits(plain, ids) - logits(TRMoEModel(tiny_config()).to(KERNEL_DEVICE).eval(), ids)).abs().max() > 1e-3


def test_rslora_scales_by_alpha_over_sqrt_rank_on_every_path_and_in_the_merge():
    """lora_scaling rslora: alpha / sqrt(r). Rank 4, alpha 8 under rsLoRA is rank 4, alpha 16 under the standard
    scale: the same adapters give the same logits on the reference and the fused paths, and merge the same."""
    rslora, standard = LoraSettings(rank=4, alpha=8, scaling="rslora"), LoraSettings(rank=4, alpha=16)
    assert rslora.scale == standard.scale == 4.0 and LoraSettings(rank=4, alpha=8).scale == 2.0
    model, twin = adapted(rslora).eval(), adapted(standard).eval()  # one seed: the same base and adapters
    ids, _ = batch(model, seed=4)
    for kernels in (REFERENCE, PRODUCTION):
        use_kernels(model, kernels)
        use_kernels(twin, kernels)
        with torch.no_grad():
            torch.testing.assert_close(logits(model, ids), logits(twin, ids), rtol=0, atol=1e-6)
    assert lora_kernel_path(model) == {"lora": "effective_weight"}
    torch.manual_seed(0)
    plain = TRMoEModel(tiny_config()).to(KERNEL_DEVICE).eval()
    merge_adapters(plain, {k: v.detach() for k, v in adapter_state_dict(model).items()}, rslora)
    use_kernels(plain, REFERENCE)
    use_kernels(model, REFERENCE)
    with torch.no_grad():
        torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=0, atol=1e-5)


def test_lora_settings_record_their_scaling_and_older_ones_read_as_standard():
    saved = LoraSettings(rank=16, alpha=4, scaling="rslora").to_dict()
    assert saved["scaling"] == "rslora" and LoraSettings.from_dict(saved).scale == 1.0
    older = {k: v for k, v in LoraSettings(rank=16, alpha=4).to_dict().items() if k != "scaling"}
    assert LoraSettings.from_dict(older).scaling == "standard" and LoraSettings.from_dict(older).scale == 0.25
    with pytest.raises(ValueError, match="LoRA scaling must be one of"):
        LoraSettings(scaling="sqrt")


def dora_adapted(settings: LoraSettings, seed: int = 0) -> TRMoEModel:
    """adapted(), its magnitudes moved off the base's row norms too, as after some steps."""
    model = adapted(settings, seed)
    with torch.no_grad():
        for name, param in adapter_state_dict(model).items():
            if name.endswith(".lora_magnitude_vector"):
                param.mul_(1 + 0.2 * torch.randn_like(param))
    return model


def test_a_fresh_dora_adapter_starts_at_the_base_s_row_norms_and_changes_nothing():
    settings = LoraSettings(rank=4, alpha=8, dora=True, targets=LINEAR_TARGETS)
    model = adapted(settings, trained=False)
    torch.manual_seed(0)
    base = TRMoEModel(tiny_config()).to(KERNEL_DEVICE)
    q = model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q.lora_magnitude_vector, base.layers[0].self_attn.q_proj.weight.norm(dim=1))
    trainable = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    assert trainable["layers.0.self_attn.q_proj.lora_magnitude_vector"] == (32,)  # PEFT's saved name, [out]
    assert trainable["layers.1.mlp.engine.shared_down.lora_magnitude_vector"] == (32,)
    assert sum(torch.Size(s).numel() for s in trainable.values()) == adapter_parameter_count(model.config, settings)
    ids, _ = batch(model)
    for kernels in (REFERENCE, PRODUCTION):
        use_kernels(base, kernels)
        use_kernels(model, kernels)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("targets", [LINEAR_TARGETS, ("q_proj", "v_proj"), ("o_proj", "shared_down")],
                         ids=["linear", "qv", "down"])
def test_dora_production_path_matches_reference_with_effective_weights(targets):
    """DoRA folds into one weight per forward, m * (W + sBA) / ||W + sBA|| (the norm detached): the fused paths'
    loss and every gradient (the magnitudes' too) are the reference branch's."""
    model = dora_adapted(LoraSettings(rank=4, alpha=8, dora=True, targets=targets))
    ids, labels = batch(model)
    ref_loss, ref_grads = loss_and_grads(model, REFERENCE, ids, labels)
    fast_loss, fast_grads = loss_and_grads(model, PRODUCTION, ids, labels)
    assert lora_kernel_path(model) == {"lora": "effective_weight"}
    assert fast_loss == pytest.approx(ref_loss, abs=1e-5)
    assert any(name.endswith(".lora_magnitude_vector") for name in ref_grads)
    assert set(fast_grads) == set(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        assert ref_grads[name].abs().sum() > 0, name


def test_dora_production_path_matches_reference_with_dropout(monkeypatch):
    """With dropout the fused paths add PEFT's DoRA branch, (f - 1) W x' + f s B A x' on the dropped input, beside
    the base GEMM (the shared projections' inside the fused SwiGLU block too)."""
    monkeypatch.setattr(lora, "dropout_input", fixed_masks)
    model = dora_adapted(LoraSettings(rank=4, alpha=8, dropout=0.3, dora=True, targets=LINEAR_TARGETS)).train()
    ids, _, _ = fused_branches_match_reference(model)
    model.eval()  # no dropout: the branch is the effective weight's
    with torch.no_grad():
        evaluated = model(ids)
        use_kernels(model, REFERENCE)
        torch.testing.assert_close(model(ids), evaluated, rtol=1e-5, atol=1e-5)


def test_dora_norm_is_detached_and_the_merge_gives_the_adapted_logits():
    """The row norm of W + sBA takes no gradient (the paper's section 4.3, PEFT's): the factors' gradients are those
    of m / ||.|| held constant, not of the norm's own; merging writes m * (W + sBA) / ||W + sBA|| into the base."""
    settings = LoraSettings(rank=4, alpha=8, dora=True, targets=("q_proj", "shared_up"))
    model = dora_adapted(settings).eval()
    q = model.layers[0].self_attn.q_proj
    x, upstream = torch.randn(5, 32, device=KERNEL_DEVICE), torch.randn(5, 32, device=KERNEL_DEVICE)
    (q(x) * upstream).sum().backward()
    grads = {}
    for detached in (True, False):
        a, b, m = (t.detach().clone().requires_grad_() for t in (q.lora_A.weight, q.lora_B.weight,
                                                                   q.lora_magnitude_vector))
        direction = q.weight + b @ a * settings.scale
        norm = direction.norm(dim=1, keepdim=True)
        weight = m[:, None] * direction / (norm.detach() if detached else norm)
        ((x @ weight.T) * upstream).sum().backward()
        grads[detached] = (a.grad, b.grad, m.grad)
    for got, want in zip((q.lora_A.weight.grad, q.lora_B.weight.grad, q.lora_magnitude_vector.grad), grads[True]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (grads[False][0] - grads[True][0]).abs().max() > 1e-4  # a norm with a gradient would train otherwise
    ids, _ = batch(model, seed=5)
    with torch.no_grad():
        expected = logits(model, ids)
    torch.manual_seed(0)
    plain = TRMoEModel(tiny_config()).to(KERNEL_DEVICE).eval()
    merge_adapters(plain, {k: v.detach() for k, v in adapter_state_dict(model).items()}, settings)
    for kernels in (REFERENCE, PRODUCTION):
        use_kernels(plain, kernels)
        with torch.no_grad():
            torch.testing.assert_close(logits(plain, ids), expected, rtol=0, atol=1e-5)


def dora_layer_and_peft_s(out_features: int = 24, in_features: int = 40) -> tuple:
    """One linear layer under cflib's DoRA and the same under PEFT's (use_dora, its own DoraLinearLayer), with equal
    weights, factors and magnitudes (B and m moved off their starts, as after some steps)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    holder = torch.nn.Sequential()
    holder.add_module("proj", torch.nn.Linear(in_features, out_features, bias=False))
    base = copy.deepcopy(holder.proj).requires_grad_(False)
    ours = lora.DoraLinear(base, LoraSettings(rank=4, alpha=8, dora=True))
    theirs = peft.get_peft_model(holder, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["proj"]))
    with torch.no_grad():
        ours.lora_B.weight.normal_(0.0, 0.1)
        ours.lora_magnitude_vector.mul_(1 + 0.2 * torch.randn(out_features))
        peft_layer = theirs.base_model.model.proj
        peft_layer.lora_A["default"].weight.copy_(ours.lora_A.weight)
        peft_layer.lora_B["default"].weight.copy_(ours.lora_B.weight)
        peft_layer.lora_magnitude_vector["default"].weight.copy_(ours.lora_magnitude_vector)
    factors = {"A": (ours.lora_A.weight, peft_layer.lora_A["default"].weight),
               "B": (ours.lora_B.weight, peft_layer.lora_B["default"].weight),
               "magnitude": (ours.lora_magnitude_vector, peft_layer.lora_magnitude_vector["default"].weight)}
    return ours, theirs, factors


@pytest.mark.parametrize("form", ["branch", "effective_weight"])
def test_dora_gradients_are_peft_s_on_the_reference_branch_and_the_folded_weight(form):
    """PEFT's DoraLinearLayer holds ||W + sBA|| constant in backward (the paper's section 4.3): cflib's DoRA gives
    its outputs and its gradients of A, B and the magnitude, as the reference branch and as the effective weight
    the fused paths fold (its own backward)."""
    ours, theirs, factors = dora_layer_and_peft_s()
    x, upstream = torch.randn(2, 7, 40), torch.randn(2, 7, 24)
    mine = ours(x) if form == "branch" else torch.nn.functional.linear(x, ours.effective_weight())
    (mine * upstream).sum().backward()
    (theirs(x) * upstream).sum().backward()
    torch.testing.assert_close(mine, theirs(x), rtol=0, atol=1e-5)
    for name, (cflib_param, peft_param) in factors.items():
        assert peft_param.grad.abs().sum() > 0, name
        torch.testing.assert_close(cflib_param.grad, peft_param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_dora_weight_s_backward_is_the_expression_s_gradient_in_float64():
    """DoraWeight's hand-written backward against finite differences of its forward, in float64 (the norm a
    constant, as in forward: gradcheck perturbs it too, so the check holds the norm's inputs apart)."""
    torch.manual_seed(0)
    weight, a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), torch.randn(
        6, 3, dtype=torch.float64)
    magnitude = torch.rand(6, dtype=torch.float64) + 0.5
    grad = torch.randn(6, 5, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (weight, a, b, magnitude)]
    (lora.DoraWeight.apply(*inputs, 0.7) * grad).sum().backward()
    expected = [t.clone().requires_grad_() for t in (weight, a, b, magnitude)]
    w, a_, b_, m = expected
    update = (b_ @ a_) * 0.7
    direct = (m / torch.linalg.norm(w + update, dim=1).detach()).unsqueeze(1) * (w + update)
    (direct * grad).sum().backward()
    for name, mine, theirs in zip(("weight", "A", "B", "magnitude"), inputs, expected):
        assert mine.grad.dtype == torch.float64, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_dora_s_folded_weight_keeps_no_more_for_backward_than_lora_s(base_dtype):
    """The folded DoRA weight keeps W, A, B and two numbers per output feature for backward, not W + sBA: a layer
    saves what LoRA's saves (its input and the effective weight the GEMM read) and two [out] vectors."""
    x = torch.randn(16, 40, requires_grad=True)  # a layer's input, as in a model

    def folded(cls: type) -> int:
        torch.manual_seed(0)
        base = torch.nn.Linear(40, 24, bias=False).requires_grad_(False).to(base_dtype)
        layer = cls(base, LoraSettings(rank=4, alpha=8, dora=cls is lora.DoraLinear))
        return saved_for_backward(
            layer, lambda: torch.nn.functional.linear(x.to(base_dtype), layer.effective_weight().to(base_dtype)))[0]

    plain, dora = folded(lora.LoraLinear), folded(lora.DoraLinear)
    assert plain >= 24 * 40 * base_dtype.itemsize  # LoRA's GEMM keeps the weight it read: not a parameter
    assert dora - plain <= 2 * 24 * 4  # the norms and m / ||.||, fp32 [out] each


def test_dora_settings_refuse_the_expert_tensors_default_to_the_linear_ones_and_older_ones_read_as_plain_lora():
    saved = LoraSettings(rank=4, dora=True, targets=("q_proj",)).to_dict()
    assert saved["dora"] is True and LoraSettings.from_dict(saved).dora
    assert LoraSettings.from_dict({k: v for k, v in saved.items() if k != "dora"}).dora is False
    with pytest.raises(ValueError, match=r"DoRA adapts the linear targets only .*\['expert_up'\]"):
        LoraSettings(dora=True, targets=("q_proj", "expert_up"))
    assert LoraSettings(dora=True).targets == DORA_TARGETS == LoraSettings.from_dict({"dora": True}).targets


def test_base_dtype_bfloat16_holds_the_frozen_matrices_in_bf16_and_runs_under_autocast():
    model = adapted(LoraSettings(rank=4, base_dtype="bfloat16"))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["layers.0.mlp.engine.expert_down"] == torch.bfloat16
    assert dtypes["embed_tokens.weight"] == dtypes["norm.weight"] == torch.float32
    assert all(p.dtype == torch.float32 for p in adapter_state_dict(model).values())
    ids, labels = batch(model)
    for kernels in (REFERENCE, PRODUCTION):
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            loss, grads = loss_and_grads(model, kernels, ids, labels)
        assert torch.isfinite(torch.tensor(loss)) and all(g.dtype == torch.float32 for g in grads.values())


def test_trainable_token_rows_feed_the_input_and_the_tied_head_and_merge():
    settings = LoraSettings(rank=2, alpha=4, targets=("q_proj",), trainable_tokens=(3, 7, 11))
    model = adapted(settings, trained=False)
    delta = model.embed_tokens.token_adapter.trainable_tokens_delta
    assert delta.requires_grad and delta.shape == (3, 32)
    assert not model.embed_tokens.weight.requires_grad
    torch.manual_seed(0)
    base = TRMoEModel(tiny_config()).to(KERNEL_DEVICE).eval()
    ids, labels = batch(model)
    with torch.no_grad():  # the rows start as the base's: nothing changes
        assert torch.equal(model.eval()(ids), base(ids))
        delta.normal_()
    ref_loss, ref_grads = loss_and_grads(model, REFERENCE, ids, labels)
    fast_loss, fast_grads = loss_and_grads(model, PRODUCTION, ids, labels)
    assert fast_loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-5)  # a summed loss of ~130: rounding scales
    name = "embed_tokens.token_adapter.trainable_tokens_delta"
    torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5)
    assert (ref_grads[name].abs().sum(1) > 0).all()  # each row learns (as input or as an output of the head)
    merge_adapters(base, {k: v.detach() for k, v in adapter_state_dict(model).items()}, settings)
    with torch.no_grad():
        torch.testing.assert_close(logits(base, ids), logits(model.eval(), ids), rtol=0, atol=1e-5)
        assert torch.equal(base.embed_tokens.weight[[3, 7, 11]], delta)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["no_qk_norm", "qk_norm"])
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_base_bytes_are_the_frozen_base_s_bytes_as_attach_lora_holds_them(base_dtype, qk_norm):
    model = attach_lora(TRMoEModel(tiny_config(use_qk_norm=qk_norm)), LoraSettings(rank=2, base_dtype=base_dtype))
    frozen = [param for param in model.parameters() if not param.requires_grad]
    assert base_bytes(model.config, base_dtype) == sum(param.numel() * param.element_size() for param in frozen)
