"""The derived buffers every written checkpoint carries for the published adapter (docs/export.md).

Per layer: `self_attn.rotary_emb.inv_freq` (from head_dim, rope_theta and rope_scaling), and
`mlp.engine.fused_expert_pairs` / `mlp.engine.fused_route_codes` (from the
layer's route table). cflib computes with none of them; it writes them because
the published adapter registers them as persistent buffers, and it checks them
when a checkpoint brings its own, since a wrong one silently changes that
adapter's outputs.
"""
from __future__ import annotations

from typing import Mapping

import torch

from cflib.model.config import ModelConfig
from cflib.model.rope import rope_inv_freq

INV_FREQ = "self_attn.rotary_emb.inv_freq"
EXPERT_PAIRS = "mlp.engine.fused_expert_pairs"
ROUTE_CODES = "mlp.engine.fused_route_codes"
ROUTE_TABLE = "mlp.engine.route_table"
DERIVED_SUFFIXES = (INV_FREQ, EXPERT_PAIRS, ROUTE_CODES)
# A stored inv_freq computed in float32 arithmetic differs from the float64-then-rounded one by an ulp or two.
INV_FREQ_RTOL = 1e-6


def empty_fused_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 2, dtype=torch.int32)


def fused_route_buffers(route_table: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_route_codes uint8 [V], fused_expert_pairs int32 [P, 2]) of one layer's [top_k, V] table.

    Pairs are every (a, b), a < b, of range(num_experts) in torch.combinations
    order; a token routed to (r0, r1) gets the index p of the pair {r0, r1},
    with a swap bit set when r0 is the larger expert: bit 3 while P <= 8, bit 5
    above. Defined for top-2 tables with distinct routes over 2..8 experts;
    anything else gets both buffers empty.
    """
    table = route_table.detach().to("cpu", torch.int64)
    if table.dim() != 2 or table.shape[0] != 2 or not 2 <= num_experts <= 8:
        return empty_fused_buffers()
    if table.numel() and (table.min() < 0 or table.max() >= num_experts):
        raise ValueError(f"routes to experts outside [0, {num_experts})")
    first, second = table
    if bool((first == second).any()):
        return empty_fused_buffers()
    pairs = torch.combinations(torch.arange(num_experts), r=2)
    pair_index = torch.zeros(num_experts, num_experts, dtype=torch.int64)
    pair_index[pairs[:, 0], pairs[:, 1]] = torch.arange(len(pairs))
    pair_index[pairs[:, 1], pairs[:, 0]] = torch.arange(len(pairs))
    swap_bit = 8 if len(pairs) <= 8 else 32
    codes = pair_index[first, second] | (first > second).long() * swap_bit
    return codes.to(torch.uint8), pairs.to(torch.int32)


def derived_buffers(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The three derived buffers of every layer, from the config and the route tables in `tensors`."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    out = {}
    for i in range(config.num_hidden_layers):
        table_name = f"layers.{i}.{ROUTE_TABLE}"
        try:
            codes, pairs = fused_route_buffers(tensors[table_name], config.num_experts)
        except ValueError as err:
            raise ValueError(f"{table_name}: {err}") from None
        out.update({f"layers.{i}.{INV_FREQ}": inv_freq.clone(), f"layers.{i}.{EXPERT_PAIRS}": pairs,
                    f"layers.{i}.{ROUTE_CODES}": codes})
    return out


def derived_disagreement(config: ModelConfig, name: str, given: torch.Tensor, tensors: Mapping[str, torch.Tensor]
                         ) -> str | None:
    """Why the stored derived buffer `name` is not what the config and route table give; None when it is.

    `tensors` holds the checkpoint's route tables (the authoritative source).
    """
    layer, suffix = name.split(".", 2)[1], name.split(".", 2)[2]
    table_name = f"layers.{layer}.{ROUTE_TABLE}"
    if suffix == INV_FREQ:
        want = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        scaled = f", rope_scaling {config.rope_scaling}" if config.rope_scaling is not None else ""
        source = f"rope_theta {config.rope_theta}{scaled} and head_dim {config.head_dim}"
    else:
        codes, pairs = fused_route_buffers(tensors[table_name], config.num_experts)
        want = codes if suffix == ROUTE_CODES else pairs
        source = table_name if suffix == ROUTE_CODES else f"num_experts {config.num_experts} and {table_name}"
    given = given.detach().to("cpu")
    if tuple(given.shape) != tuple(want.shape):
        return f"{name} has shape {list(given.shape)}, but {source} gives {list(want.shape)}"
    if given.dtype.is_floating_point != want.dtype.is_floating_point or given.dtype == torch.bool:
        return f"{name} has dtype {given.dtype}, expected {want.dtype}"
    if suffix == INV_FREQ:  # compared at the precision it is stored in: a BF16 checkpoint rounds it to BF16
        want = want.to(given.dtype) if given.dtype.is_floating_point else want
        wrong = ~torch.isclose(given.double(), want.double(), rtol=INV_FREQ_RTOL, atol=0.0)
    else:
        wrong = given.long() != want.long()
    if not bool(wrong.any()):
        return None
    first = int(wrong.nonzero()[0, 0])  # a token, a pair's row, or a frequency's index
    place = {ROUTE_CODES: "token", EXPERT_PAIRS: "row", INV_FREQ: "index"}[suffix]
    return (f"{name} disagrees with {source} at {place} {first} (it holds {given[first].tolist()}, "
            f"expected {want[first].tolist()})")
