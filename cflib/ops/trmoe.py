"""TR-MoE feed-forward as one wide SwiGLU: the shared branch and every expert side by side.

With a few narrow experts beside a wide shared branch (200M: 3,072 shared
columns, 4 experts x 64), running every expert on every token costs ~4% more
FLOPs than running only the routed ones, and removes every gather, scatter and
per-expert launch: the block becomes two dense GEMMs (cuBLAS) around one
Triton kernel, `silu(gate) * up * scale`, whose per-token column scale is the
shared output scale on shared columns and routed_output_scale x route weight
on each expert's columns (zero on experts the token is not routed to). The
output scales fold into that kernel exactly, by linearity of the down
projection. The gather/grouped-GEMM/scatter design lost to this one on the
H200 at the 200M shapes (benchmarks/trmoe_designs.py, README).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .interpreter import INTERPRETING

# Tried on the device at first use per width (do_bench inside triton.autotune); one config in the interpreter.
_CONFIGS = [triton.Config({"BLOCK_R": 32, "BLOCK_C": 128}, num_warps=4)] if INTERPRETING else [
    triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
    for r, c, w in ((32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8), (8, 512, 4), (64, 256, 8))]


@triton.jit
def _column_scale(coeff_ptr, rows, cols, mask, shared_columns, expert_width, num_experts, shared_scale):
    routed = cols >= shared_columns
    expert = tl.where(routed, (cols - shared_columns) // expert_width, 0)
    coeff = tl.load(coeff_ptr + rows[:, None] * num_experts + expert[None, :], mask=mask & routed[None, :], other=0.0)
    return tl.where(routed[None, :], coeff, shared_scale)


@triton.autotune(_CONFIGS, key=["columns"])
@triton.jit
def _scaled_swiglu_forward(gate_up_ptr, coeff_ptr, out_ptr, num_rows, columns, shared_columns, expert_width,
                           num_experts, shared_scale, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < columns)[None, :]
    gate_offsets = rows.to(tl.int64)[:, None] * (2 * columns) + cols[None, :]
    gate = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_offsets + columns, mask=mask, other=0.0).to(tl.float32)
    scale = _column_scale(coeff_ptr, rows, cols, mask, shared_columns, expert_width, num_experts, shared_scale)
    out = gate * tl.sigmoid(gate) * up * scale
    out_offsets = rows.to(tl.int64)[:, None] * columns + cols[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(_CONFIGS, key=["columns"], restore_value=["gate_up_ptr"])
@triton.jit
def _scaled_swiglu_backward(grad_out_ptr, gate_up_ptr, coeff_ptr, num_rows, columns, shared_columns, expert_width,
                            num_experts, shared_scale, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Writes d(gate) and d(up) over gate_up in place: it is not needed after this."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < columns)[None, :]
    gate_offsets = rows.to(tl.int64)[:, None] * (2 * columns) + cols[None, :]
    gate = tl.load(gate_up_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_offsets + columns, mask=mask, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + rows.to(tl.int64)[:, None] * columns + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    grad = grad_out * _column_scale(coeff_ptr, rows, cols, mask, shared_columns, expert_width, num_experts,
                                    shared_scale)
    sig = tl.sigmoid(gate)
    grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad * gate * sig
    tl.store(gate_up_ptr + gate_offsets, grad_gate.to(gate_up_ptr.dtype.element_ty), mask=mask)
    tl.store(gate_up_ptr + gate_offsets + columns, grad_up.to(gate_up_ptr.dtype.element_ty), mask=mask)


def _grid(num_rows: int, columns: int):
    return lambda meta: (triton.cdiv(num_rows, meta["BLOCK_R"]), triton.cdiv(columns, meta["BLOCK_C"]))


def _scaled_swiglu(gate_up: torch.Tensor, coeff: torch.Tensor, shared_columns: int, expert_width: int,
                   shared_scale: float) -> torch.Tensor:
    num_rows, columns = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, columns, dtype=gate_up.dtype, device=gate_up.device)
    _scaled_swiglu_forward[_grid(num_rows, columns)](
        gate_up, coeff, out, num_rows, columns, shared_columns, expert_width, coeff.shape[1], shared_scale)
    return out


class ScaledSwiGLUDown(torch.autograd.Function):
    """[N, 2C] gate|up -> (silu(gate) * up * column scale) @ down.T, keeping only gate|up for backward.

    The [N, C] activation between the kernel and the down GEMM is recomputed in
    backward (one elementwise pass) instead of being held from forward to
    backward in every layer: at 16 x 2,048 tokens that is 3.5 GB for the 200M model.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, coeff: torch.Tensor, down: torch.Tensor, shared_columns: int,
                expert_width: int, shared_scale: float) -> torch.Tensor:
        gate_up, coeff = gate_up.contiguous(), coeff.contiguous().float()
        hidden = _scaled_swiglu(gate_up, coeff, shared_columns, expert_width, float(shared_scale))
        ctx.save_for_backward(gate_up, coeff, down)
        ctx.layout = (shared_columns, expert_width, float(shared_scale))
        return hidden @ down.t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, coeff, down = ctx.saved_tensors
        shared_columns, expert_width, shared_scale = ctx.layout
        grad_out = grad_out.contiguous().to(gate_up.dtype)
        hidden = _scaled_swiglu(gate_up, coeff, shared_columns, expert_width, shared_scale)
        grad_down = grad_out.t() @ hidden
        del hidden
        grad_hidden = grad_out @ down
        num_rows, columns = gate_up.shape[0], gate_up.shape[1] // 2
        _scaled_swiglu_backward[_grid(num_rows, columns)](
            grad_hidden, gate_up, coeff, num_rows, columns, shared_columns, expert_width, coeff.shape[1],
            shared_scale)
        return gate_up, None, grad_down, None, None, None


def fused_weights(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """[2C, D] gate|up and [D, C] down weights: shared columns first, then expert e's W columns."""
    num_experts, hidden, width = engine.expert_gate.shape
    expert_gate = engine.expert_gate.transpose(1, 2).reshape(num_experts * width, hidden)
    expert_up = engine.expert_up.transpose(1, 2).reshape(num_experts * width, hidden)
    gate_up = torch.cat([engine.shared_gate.weight, expert_gate, engine.shared_up.weight, expert_up])
    down = torch.cat([engine.shared_down.weight, engine.expert_down.reshape(num_experts * width, hidden).t()], dim=1)
    return gate_up, down


def trmoe_forward(engine, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The TR-MoE block of `engine` (a cflib.model.TRMoEEngine) on x [N, D] and token ids [N]."""
    gate_up_weight, down_weight = fused_weights(engine)
    coeff = engine.expert_coefficients(token_ids, torch.float32) * engine.routed_output_scale
    gate_up = F.linear(x, gate_up_weight)
    return ScaledSwiGLUDown.apply(gate_up, coeff, down_weight.to(gate_up.dtype), engine.shared_gate.weight.shape[0],
                                  engine.expert_gate.shape[2], engine.shared_output_scale)
