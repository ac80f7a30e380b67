"""The TR-MoE block grouped by route (cflib.ops.paired_experts) beside the block's formula, forward and backward.

The formula and its one-route-at-a-time reference are test_trmoe.py's; here each token runs only the shared
columns and its own experts', its group's weights gathered from the block's.
"""
from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from test_trmoe import WEIGHTS, problem, reference, routed_twice_problem
from tiny_models import KERNEL_DEVICE

from cflib.ops.paired_experts import group_order, grouped_trmoe_forward, route_groups


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
    order, bounds = group_order(groups, token_ids)
    group = groups.group_of_token[token_ids][order]
    assert torch.all(group[1:] >= group[:-1])
    assert bounds[0] == 0 and bounds[-1] == token_ids.numel() and bounds.dtype == torch.int32
    for g in range(groups.count):
        rows = order[bounds[g]:bounds[g + 1]]
        assert torch.all(groups.group_of_token[token_ids[rows]] == g)
        assert torch.all(rows[1:] > rows[:-1])  # stable: token order within a group


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
