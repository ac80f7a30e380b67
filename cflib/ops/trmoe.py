"""TR-MoE feed-forward as one wide SwiGLU: the shared branch and every expert side by side.

With a few narrow experts beside a wide shared branch (200M: 3,072 shared
columns, 4 experts x 64), running every expert on every token costs ~4% more
FLOPs than running only the routed ones, and removes every gather, scatter and
per-expert launch: the block becomes two dense GEMMs (cuBLAS) around one
Triton kernel, `silu(gate) * up * scale`, whose per-token column scale is the
shared output scale on shared columns and routed_output_scale x route weight
on each expert's columns (zero on experts the token is not routed to), read
by the kernel from the token ids and the route table. The output scales fold
into that kernel exactly, by linearity of the down projection. The
gather/grouped-GEMM/scatter design lost to this one on the H200 at the 200M
shapes (cflib/bench/trmoe_designs.py, docs/kernels.md).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from cflib.ops.gemm import TORCH_GEMMS, Gemms, gated_gemm, master_gradients
from cflib.ops.interpreter import INTERPRETING

# Tried on the device at first use per width (do_bench inside triton.autotune); one config in the interpreter.
_CONFIGS = [triton.Config({"BLOCK_R": 32, "BLOCK_C": 128}, num_warps=4)] if INTERPRETING else [
    triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
    for r, c, w in ((32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8), (8, 512, 4), (64, 256, 8))]


@triton.jit
def _column_scale(rows, cols, row_mask, token_ptr, route_ptr, shared_columns, expert_width, vocab_size,
                  shared_scale, routed_scale, primary_weight, other_weight, TOP_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each element's column scale: the shared output scale on shared columns; on expert e's columns
    routed_scale x the sum of the route weights of the token's routes to e (zero when none), read from the
    token id and the route table, as TRMoEEngine.expert_coefficients builds them."""
    routed = cols >= shared_columns
    expert = tl.where(routed, (cols - shared_columns) // expert_width, -1)
    token = tl.load(token_ptr + rows, mask=row_mask, other=0)
    route_weight = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        destination = tl.load(route_ptr + k * vocab_size + token, mask=row_mask, other=-2)
        if k == 0:
            weight = primary_weight
        else:
            weight = other_weight
        route_weight += tl.where(destination[:, None] == expert[None, :], weight, 0.0)
    return tl.where(routed[None, :], route_weight * routed_scale, shared_scale)


@triton.jit
def _tile(gate_up_ptr, token_ptr, route_ptr, num_rows, columns, shared_columns, expert_width, vocab_size,
          shared_scale, routed_scale, primary_weight, other_weight, HALF: tl.constexpr, TOP_K: tl.constexpr,
          INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: its mask, the offsets of its activation and gate|up elements, gate and up in fp32,
    and each element's column scale. gate|up is [N, 2C] of HALF, gate columns then up columns (up `columns` past
    each gate offset); or, INTERLEAVED, [N, C] 32-bit words, each a gate element (low half) beside its up
    element (high half), read in one load like the split layout."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < columns)[None, :]
    hidden_offsets = rows.to(tl.int64)[:, None] * columns + cols[None, :]
    if INTERLEAVED:
        gate_offsets = hidden_offsets
        words = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
        gate = (words & 0xFFFF).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
        up = (words >> 16).to(tl.uint16).to(HALF, bitcast=True).to(tl.float32)
    else:
        gate_offsets = rows.to(tl.int64)[:, None] * (2 * columns) + cols[None, :]
        gate = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + gate_offsets + columns, mask=mask, other=0.0).to(tl.float32)
    scale = _column_scale(rows, cols, row_mask, token_ptr, route_ptr, shared_columns, expert_width, vocab_size,
                          shared_scale, routed_scale, primary_weight, other_weight, TOP_K, BLOCK_R, BLOCK_C)
    return mask, hidden_offsets, gate_offsets, gate, up, scale


