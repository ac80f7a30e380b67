"""The TR-MoE block grouped by route (cflib.ops.paired_experts) beside the block's formula, forward and backward.

The formula and its one-route-at-a-time reference are test_trmoe.py's; here each token runs only the shared
columns and its own experts', its group's weights gathered from the block's.
"""
from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from test_add_rms_norm import EPS
from test_add_rms_norm import reference as norm_reference
from test_trmoe import WEIGHTS, TOKENS, problem, reference, routed_twice_problem
from tiny_models import KERNEL_DEVICE

from cflib.ops.add_rms_norm import add_rms_norm
from cflib.ops.paired_experts import group_order, grouped_block, grouped_trmoe_forward, route_groups


def groups_of(engine):
    return route_groups(engine.route_table, engine.route_weights, engine.expert_gate.shape[0],
                        engine.routed_output_scale)


def test_the_released_routing_makes_the_six_pairs_of_distinct_experts():
    engine, _, _ = problem(0)
    groups = groups_of(engine)
    assert groups.count == 6
    assert sorted(map(tuple, groups.experts.tolist())) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert torch.all(groups.coefficients == 1.0)  # routed scale 2 x route weight 0.5
    for token, group in enumerate(groups.group_of_token.tolist()):
        assert set(groups.experts[group].tolist()) == set(engine.route_table[:, token].tolist())


def test_a_token_routed_twice_to_one_expert_gets_both_weights_and_a_padding_expert_at_zero():
    engine, _, _ = problem(1)
    engine.route_table[1, ::2] = engine.route_table[0, ::2]
    groups = groups_of(engine)
    group = groups.group_of_token[0]
    experts, coefficients = groups.experts[group].tolist(), groups.coefficients[group].tolist()
    assert experts[0] == int(engine.route_table[0, 0]) and experts[1] != experts[0]
    assert coefficients == [2.0, 0.0]
    distinct = {tuple(sorted(set(routes))) for routes in engine.route_table.t().tolist()}
    assert groups.count == len(distinct)
    assert torch.all(groups.coefficients.sum(1) == 2.0)  # routed scale 2 x both route weights


def test_group_order_sorts_tokens_stably_and_bounds_each_group():
    engine, _, token_ids = problem(2)
    groups = groups_of(engine)
    rows = group_order(groups, token_ids)
    order, bounds = rows.order, rows.bounds
    group = groups.group_of_token[token_ids][order]
    assert torch.all(group[1:] >= group[:-1])
    assert bounds[0] == 0 and bounds[-1] == token_ids.numel() and bounds.dtype == torch.int32
    for g in range(groups.count):
        members = order[bounds[g]:bounds[g + 1]]
        assert torch.all(groups.group_of_token[token_ids[members]] == g)
        assert torch.all(members[1:] > members[:-1])  # stable: token order within a group
    assert rows.position.dtype == torch.int32
    assert torch.equal(order[rows.position.long()], torch.arange(token_ids.numel(), device=order.device))


@pytest.mark.parametrize("routing", ["released", "top3_other_scales_routed_twice"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_grouped_block_matches_the_formula(dtype, routing):
    """As training runs it: fp32 weights, x in the compute dtype (on a GPU in BF16, quack's varlen GEMMs);
    forward and the gradient of x and of every weight."""
    if routing == "released":
        engine, raw, token_ids = problem(3)
    else:
        engine, raw, token_ids = routed_twice_problem(4)
    groups = groups_of(engine)
    rounded = {name: value.to(dtype if name == "x" else torch.float32) for name, value in raw.items()}
    grad = ("x", *WEIGHTS)
    truth = run(reference(engine, token_ids), leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad),
                5)
    got = run(lambda x, **weights: grouped_trmoe_forward(weights, groups, engine.shared_output_scale, x, token_ids),
              leaves(rounded, {}, KERNEL_DEVICE, grad), 5, autocast_dtype=dtype if dtype != torch.float32 else None)
    assert_matches(got, truth, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_between_two_residual_norms_the_block_runs_in_group_order(dtype):
    """As a decoder layer would run it: the norm before writes the block's input in group order, the block
    keeps that order, and the norm after reads the block's output in it; the same stream, outputs and
    gradients as the block in token order between the norms."""
    engine, raw, token_ids = problem(6)
    groups = groups_of(engine)
    gen = torch.Generator().manual_seed(7)
    hidden = raw["x"].shape[1]
    raw.update(h=torch.randn(TOKENS, hidden, generator=gen), w_before=torch.randn(hidden, generator=gen) * 0.1 + 1,
               w_after=torch.randn(hidden, generator=gen) * 0.1 + 1)
    block = reference(engine, token_ids)

    def in_token_order(h, x, w_before, w_after, **weights):
        stream, normed = norm_reference(h, x, w_before)
        return norm_reference(stream, block(normed, **weights), w_after)

    def in_group_order(h, x, w_before, w_after, **weights):
        rows = group_order(groups, token_ids)
        stream, normed = add_rms_norm(h, x, w_before, EPS, out_rows=rows.position)
        out = grouped_block(weights, groups, engine.shared_output_scale, normed, rows.bounds)
        return add_rms_norm(stream, out, w_after, EPS, delta_rows=rows.position)

    dtypes = {"x": dtype}
    rounded = {name: value.to(dtypes.get(name, torch.float32)) for name, value in raw.items()}
    grad = tuple(raw)
    truth = run(in_token_order, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 8)
    got = run(in_group_order, leaves(rounded, {}, KERNEL_DEVICE, grad), 8,
              autocast_dtype=dtype if dtype != torch.float32 else None)
    assert_matches(got, truth, dtype)
