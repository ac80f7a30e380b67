"""TRMoEModel: shapes, causality, padding, routing by id, checkpointing, bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cflib.model.fast
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEEngine, TRMoEModel
from cflib.model.fast import checkpoint_layers
from cflib.ops.rows import Rows

try:
    from tiny_models import random_ids, tiny_config, tiny_model
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import random_ids, tiny_config, tiny_model

ATOL = 1e-6
VOCAB = 50


def lm_loss(model: TRMoEModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-logit next-token loss, independent of cflib.ops.loss."""
    logits = model(input_ids) @ model.head_weight.t()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def gradients(model: TRMoEModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def expert_swiglu(engine: TRMoEEngine, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One routed expert on one token, written from docs/formats.md#the-tr-moe-model: down(silu(x gate) * (x up))."""
    return (F.silu(x @ engine.expert_gate[expert]) * (x @ engine.expert_up[expert])) @ engine.expert_down[expert]


def other_experts(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A route column using none of the experts in `routes` (needs 2 * top_k <= E)."""
    free = [e for e in range(num_experts) if e not in routes.tolist()]
    return torch.tensor(free[:routes.numel()], dtype=torch.int64)


def test_forward_returns_hidden_states() -> None:
    model = tiny_model()
    hidden = model(random_ids(VOCAB, 3, 7))
    assert hidden.shape == (3, 7, model.config.hidden_size)
    assert hidden.dtype == torch.float32
    assert bool(torch.isfinite(hidden).all())


@torch.no_grad()
def test_causality() -> None:
    model = tiny_model()
    ids = random_ids(VOCAB, 2, 10)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :6], before[:, :6], rtol=0, atol=ATOL)
    assert not torch.allclose(after[:, 6:], before[:, 6:], atol=1e-3)  # the change is visible later


@torch.no_grad()
def test_right_padding_leaves_real_positions_unchanged() -> None:
    model = tiny_model()
    short = random_ids(VOCAB, 1, 5, seed=1)
    long = random_ids(VOCAB, 1, 9, seed=2)
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.int64)], dim=1)
    batch = model(torch.cat([padded, long]))
    torch.testing.assert_close(batch[0, :5], model(short)[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(batch[1], model(long)[0], rtol=0, atol=ATOL)


@torch.no_grad()
def test_loaded_route_table_decides_the_experts() -> None:
    model = tiny_model()
    ids = torch.tensor([[3, 9, 4, 11, 7]])  # token 7 appears only at the last position
    before = model(ids)

    rerouted = tiny_model(seed=1)  # different init: every weight comes from the state dict
    state = model.state_dict()
    for i in range(model.config.num_hidden_layers):
        table = state[f"layers.{i}.mlp.engine.route_table"].clone()
        table[:, 7] = other_experts(table[:, 7], model.config.num_experts)
        state[f"layers.{i}.mlp.engine.route_table"] = table
    rerouted.load_state_dict(state)
    after = rerouted(ids)

    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=ATOL)
    assert not torch.allclose(after[:, 4], before[:, 4], atol=1e-4)
    # a token absent from the input is rerouted: nothing changes
    table = state["layers.0.mlp.engine.route_table"]
    table[:, 20] = other_experts(table[:, 20], model.config.num_experts)
    rerouted.load_state_dict(state)
    torch.testing.assert_close(rerouted(ids), after, rtol=0, atol=0)


def test_grad_checkpointing_matches_plain_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model().train()
    ids = random_ids(VOCAB, 2, 8)
    plain_loss = lm_loss(model, ids)
    plain_loss.backward()
    plain_grads = gradients(model)

    calls: list[int] = []
    real_checkpoint = cflib.model.fast.checkpoint

    def counting_checkpoint(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(cflib.model.fast, "checkpoint", counting_checkpoint)
    model.zero_grad(set_to_none=True)
    checkpoint_layers(model)
    ckpt_loss = lm_loss(model, ids)
    ckpt_loss.backward()

    assert len(calls) == model.config.num_hidden_layers  # checkpointing really ran
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["plain", "checkpointed"])
def test_chosen_rows_are_the_full_forward_s_rows_with_its_gradients(grad_ckpt: bool) -> None:
    """rows: the last layer computes only the chosen positions after its attention; their final hidden states
    and every parameter's gradient are the full forward's, packed documents included. Float64, so only the
    order of sums differs (the norms compute in fp32 whatever the input, so their weights' gradients differ
    by fp32 rounding)."""
    model = checkpoint_layers(tiny_model().double().train(), grad_ckpt)
    ids = random_ids(VOCAB, 3, 10)
    documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 10, [0] * 2 + [1] * 3 + [2] * 5])
    chosen = torch.tensor([17, 3, 4, 9, 25, 29, 12])
    grad = torch.randn(chosen.numel(), model.config.hidden_size, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    full = model(ids, documents).reshape(-1, model.config.hidden_size)[chosen]
    (full * grad).sum().backward()
    full_grads = gradients(model)
    model.zero_grad(set_to_none=True)
    picked = model(ids, documents, rows=Rows(chosen))
    (picked * grad).sum().backward()
    torch.testing.assert_close(picked, full, rtol=1e-12, atol=1e-12)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_only_the_last_layer_computes_just_the_chosen_rows() -> None:
    model = tiny_model()
    seen: list[tuple[int, ...]] = []
    for layer in model.layers:
        layer.mlp["engine"].register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    model(random_ids(VOCAB, 2, 8), rows=Rows(torch.tensor([1, 9, 15])))
    assert seen == [(2, 8, model.config.hidden_size), (3, model.config.hidden_size)]
    assert model.kernel_path()["last_layer_rows"] == "selected"
    model(random_ids(VOCAB, 2, 8))
    assert model.kernel_path()["last_layer_rows"] == "all"


def test_grad_checkpointing_is_off_in_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cflib.model.fast, "checkpoint", lambda *a, **k: pytest.fail("checkpoint called in eval"))
    model = checkpoint_layers(tiny_model()).eval()
    model(random_ids(VOCAB, 1, 4))


def test_bf16_autocast_is_close_to_fp32() -> None:
    model = tiny_model().train()
    ids = random_ids(VOCAB, 2, 12)

    def run(autocast: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(ids)
            loss = lm_loss(model, ids)
        loss.backward()
        return hidden.detach().float(), loss.detach(), gradients(model)

    hidden32, loss32, grads32 = run(False)
    hidden16, loss16, grads16 = run(True)
    assert not torch.equal(hidden16, hidden32)  # autocast really ran in bf16
    torch.testing.assert_close(hidden16, hidden32, rtol=0, atol=5e-2)
    torch.testing.assert_close(loss16, loss32, rtol=0, atol=1e-2)
    for name, grad in grads16.items():
        assert grad.dtype == torch.float32 and bool(torch.isfinite(grad).all()), name
        relative = (grad - grads32[name]).norm() / grads32[name].norm()
        assert relative < 0.1, (name, float(relative))


def test_kernel_path_is_read_back_after_forward() -> None:
    model = tiny_model()
    assert model.kernel_path() == {}  # nothing ran yet
    model(random_ids(VOCAB, 1, 3))
    path = model.kernel_path()
    assert path["moe"] == "torch_dense"
    assert set(path) >= {"attention", "rmsnorm", "rope", "moe"}


def strong_engine(config: ModelConfig, seed: int = 3) -> TRMoEEngine:
    """An engine whose experts are large enough that route weights move its output visibly."""
    torch.manual_seed(seed)
    engine = TRMoEEngine(config)
    with torch.no_grad():
        for param in (engine.expert_gate, engine.expert_up, engine.expert_down):
            param.normal_(0.0, 0.3)
    return engine


@torch.no_grad()
def test_engine_matches_the_tr_moe_formula_per_token() -> None:
    config = tiny_config(top_k_primary_weight=0.7, shared_output_scale=0.75, routed_output_scale=1.5)
    engine = strong_engine(config)
    x = torch.randn(6, config.hidden_size)
    token_ids = torch.tensor([0, 7, 13, 21, 42, 49])
    out = engine(x, token_ids)
    for n, token in enumerate(token_ids.tolist()):
        shared = engine.shared_down(F.silu(engine.shared_gate(x[n])) * engine.shared_up(x[n]))
        primary, second = engine.route_table[:, token].tolist()
        routed = 0.7 * expert_swiglu(engine, primary, x[n]) + 0.3 * expert_swiglu(engine, second, x[n])
        torch.testing.assert_close(out[n], 0.75 * shared + 1.5 * routed, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_primary_route_weight_changes_outputs() -> None:
    balanced = tiny_model(top_k_primary_weight=0.5)
    skewed = TRMoEModel(tiny_config(top_k_primary_weight=0.7)).eval()
    skewed.load_state_dict(balanced.state_dict())  # identical weights and route tables
    ids = random_ids(VOCAB, 2, 6)
    assert not torch.allclose(skewed(ids), balanced(ids), atol=1e-4)

    # In one engine the change is exactly routed_scale * (0.7 - 0.5) * (expert_first - expert_second).
    engine_b = strong_engine(tiny_config(top_k_primary_weight=0.5))
    engine_s = strong_engine(tiny_config(top_k_primary_weight=0.7))
    x = torch.randn(4, 32)
    tokens = torch.tensor([1, 2, 3, 4])
    delta = engine_s(x, tokens) - engine_b(x, tokens)
    for n, token in enumerate(tokens.tolist()):
        first, second = engine_b.route_table[:, token].tolist()
        expected = 2.0 * 0.2 * (expert_swiglu(engine_b, first, x[n]) - expert_swiglu(engine_b, second, x[n]))
        assert expected.abs().max() > 1e-2
        torch.testing.assert_close(delta[n], expected, rtol=1e-4, atol=1e-5)
