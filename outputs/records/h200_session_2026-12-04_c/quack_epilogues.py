"""The TR-MoE block's SwiGLU with each element's route scale, as quack GEMM epilogues (Hopper; imported only where
quack-kernels runs, by cflib.ops.gemm).

Each element (token t, column j) of the block's activation is scaled by the shared output scale on shared columns
and by routed_output_scale x the route weights of t's routes to column j's expert on expert columns. The epilogue
reads that from two per-column vectors (`shared`: the shared scale or 0; `expert`: the column's expert, or one that
matches no route), two per-token vectors (each token's first and second route) and the two route weights times the
routed scale: scale = shared + sum over routes of weight x [expert == route]. The indicator of two integers held
in FP32 is relu(1 - (a - b)^2), exact, and costs no branch.

quack fingerprints an epilogue by its source and everything it calls, so these functions stay at module level.
"""
from __future__ import annotations

from quack.activation import dswiglu, relu, swiglu
from quack.epilogue import gemm_epilogue, pack, unpack
from quack.epilogue.ops import ColVecLoad, RowVecLoad, Scalar


def _operands() -> dict:
    return {"shared": RowVecLoad("shared"), "expert": RowVecLoad("expert"),
            "first_route": ColVecLoad("first_route"), "second_route": ColVecLoad("second_route"),
            "first_weight": Scalar("first_weight"), "second_weight": Scalar("second_weight")}


def _route_scale(shared, expert, first_route, second_route, first_weight, second_weight):
    first = expert - first_route
    second = expert - second_route
    return shared + first_weight * relu(1.0 - first * first) + second_weight * relu(1.0 - second * second)


@gemm_epilogue(outputs=("postact",), ops=_operands(), mode="acc_pair")
def routed_swiglu(acc, shared, expert, first_route, second_route, first_weight, second_weight):
    """Forward, over gate|up columns interleaved in pairs: D = the pre-activation, postact = silu(gate) * up *
    scale. Per-column vectors arrive paired here (both halves of a pair carry the column's value)."""
    gate, up = unpack(acc)
    shared_scale, _ = unpack(shared)
    column_expert, _ = unpack(expert)
    scale = _route_scale(shared_scale, column_expert, first_route, second_route, first_weight, second_weight)
    return {"D": pack(gate, up), "postact": swiglu(gate, up) * scale}


@gemm_epilogue(outputs=("postact",), ops=_operands(), mode="packed_cd_b16x2")
def routed_dswiglu(acc, c, shared, expert, first_route, second_route, first_weight, second_weight):
    """Backward: acc is the scaled activation's gradient of one (gate, up) pair, c that pair of the pre-activation.
    D = the pair's gradient, postact = the scaled activation recomputed (for the down weight's gradient)."""
    gate, up = unpack(c)
    scale = _route_scale(shared, expert, first_route, second_route, first_weight, second_weight)
    grad_gate, grad_up, out = dswiglu(gate, up, acc * scale)
    return {"D": pack(grad_gate, grad_up), "postact": out * scale}
