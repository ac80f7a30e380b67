"""cflib's TR-MoE kernel (cflib.ops.trmoe) beside the block's formula, forward and backward.

TR-MoE(x, t) = shared_output_scale * shared_swiglu(x) + routed_output_scale * sum_k w_k * expert[route_table[k, t]](x)
(docs/formats.md#the-tr-moe-model). The reference below runs only each token's routed experts, one route at a
time; the kernel runs every expert on every token with zero coefficients off its routes.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE, needs_quack_on_gpu, tiny_config

from cflib.model.decoder import TRMoEEngine
from cflib.ops.trmoe import (
    engine_weights,
    interleave_gate_up,
    kernel_layout,
    scaled_swiglu_backward_,
    trmoe_forward,
    trmoe_gated_forward,
)

TOKENS = 20
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "expert_gate", "expert_up", "expert_down")


def swiglu(x, gate, up, down):
    """down(silu(x @ gate) * (x @ up)) for [N, D] x with weights laid out as the checkpoint's."""
    return (F.silu(x @ gate) * (x @ up)) @ down


def reference(engine: TRMoEEngine, token_ids: torch.Tensor):
    routes = engine.route_table[:, token_ids].cpu()  # [top_k, N]

    def block(x, shared_gate, shared_up, shared_down, expert_gate, expert_up, expert_down):
        shared = swiglu(x, shared_gate.t(), shared_up.t(), shared_down.t())
        routed = torch.zeros_like(shared)
        for k, weight in enumerate(engine.route_weights):
            for n in range(x.shape[0]):
                e = int(routes[k, n])
                routed[n] += weight * swiglu(x[n:n + 1], expert_gate[e], expert_up[e], expert_down[e])[0]
        return engine.shared_output_scale * shared + engine.routed_output_scale * routed
    return block


