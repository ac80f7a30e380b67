"""The TR-MoE block grouped by route: each token's GEMMs over the shared columns and its own experts' only.

The wide block (cflib.ops.trmoe) runs every expert on every token and zeroes the experts a token is not routed
to. At 200M (3,072 shared columns, 4 experts x 64, two routes a token) that is 3,328 columns where 3,200 carry
the token's function: about 3% of the step's GEMM FLOPs spent on zeros. A route table sends each vocabulary id
to a fixed set of experts with fixed weights, so the tokens fall into a few groups (at 200M the six pairs of
distinct experts). Sorted by group, each group is one dense problem with its own weights: the shared columns
and its experts' columns, the route weights and output scales folded into its down weight (exact by linearity,
as the wide block's column scale is). quack's varlen GEMMs run every group in one launch (rows split by
`cu_seqlens_m`, weight gradients split along K), with SwiGLU in the gate|up GEMM's epilogue forward and its
gradient in the down GEMM's epilogue backward.

Each call lays the groups' weights out from the block's (`group_weights`: every group holds the shared
columns, so they are six times the block's at 200M), and backward sums the groups' FP32 weight gradients back
into each weight's in one pass (`weight_gradients`). The block takes and gives its rows in group order
(`grouped_block`): the residual norms' kernels read and write them so at no cost (cflib.ops.add_rms_norm's
row orders); `grouped_trmoe_forward` gathers and scatters them around it instead. Off CUDA each group runs as
plain GEMMs in a loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cflib.ops.gemm import interleaved_swiglu


@dataclass(frozen=True)
class RouteGroups:
    """The groups of a route table: each token id's group, each group's experts and their coefficients.

    experts [G, K] lists a group's experts (K: the table's routes); a group with fewer distinct experts (a table
    routing a token twice to one expert) is padded with other experts at coefficient 0, so every group has the
    same width. coefficients [G, K]: routed_output_scale x the summed route weight of each."""
    group_of_token: torch.Tensor  # [V] int64
    experts: torch.Tensor  # [G, K] int64
    coefficients: torch.Tensor  # [G, K] float32

    @property
    def count(self) -> int:
        return self.experts.shape[0]


def route_groups(route_table: torch.Tensor, route_weights: list[float], num_experts: int,
                 routed_output_scale: float) -> RouteGroups:
    """The groups of `route_table` [K, V] (cflib.model.routing): token ids with the same experts at the same
    weights share one."""
    top_k, vocab = route_table.shape
    table = route_table.cpu()
    weight_of = torch.zeros(vocab, num_experts, dtype=torch.float64)
    for k, weight in enumerate(route_weights):
        weight_of.index_put_((torch.arange(vocab), table[k]), torch.full((vocab,), float(weight),
                                                                         dtype=torch.float64), accumulate=True)
    keys, group_of_token = torch.unique(weight_of, dim=0, return_inverse=True)
    experts, coefficients = [], []
    for key in keys:
        used = [e for e in range(num_experts) if key[e] != 0]
        padding = [e for e in range(num_experts) if key[e] == 0][:top_k - len(used)]
        experts.append(used + padding)
        coefficients.append([routed_output_scale * float(key[e]) if e in used else 0.0 for e in used + padding])
    return RouteGroups(group_of_token.to(route_table.device), torch.tensor(experts, device=route_table.device),
                       torch.tensor(coefficients, dtype=torch.float32, device=route_table.device))


WEIGHT_NAMES = ("shared_gate", "shared_up", "shared_down", "expert_gate", "expert_up", "expert_down")


def group_weights(weights: dict[str, torch.Tensor], groups: RouteGroups, shared_output_scale: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's gate|up [G, 2C, D] (gate and up rows interleaved pair by pair, as quack's SwiGLU epilogue
    reads them) and down [G, D, C] (its columns times their output scale), C = shared + K x expert width, in
    `dtype`, from cflib.ops.trmoe.engine_weights' tensors. Each weight is rounded to `dtype` once, as autocast
    rounds it, the scaled down columns after their scaling in FP32."""
    num_groups, top_k = groups.experts.shape
    _, hidden, width = weights["expert_gate"].shape

    def rows(shared: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:  # [G, C, D]
        routed = expert.to(dtype)[groups.experts].transpose(2, 3).reshape(num_groups, top_k * width, hidden)
        return torch.cat([shared.to(dtype).expand(num_groups, -1, -1), routed], dim=1)

    gate, up = rows(weights["shared_gate"], weights["expert_gate"]), rows(weights["shared_up"], weights["expert_up"])
    gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)
    scale = groups.coefficients.repeat_interleave(width, dim=1)[:, :, None]  # [G, K W, 1]
    routed_down = weights["expert_down"][groups.experts].reshape(num_groups, top_k * width, hidden).float() * scale
    shared_down = (weights["shared_down"].float() * shared_output_scale if shared_output_scale != 1.0
                   else weights["shared_down"])
    down = torch.cat([shared_down.to(dtype).expand(num_groups, -1, -1), routed_down.to(dtype).transpose(1, 2)], dim=2)
    return gate_up, down