@triton.autotune(_CONFIGS, key=["columns"])
@triton.jit
def _scaled_swiglu_forward(gate_up_ptr, token_ptr, route_ptr, out_ptr, num_rows, columns, shared_columns,
                           expert_width, vocab_size, shared_scale, routed_scale, primary_weight, other_weight,
                           TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    mask, hidden_offsets, _, gate, up, scale = _tile(
        gate_up_ptr, token_ptr, route_ptr, num_rows, columns, shared_columns, expert_width, vocab_size,
        shared_scale, routed_scale, primary_weight, other_weight, out_ptr.dtype.element_ty, TOP_K, False, BLOCK_R,
        BLOCK_C)
    out = gate * tl.sigmoid(gate) * up * scale
    tl.store(out_ptr + hidden_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_swiglu_backward(grad_hidden_ptr, gate_up_ptr, token_ptr, route_ptr, num_rows, columns, shared_columns,
                            expert_width, vocab_size, shared_scale, routed_scale, primary_weight, other_weight,
                            TOP_K: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr, STORE_HIDDEN: tl.constexpr):
    """Writes d(gate) and d(up) over gate_up (laid out as it is), and (STORE_HIDDEN) the recomputed activation
    over grad_hidden, in place: each element is read before it is overwritten, and neither input is needed
    afterwards."""
    half = grad_hidden_ptr.dtype.element_ty
    mask, hidden_offsets, gate_offsets, gate, up, scale = _tile(
        gate_up_ptr, token_ptr, route_ptr, num_rows, columns, shared_columns, expert_width, vocab_size,
        shared_scale, routed_scale, primary_weight, other_weight, half, TOP_K, INTERLEAVED, BLOCK_R, BLOCK_C)
    grad = tl.load(grad_hidden_ptr + hidden_offsets, mask=mask, other=0.0).to(tl.float32) * scale
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if STORE_HIDDEN:
        tl.store(grad_hidden_ptr + hidden_offsets, (silu * up * scale).to(half), mask=mask)
    grad_gate = (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(half)
    grad_up = (grad * silu).to(half)
    if INTERLEAVED:
        low = grad_gate.to(tl.uint16, bitcast=True).to(tl.uint32)
        high = grad_up.to(tl.uint16, bitcast=True).to(tl.uint32)
        tl.store(gate_up_ptr + gate_offsets, ((high << 16) | low).to(tl.int32, bitcast=True), mask=mask)
    else:
        tl.store(gate_up_ptr + gate_offsets, grad_gate, mask=mask)
        tl.store(gate_up_ptr + gate_offsets + columns, grad_up, mask=mask)


def _grid(num_rows: int, columns: int):
    return lambda meta: (triton.cdiv(num_rows, meta["BLOCK_R"]), triton.cdiv(columns, meta["BLOCK_C"]))


# The backward kernel's BLOCK_R, BLOCK_C and warps, pinned: it works in place, so autotuning it would clone both of
# its buffers at the step's memory peak (the first backward is the top layer's). On the H200 at the 200M block's
# shapes every candidate tile but 64 x 256 timed within 1% of the best, this one (outputs/records/
# h200_session_2026-12-02_c/swiglu_tiles_h200.json).
BACKWARD_TILE = (16, 256, 4)


def scaled_swiglu_backward_(grad_hidden: torch.Tensor, gate_up: torch.Tensor, token_ids: torch.Tensor,
                            route_table: torch.Tensor, layout: tuple, interleaved: bool,
                            tile: tuple[int, int, int] = BACKWARD_TILE, store_hidden: bool = True) -> None:
    """In place: gate_up ([N, 2C], or interleaved [N, C] 32-bit words) becomes its gradient and grad_hidden [N, C]
    the scaled activation recomputed (_scaled_swiglu_backward; unless not `store_hidden`: a caller that kept the
    activation); `tile` is BLOCK_R, BLOCK_C, warps."""
    num_rows, columns = grad_hidden.shape
    block_r, block_c, warps = tile
    _scaled_swiglu_backward[_grid(num_rows, columns)](
        grad_hidden, gate_up, token_ids, route_table, num_rows, columns, *layout, TOP_K=route_table.shape[0],
        INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_C=block_c, STORE_HIDDEN=store_hidden, num_warps=warps)


class ScaledSwiGLUDown(torch.autograd.Function):
    """[N, 2C] gate|up -> (silu(gate) * up * column scale) @ down.T, keeping only gate|up for backward.

    The [N, C] activation between the kernel and the down GEMM is recomputed in
    backward instead of being held from forward to backward in every layer (at
    16 x 2,048 tokens that is 3.5 GB for the 200M model). The recomputation
    rides in the backward kernel, which reads gate|up anyway: backward computes
    the activation's gradient first (grad_out @ down) and the kernel turns that
    buffer into the activation as it consumes it, for the down weight's gradient.
    With `return_hidden` the activation is also an output (a caller's own branch
    on the down projection's input, e.g. a LoRA adapter with dropout), and its
    gradient joins the one from the down GEMM; a frozen `down` gets no gradient.
    With `keep` the activation is held for backward instead (faster, for the
    memory above), and the backward kernel does not write it.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, token_ids: torch.Tensor, route_table: torch.Tensor, down: torch.Tensor,
                layout: tuple, return_hidden: bool = False, keep: bool = False):
        gate_up, token_ids, route_table = gate_up.contiguous(), token_ids.contiguous(), route_table.contiguous()
        num_rows, columns = gate_up.shape[0], gate_up.shape[1] // 2
        hidden = torch.empty(num_rows, columns, dtype=gate_up.dtype, device=gate_up.device)
        _scaled_swiglu_forward[_grid(num_rows, columns)](gate_up, token_ids, route_table, hidden, num_rows, columns,
                                                         *layout, TOP_K=route_table.shape[0])
        ctx.save_for_backward(gate_up, token_ids, route_table, down, *((hidden,) if keep else ()))
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        out = hidden @ down.t()
        return (out, hidden) if return_hidden else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_hidden_out: torch.Tensor | None = None):
        gate_up, token_ids, route_table, down, *kept = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros(gate_up.shape[0], down.shape[0], dtype=gate_up.dtype, device=gate_up.device)
        grad_out = grad_out.contiguous().to(gate_up.dtype)
        grad_hidden = grad_out @ down
        if grad_hidden_out is not None:
            grad_hidden += grad_hidden_out.to(grad_hidden.dtype)
        scaled_swiglu_backward_(grad_hidden, gate_up, token_ids, route_table, ctx.layout, interleaved=False,
                                store_hidden=not kept)
        hidden = kept[0] if kept else grad_hidden  # grad_hidden now holds the activation, unless it was kept
        grad_down = grad_out.t() @ hidden if ctx.needs_input_grad[3] else None
        return gate_up, None, None, grad_down, None, None, None


def engine_weights(engine: nn.Module) -> dict[str, torch.Tensor]:
    """The six weights of the block by name: shared_gate/up/down [S, D], [S, D], [D, S]; expert_* [E, ., .]."""
    return {"shared_gate": engine.shared_gate.weight, "shared_up": engine.shared_up.weight,
            "shared_down": engine.shared_down.weight, "expert_gate": engine.expert_gate,
            "expert_up": engine.expert_up, "expert_down": engine.expert_down}


def fused_weights(engine: nn.Module, weights: dict[str, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[2C, D] gate|up and [D, C] down weights: shared columns first, then expert e's W columns.

    `weights` (engine_weights' names) replaces the engine's own, e.g. by effective weights."""
    w = engine_weights(engine) if weights is None else weights
    num_experts, hidden, width = w["expert_gate"].shape
    expert_gate = w["expert_gate"].transpose(1, 2).reshape(num_experts * width, hidden)
    expert_up = w["expert_up"].transpose(1, 2).reshape(num_experts * width, hidden)
    gate_up = torch.cat([w["shared_gate"], expert_gate, w["shared_up"], expert_up])
    down = torch.cat([w["shared_down"], w["expert_down"].reshape(num_experts * width, hidden).t()], dim=1)
    return gate_up, down


def kernel_layout(engine: nn.Module) -> tuple:
    """What the kernels read of the block: shared_columns, expert_width, vocab_size, shared_scale, routed_scale,
    primary_weight, other_weight."""
    route_weights = engine.route_weights
    if any(w != route_weights[-1] for w in route_weights[1:]):
        raise ValueError(f"route weights {route_weights}: the kernel takes a primary weight and equal others")
    return (engine.shared_gate.weight.shape[0], engine.expert_gate.shape[2], engine.route_table.shape[1],
            float(engine.shared_output_scale), float(engine.routed_output_scale), float(route_weights[0]),
            float(route_weights[-1]) if len(route_weights) > 1 else 0.0)


def trmoe_forward(engine: nn.Module, x: torch.Tensor, token_ids: torch.Tensor,
                  weights: dict[str, torch.Tensor] | None = None, gate_up_delta: torch.Tensor | None = None,
                  return_hidden: bool = False, fused: tuple[torch.Tensor | None, torch.Tensor] | None = None,
                  gate_up_gemm: Callable[[torch.Tensor], torch.Tensor] | None = None, keep_activation: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The TR-MoE block of `engine` (a cflib.model.TRMoEEngine) on x [N, D] and token ids [N].

    For callers that adapt the block (cflib.model.lora): `weights` replaces the engine's (fused_weights),
    `gate_up_delta` [N, 2C] is added to the gate|up GEMM's output, and `return_hidden` also returns the
    scaled activation [N, C] the down projection reads, differentiably. `fused`: the gate|up and down weights
    already laid out as fused_weights lays them (cflib.model.weight_copies); `gate_up_gemm` computes the gate|up
    GEMM in place of F.linear with fused's first weight (None then), e.g. one whose backward writes FP32.
    keep_activation: the activation kept from forward for backward instead of recomputed there."""
    gate_up_weight, down_weight = fused if fused is not None else fused_weights(engine, weights)
    layout = kernel_layout(engine)
    gate_up = gate_up_gemm(x) if gate_up_gemm is not None else F.linear(x, gate_up_weight)
    if gate_up_delta is not None:
        gate_up = gate_up + gate_up_delta.to(gate_up.dtype)
    return ScaledSwiGLUDown.apply(gate_up, token_ids, engine.route_table, down_weight.to(gate_up.dtype), layout,
                                  return_hidden, keep_activation)


@triton.jit
def _scale_columns(hidden_ptr, token_ptr, route_ptr, num_rows, columns, first_column, shared_columns, expert_width,
                   vocab_size, shared_scale, routed_scale, primary_weight, other_weight, TOP_K: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """In place, from first_column on: hidden [N, C] times each element's column scale."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = first_column + tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < columns)[None, :]
    scale = _column_scale(rows, cols, row_mask, token_ptr, route_ptr, shared_columns, expert_width, vocab_size,
                          shared_scale, routed_scale, primary_weight, other_weight, TOP_K, BLOCK_R, BLOCK_C)
    offsets = rows.to(tl.int64)[:, None] * columns + cols[None, :]
    hidden = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(hidden_ptr + offsets, (hidden * scale).to(hidden_ptr.dtype.element_ty), mask=mask)


# BLOCK_R, BLOCK_C, num_warps of _scale_columns: the 200M model's 256 expert columns of a row in one tile.
SCALE_TILE = (32, 256, 8)


def scale_columns_(hidden: torch.Tensor, token_ids: torch.Tensor, route_table: torch.Tensor, layout: tuple,
                   tile: tuple[int, int, int] = SCALE_TILE) -> None:
    """In place: the activation hidden [N, C] times each element's column scale (_scale_columns)."""
    num_rows, columns = hidden.shape
    # Shared columns of output scale 1 are left as they are: the kernel reads and writes the experts' alone.
    first_column = layout[0] if layout[3] == 1.0 else 0
    block_r, block_c, warps = tile
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(columns - first_column, block_c))
    if 0 in grid:
        return
    _scale_columns[grid](hidden, token_ids, route_table, num_rows, columns, first_column, *layout,
                         TOP_K=route_table.shape[0], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


class GatedSwiGLUDown(torch.autograd.Function):
    """x [N, D] -> (silu(gate) * up * column scale) @ down.T, the SwiGLU in the gate|up GEMM's epilogue.

    gate_up [2C, D] interleaves gate and up rows (fused_weights' rows, pair by pair: interleave_gate_up), down
    is [D, C], both in x's 16-bit dtype. Forward, one GEMM writes the pre-activation and silu(gate) * up from
    its FP32 accumulator (gated_gemm); its epilogue has no per-token column scale, so a small kernel scales the
    activation's expert columns after it, which by linearity of the down projection is the block's function.
    Backward is cflib's: grad_out @ down through cuBLAS, then one kernel that turns the pre-activation into its
    gradient in place (interleaved as it is) and that product into the scaled activation recomputed, for the
    down weight's gradient. Only x and the pre-activation are kept for backward, and with `keep` the activation
    (which the backward kernel then does not write).

    The weight gradients are computed in FP32 (weight_gradient). With `regions` (the gate|up copy's and the
    down copy's, cflib.model.weight_copies) the trailing inputs are the FP32 masters those regions lay out,
    and each gets its slice of them; without, gate_up and down get their gradients in their own dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_ids: torch.Tensor, route_table: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, layout: tuple, gemms: Gemms, keep: bool, regions: tuple | None,
                *masters: torch.Tensor) -> torch.Tensor:
        x, token_ids, route_table = x.to(gate_up.dtype).contiguous(), token_ids.contiguous(), route_table.contiguous()
        preact, hidden = gated_gemm(x, gate_up)
        scale_columns_(hidden, token_ids, route_table, layout)
        ctx.save_for_backward(x, preact, token_ids, route_table, gate_up, down, *((hidden,) if keep else ()))
        ctx.layout, ctx.gemms, ctx.regions = layout, gemms, regions
        return gemms.linear(hidden, down)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, preact, token_ids, route_table, gate_up, down, *kept = ctx.saved_tensors
        gemms, grad_out = ctx.gemms, grad_out.contiguous().to(down.dtype)
        hidden = gemms.matmul(grad_out, down)
        # each (gate, up) pair as one 32-bit word: the kernel reads and writes the pairs as whole words
        scaled_swiglu_backward_(hidden, preact.view(torch.int32), token_ids, route_table, ctx.layout, interleaved=True,
                                store_hidden=not kept)
        # preact now holds its gradient and hidden the activation (or the kept one is read); a second backward
        # must not read either
        torch.autograd.graph.increment_version(preact)
        if kept:
            hidden = kept[0]
        grad_preact, needs = preact, ctx.needs_input_grad
        # The down weight's gradient first, so the [N, C] activation is freed before grad_x is allocated.
        if ctx.regions is None:
            grad_down = gemms.weight_gradient(grad_out, hidden).to(down.dtype) if needs[4] else None
            del hidden
            grad_x = gemms.matmul(grad_preact, gate_up) if needs[0] else None
            grad_gate_up = gemms.weight_gradient(grad_preact, x).to(gate_up.dtype) if needs[3] else None
            return grad_x, None, None, grad_gate_up, grad_down, None, None, None, None
        gate_up_regions, down_regions = ctx.regions
        split = 9 + len(gate_up_regions)
        grads_down = master_gradients(partial(gemms.weight_gradient, grad_out, hidden), down_regions, needs[split:])
        del hidden
        grad_x = gemms.matmul(grad_preact, gate_up) if needs[0] else None
        grads_gate_up = master_gradients(partial(gemms.weight_gradient, grad_preact, x), gate_up_regions,
                                         needs[9:split])
        return grad_x, None, None, None, None, None, None, None, None, *grads_gate_up, *grads_down


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """fused_weights' [gate; up] rows [2C, D] as GatedSwiGLUDown reads them: gate row j, then up row j."""
    return torch.stack(gate_up.chunk(2), dim=1).flatten(0, 1)


def trmoe_gated_forward(engine: nn.Module, x: torch.Tensor, token_ids: torch.Tensor,
                        copies: tuple[tuple, tuple] | None = None,
                        weights: dict[str, torch.Tensor] | None = None, gemms: Gemms = TORCH_GEMMS,
                        keep_activation: bool = False) -> torch.Tensor:
    """The TR-MoE block of `engine` through quack's SwiGLU GEMMs (GatedSwiGLUDown), x in a 16-bit dtype or
    under autocast to one. `copies`: the gate|up copy (interleaved) and the down copy, each as (tensor,
    regions, masters) (cflib.model.weight_copies); without, both are laid out from the engine's weights (or
    `weights`, engine_weights' names). `gemms`: how the block's other GEMMs run (cflib.ops.gemm).
    keep_activation: the activation kept from forward for backward instead of recomputed there."""
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.get_autocast_dtype(x.device.type)
    layout = kernel_layout(engine)
    if copies is None:
        gate_up, down = fused_weights(engine, weights)
        return GatedSwiGLUDown.apply(x, token_ids, engine.route_table, interleave_gate_up(gate_up).to(dtype),
                                     down.to(dtype), layout, gemms, keep_activation, None)
    (gate_up, gate_up_regions, gate_up_masters), (down, down_regions, down_masters) = copies
    return GatedSwiGLUDown.apply(x, token_ids, engine.route_table, gate_up, down, layout, gemms,
                                 keep_activation, (gate_up_regions, down_regions), *gate_up_masters,
                                 *down_masters)