def problem(seed: int, **config):
    """An engine (its routes and scales; the weights are the leaves) and random inputs and weights."""
    torch.manual_seed(seed)
    engine = TRMoEEngine(tiny_config(**config)).to(KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(seed)
    raw = {"x": torch.randn(TOKENS, engine.expert_gate.shape[1], generator=gen)}
    raw.update({name: torch.randn(tensor.shape, generator=gen) * 0.2
                for name, tensor in engine_weights(engine).items()})
    token_ids = torch.randint(0, engine.route_table.shape[1], (TOKENS,), generator=gen).to(KERNEL_DEVICE)
    return engine, raw, token_ids


def routed_twice_problem(seed: int, routes: int = 3):
    """Top-3 (or top-`routes`) with primary weight 0.6 (the rest shared by the others), other output scales, and
    every other token's last route its primary expert again: that expert gets both weights."""
    engine, raw, token_ids = problem(seed, num_experts_per_tok=routes, top_k_primary_weight=0.6,
                                     shared_output_scale=0.5, routed_output_scale=3.0)
    engine.route_table[routes - 1, ::2] = engine.route_table[0, ::2]
    return engine, raw, token_ids


def check(engine, raw, token_ids, dtype):
    """As training runs it: fp32 weights, x in the compute dtype, the GEMMs under autocast."""
    dtypes = {"x": dtype}
    rounded = {name: value.to(dtypes.get(name, torch.float32)) for name, value in raw.items()}
    grad = ("x", *WEIGHTS)
    truth = run(reference(engine, token_ids), leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad),
                5)
    got = run(lambda x, **weights: trmoe_forward(engine, x, token_ids, weights=weights),
              leaves(rounded, {}, KERNEL_DEVICE, grad), 5, autocast_dtype=dtype if dtype != torch.float32 else None)
    assert_matches(got, truth, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_released_routing_matches_the_formula(dtype):
    """Top-2, 0.5 / 0.5, shared scale 1 and routed scale 2, as the released 200M model routes."""
    engine, raw, token_ids = problem(0)
    assert engine.route_weights == [0.5, 0.5] and engine.routed_output_scale == 2.0
    check(engine, raw, token_ids, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unequal_route_weights_other_scales_and_a_token_routed_twice_to_one_expert(dtype):
    """routed_twice_problem's routing."""
    engine, raw, token_ids = routed_twice_problem(1)
    assert engine.route_weights == pytest.approx([0.6, 0.2, 0.2])
    check(engine, raw, token_ids, dtype)


def test_route_weights_other_than_a_primary_and_equal_others_are_refused():
    engine, raw, token_ids = problem(2, num_experts_per_tok=3, top_k_primary_weight=0.5)
    engine.route_weights = [0.5, 0.3, 0.2]
    with pytest.raises(ValueError, match="primary weight and equal others"):
        trmoe_forward(engine, raw["x"].to(KERNEL_DEVICE), token_ids)


@needs_quack_on_gpu
@pytest.mark.parametrize("routing", ["released", "top3_other_scales"])
def test_the_block_through_the_swiglu_gemms_matches_the_formula(routing):
    """The SwiGLU GEMMs' block (quack's epilogues on a GPU, their PyTorch form elsewhere) with the experts'
    per-token scales applied beside them, in BF16: forward and every gradient."""
    if routing == "released":
        engine, raw, token_ids = problem(3)
    else:
        engine, raw, token_ids = routed_twice_problem(4)
    check_bf16(trmoe_gated_forward, engine, raw, token_ids)


def check_bf16(block, engine, raw, token_ids):
    """`block` on x in BF16 and the FP32 weights under BF16 autocast, against the float64 formula: forward and
    every gradient."""
    rounded = {name: value.to(torch.bfloat16 if name == "x" else torch.float32) for name, value in raw.items()}
    grad = ("x", *WEIGHTS)
    truth = run(reference(engine, token_ids), leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad),
                5)
    got = run(lambda x, **weights: block(engine, x, token_ids, weights=weights),
              leaves(rounded, {}, KERNEL_DEVICE, grad), 5, autocast_dtype=torch.bfloat16)
    assert_matches(got, truth, torch.bfloat16)
    return rounded


@pytest.mark.parametrize("block", [trmoe_forward, pytest.param(trmoe_gated_forward, marks=needs_quack_on_gpu)],
                         ids=["fused", "swiglu_gemms"])
def test_a_block_that_keeps_its_activation_matches_the_formula(block):
    """Kept from forward for the down weight's gradient instead of recomputed in backward: forward and every
    gradient in BF16, as the recomputing block's."""
    engine, raw, token_ids = routed_twice_problem(8, routes=2)
    rounded = check_bf16(functools.partial(block, keep_activation=True), engine, raw, token_ids)
    columns = engine.shared_gate.weight.shape[0] + engine.expert_gate.shape[0] * engine.expert_gate.shape[2]
    kept = {flag: saved_shapes(engine, block, flag, rounded, token_ids).count((TOKENS, columns)) for flag in (0, 1)}
    assert kept[1] == kept[0] + 1  # the [N, C] activation, held for backward


def saved_shapes(engine, block, keep, tensors, token_ids) -> list[tuple[int, ...]]:
    """The shapes of the tensors the block's forward saves for backward."""
    weights = {name: tensors[name].to(KERNEL_DEVICE).requires_grad_() for name in WEIGHTS}
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            block(engine, tensors["x"].to(KERNEL_DEVICE), token_ids, weights=weights, keep_activation=bool(keep))
    return shapes


def test_the_backward_kernel_leaves_a_kept_activation_s_buffer_alone():
    """Without store_hidden the kernel writes the pre-activation's gradient as before and nothing over the
    activation's gradient, which a block that kept its activation no longer reads."""
    engine, raw, token_ids = problem(9)
    gen = torch.Generator().manual_seed(9)
    columns = engine.shared_gate.weight.shape[0] + engine.expert_gate.shape[0] * engine.expert_gate.shape[2]
    gate_up = torch.randn(TOKENS, 2 * columns, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    grad_hidden = torch.randn(TOKENS, columns, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    results = {}
    for store in (True, False):
        pre, grad = gate_up.clone(), grad_hidden.clone()
        scaled_swiglu_backward_(grad, pre, token_ids, engine.route_table, kernel_layout(engine), interleaved=False,
                                store_hidden=store)
        results[store] = pre, grad
    torch.testing.assert_close(results[False][0], results[True][0], rtol=0, atol=0)
    torch.testing.assert_close(results[False][1], grad_hidden, rtol=0, atol=0)
    assert not torch.equal(results[True][1], grad_hidden)


def test_interleaving_pairs_each_gate_row_with_its_up_row():
    gate_up = torch.arange(12.0).reshape(6, 2)  # gate rows 0-2, up rows 3-5
    assert interleave_gate_up(gate_up).tolist() == [[0, 1], [6, 7], [2, 3], [8, 9], [4, 5], [10, 11]]


@needs_quack_on_gpu
def test_the_swiglu_gemms_block_refuses_a_second_backward():
    """Backward writes the pre-activation's gradient over the saved pre-activation, so a second backward through
    the same graph must fail loudly instead of reading a gradient as a pre-activation."""
    engine, raw, token_ids = problem(5)
    weights = {name: raw[name].to(KERNEL_DEVICE).requires_grad_() for name in WEIGHTS}
    x = raw["x"].to(KERNEL_DEVICE, torch.bfloat16)
    with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
        out = trmoe_gated_forward(engine, x, token_ids, weights=weights)
    out.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