def weight_gradients(grad_gate_up_t: torch.Tensor, grad_down: torch.Tensor, groups: RouteGroups,
                     shared_output_scale: float, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The FP32 gradient of each weight (engine_weights' names, `shapes` theirs) from its groups' gradients:
    grad_gate_up_t [G, D, 2C] (gate|up's, transposed as the varlen GEMM writes it) and grad_down [G, D, C],
    each summed over the groups that hold it, in one pass over each."""
    num_experts, hidden, width = shapes["expert_gate"]
    shared = shapes["shared_gate"][0]
    num_groups, top_k = groups.experts.shape
    experts = groups.experts.reshape(-1)
    pairs = grad_gate_up_t[:, :, :2 * shared].sum(0).view(hidden, shared, 2)  # [D, S, (gate, up)]
    routed = grad_gate_up_t[:, :, 2 * shared:].reshape(num_groups, hidden, top_k, width, 2)
    per_expert = torch.zeros(num_experts, hidden, width, 2, dtype=torch.float32, device=grad_down.device)
    per_expert.index_add_(0, experts, routed.transpose(1, 2).reshape(num_groups * top_k, hidden, width, 2))
    routed_down = grad_down[:, :, shared:].reshape(num_groups, hidden, top_k, width)
    routed_down = routed_down * groups.coefficients[:, None, :, None]
    expert_down = torch.zeros(num_experts, width, hidden, dtype=torch.float32, device=grad_down.device)
    expert_down.index_add_(0, experts, routed_down.permute(0, 2, 3, 1).reshape(num_groups * top_k, width, hidden))
    return {"shared_gate": pairs[:, :, 0].t(), "shared_up": pairs[:, :, 1].t(),
            "shared_down": grad_down[:, :, :shared].sum(0) * shared_output_scale,
            "expert_gate": per_expert[..., 0], "expert_up": per_expert[..., 1], "expert_down": expert_down}


@dataclass(frozen=True)
class GroupOrder:
    """A batch's tokens in group order: order [N] (position i holds token order[i]), position int32 [N] (token r
    sits at position[r]: the row order cflib.ops.add_rms_norm takes), bounds int32 [G + 1] (group g's rows are
    bounds[g]:bounds[g + 1])."""
    order: torch.Tensor
    position: torch.Tensor
    bounds: torch.Tensor


def group_order(groups: RouteGroups, token_ids: torch.Tensor) -> GroupOrder:
    """The tokens of token_ids [N] in group order, token order within a group; found on the device, with no
    read back to the host."""
    group = groups.group_of_token[token_ids]
    order = torch.argsort(group, stable=True)
    position = torch.empty_like(order, dtype=torch.int32)
    position[order] = torch.arange(order.numel(), dtype=torch.int32, device=order.device)
    # Counted by index_add, not bincount, which reads the largest id back to the host (no CUDA graph then).
    counts = torch.zeros(groups.count, dtype=torch.int64, device=token_ids.device).index_add_(
        0, group, torch.ones_like(group))
    bounds = torch.zeros(groups.count + 1, dtype=torch.int32, device=token_ids.device)
    bounds[1:] = torch.cumsum(counts, 0)
    return GroupOrder(order, position, bounds)


def _looped_forward(x: torch.Tensor, bounds: list[int], gate_up: torch.Tensor, down: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Off CUDA: each group's rows through its own GEMMs; (pre-activation, output)."""
    spans = list(enumerate(zip(bounds, bounds[1:])))
    preact = torch.cat([x[lo:hi] @ gate_up[g].t() for g, (lo, hi) in spans])
    hidden = interleaved_swiglu(preact)
    return preact, torch.cat([hidden[lo:hi] @ down[g].t() for g, (lo, hi) in spans])


def _looped_backward(x: torch.Tensor, bounds: list[int], preact: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, grad_out: torch.Tensor):
    """Off CUDA: (grad x, grad gate_up transposed [G, D, 2C], grad down [G, D, C]), the weights' in FP32."""
    spans = list(zip(bounds, bounds[1:]))
    with torch.enable_grad():
        leaf = preact.detach().float().requires_grad_()
        hidden = interleaved_swiglu(leaf)
        grad_hidden = torch.cat([grad_out[lo:hi] @ down[g] for g, (lo, hi) in enumerate(spans)])
        (grad_preact,) = torch.autograd.grad(hidden, leaf, grad_hidden.float())
    grad_preact = grad_preact.to(preact.dtype)
    grad_down = torch.stack([grad_out[lo:hi].float().t() @ hidden[lo:hi].detach().float() for lo, hi in spans])
    grad_gate_up_t = torch.stack([x[lo:hi].float().t() @ grad_preact[lo:hi].float() for lo, hi in spans])
    grad_x = torch.cat([grad_preact[lo:hi] @ gate_up[g] for g, (lo, hi) in enumerate(spans)])
    return grad_x, grad_gate_up_t, grad_down


def _quack_forward(x: torch.Tensor, bounds: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    from quack.gemm_interface import gemm, gemm_gated
    preact, hidden = gemm_gated(x, gate_up.transpose(1, 2), activation="swiglu", cu_seqlens_m=bounds, tuned=False)
    return preact, gemm(hidden, down.transpose(1, 2), cu_seqlens_m=bounds, tuned=False)


def _quack_backward(x: torch.Tensor, bounds: torch.Tensor, preact: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, grad_out: torch.Tensor):
    from quack.gemm_interface import gemm, gemm_dgated
    grad_preact, hidden = gemm_dgated(grad_out, down, preact, activation="swiglu", cu_seqlens_m=bounds, tuned=False)
    f32 = torch.float32
    grad_down = gemm(grad_out.t(), hidden, cu_seqlens_k=bounds, out_dtype=f32, tuned=False)
    del hidden
    grad_x = gemm(grad_preact, gate_up, cu_seqlens_m=bounds, tuned=False)
    grad_gate_up_t = gemm(x.t(), grad_preact, cu_seqlens_k=bounds, out_dtype=f32, tuned=False)
    return grad_x, grad_gate_up_t, grad_down


class GroupedSwiGLUDown(torch.autograd.Function):
    """x [N, D] in group order -> the block's output [N, D] in group order, each group's rows through its
    weights, laid out from the block's (`masters`, WEIGHT_NAMES' order) in x's dtype; each weight's gradient
    comes back in its own dtype from the groups' FP32 gradients. Backward keeps x, the pre-activation [N, 2C]
    and the groups' weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bounds: torch.Tensor, groups: RouteGroups, shared_output_scale: float,
                *masters: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        gate_up, down = group_weights(dict(zip(WEIGHT_NAMES, masters)), groups, shared_output_scale, x.dtype)
        ctx.on_quack = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        if ctx.on_quack:
            preact, out = _quack_forward(x, bounds, gate_up, down)
        else:
            ctx.bounds_list = bounds.tolist()
            preact, out = _looped_forward(x, ctx.bounds_list, gate_up, down)
        ctx.groups, ctx.shared_output_scale = groups, shared_output_scale
        ctx.masters = {name: (master.shape, master.dtype) for name, master in zip(WEIGHT_NAMES, masters)}
        ctx.save_for_backward(x, bounds, preact, gate_up, down)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, bounds, preact, gate_up, down = ctx.saved_tensors
        grad_out = grad_out.contiguous().to(x.dtype)
        if ctx.on_quack:
            grad_x, grad_gate_up_t, grad_down = _quack_backward(x, bounds, preact, gate_up, down, grad_out)
        else:
            grad_x, grad_gate_up_t, grad_down = _looped_backward(x, ctx.bounds_list, preact, gate_up, down, grad_out)
        needs = ctx.needs_input_grad[4:]
        grads = (weight_gradients(grad_gate_up_t, grad_down, ctx.groups, ctx.shared_output_scale,
                                  {name: shape for name, (shape, _) in ctx.masters.items()}) if any(needs) else {})
        return grad_x, None, None, None, *(grads[name].to(dtype).contiguous() if need else None
                                           for (name, (_, dtype)), need in zip(ctx.masters.items(), needs))


def grouped_block(weights: dict[str, torch.Tensor], groups: RouteGroups, shared_output_scale: float,
                  x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The TR-MoE block on x [N, D] whose rows are in group order (GroupOrder.bounds), its output in that
    order; `weights`: cflib.ops.trmoe.engine_weights'."""
    return GroupedSwiGLUDown.apply(x, bounds, groups, shared_output_scale, *(weights[name] for name in WEIGHT_NAMES))


def grouped_trmoe_forward(weights: dict[str, torch.Tensor], groups: RouteGroups, shared_output_scale: float,
                          x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The TR-MoE block on x [N, D] and token ids [N] in token order, x in its dtype or under autocast in
    autocast's: its rows gathered into group order and the output's scattered back."""
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    rows = group_order(groups, token_ids)
    out = grouped_block(weights, groups, shared_output_scale, x[rows.order], rows.bounds)
    return out[rows.position.long()]
