"""AdamW over many tensors in one Triton launch, writing each updated weight's BF16 copy in the same pass.

torch's fused AdamW reads each parameter, its gradient and both moments and writes all four back (the gradient
too when it divides by a clipping factor); the BF16 weight copies (cflib.model.weight_copies) then read every
master once more to write its copy. This kernel reads p, g, m and v once and writes p, m, v and, where a copy
of the weight exists, its BF16 value: 28 bytes per parameter plus 2 per copied one, the least the update moves.

The tensors are reached through tables of their addresses, so one launch updates a parameter group of any
number of tensors, each program BLOCK elements of one of them. The arithmetic is torch's AdamW's, in FP32:

    p <- p - lr * wd * p;  m <- b1 * m + (1 - b1) * g;  v <- b2 * v + (1 - b2) * g * g
    p <- p - step_size * m / (sqrt(v) / bias2_sqrt + eps)

where g is the gradient divided by grad_scale (the clipping factor) as it is read, step_size is
lr / (1 - b1^t) and bias2_sqrt is sqrt(1 - b2^t) for each tensor's step t. Where found_inf is set nothing is
written: a non-finite step is skipped on the device, as torch's fused step skips it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from cflib.ops.interpreter import INTERPRETING

# Elements per program and warps, measured on the H200 over the 200M model's parameters with BF16 copies of its
# 2-D weights (`python benchmarks/tiles.py`): 1,024 and 8 warps 1.54 ms a step (2,048 and 8: 1.66; 4,096 and 8: 1.99).
BLOCK = 2048 if INTERPRETING else 1024  # the interpreter pays per program
NUM_WARPS = 8
COPY_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _bf16_bits(x):
    """x rounded to the nearest BF16, ties to even, as torch casts (a NaN stays a NaN): its 16 bits. Written
    out because Triton's interpreter truncates where compiled Triton rounds, and the copies must be the cast's."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def _adamw_kernel(chunk_tensor_ptr, chunk_start_ptr, numel_ptr, param_ptrs, grad_ptrs, exp_avg_ptrs, exp_avg_sq_ptrs,
                  coefficient_ptr, copy_ptrs, copy_rows_ptr, grad_scale_ptr, found_inf_ptr, num_tensors,
                  lr_times_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                  HAS_DECAY: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                  COPY_BF16: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    tensor = tl.load(chunk_tensor_ptr + chunk)
    offsets = tl.load(chunk_start_ptr + chunk) + tl.arange(0, BLOCK)
    numel = tl.load(numel_ptr + tensor)
    if HAS_FOUND_INF:
        numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
    mask = offsets < numel
    param_ptr = tl.load(param_ptrs + tensor).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(grad_ptrs + tensor).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(exp_avg_ptrs + tensor).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(exp_avg_sq_ptrs + tensor).to(tl.pointer_type(tl.float32))
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    # Correctly rounded divisions and square root, as torch's kernels compute them (Triton's defaults approximate).
    if HAS_GRAD_SCALE:
        grad = tl.div_rn(grad, tl.zeros_like(grad) + tl.load(grad_scale_ptr))
    if HAS_DECAY:  # as torch, none where the group has none (an infinite weight stays infinite)
        param = param - lr_times_decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    step_size = tl.load(coefficient_ptr + tensor)
    bias2_sqrt = tl.load(coefficient_ptr + num_tensors + tensor)
    denominator = tl.div_rn(tl.sqrt_rn(exp_avg_sq), tl.zeros_like(exp_avg_sq) + bias2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denominator)
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    copy_address = tl.load(copy_ptrs + tensor)
    if copy_address != 0:
        # The copy's view of this master: rows of row_length elements, row_stride apart.
        row_length = tl.load(copy_rows_ptr + 2 * tensor)
        target = (offsets // row_length) * tl.load(copy_rows_ptr + 2 * tensor + 1) + offsets % row_length
        if COPY_BF16:
            tl.store(copy_address.to(tl.pointer_type(tl.uint16)) + target, _bf16_bits(param), mask=mask)
        else:
            tl.store(copy_address.to(tl.pointer_type(tl.float16)) + target, param.to(tl.float16), mask=mask)


def writes_rows(view: torch.Tensor) -> bool:
    """Whether the kernel writes this view of a copy: rows of contiguous elements (a slice of rows or of
    columns), which its stores reach coalesced. A transposed view (an expert's slice of a fused copy) would
    scatter its writes one element per memory sector; its caller copies it instead."""
    return view.is_contiguous() or view.dim() == 2 and view.stride(1) == 1


def _rows(view: torch.Tensor) -> list[int]:
    """A view that writes_rows as (row_length, row_stride)."""
    if view.is_contiguous():
        return [max(view.numel(), 1)] * 2
    return [view.shape[1], view.stride(0)]


@dataclass(frozen=True)
class AdamWTables:
    """The device tables of one launch: every tensor's addresses and each program's tensor and first element."""

    chunk_tensor: torch.Tensor
    chunk_start: torch.Tensor
    numel: torch.Tensor
    params: torch.Tensor
    grads: torch.Tensor
    exp_avgs: torch.Tensor
    exp_avg_sqs: torch.Tensor
    copies: torch.Tensor
    copy_rows: torch.Tensor
    copy_dtype: torch.dtype
    block: int  # elements per program
    num_warps: int


def adamw_tables(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor | None],
                 block: int = BLOCK, num_warps: int = NUM_WARPS) -> AdamWTables:
    """The tables `adamw_step_` reads, and its launch configuration: built once per set of addresses. They hold
    addresses, not references: every tensor must outlive each launch that reads them. A copy (None: none) is a
    view that writes_rows."""
    for name, tensors in (("parameter", params), ("gradient", grads), ("exp_avg", exp_avgs),
                          ("exp_avg_sq", exp_avg_sqs)):
        for index, tensor in enumerate(tensors):
            if tensor.dtype != torch.float32 or not tensor.is_contiguous():
                raise ValueError(f"cflib's AdamW updates contiguous float32 tensors; {name} {index} is "
                                 f"{tensor.dtype}{'' if tensor.is_contiguous() else ', not contiguous'}")
            if tensor.shape != params[index].shape:
                raise ValueError(f"{name} {index} has shape {tuple(tensor.shape)}, its parameter "
                                 f"{tuple(params[index].shape)}")
    copy_dtypes = {copy.dtype for copy in copies if copy is not None}
    if len(copy_dtypes) > 1 or not copy_dtypes <= set(COPY_DTYPES):
        raise ValueError(f"weight copies in one of {COPY_DTYPES}, one dtype per launch; got {copy_dtypes}")
    for index, copy in enumerate(copies):
        if copy is not None and copy.shape != params[index].shape:
            raise ValueError(f"copy {index} has shape {tuple(copy.shape)}, its parameter {tuple(params[index].shape)}")
        if copy is not None and not writes_rows(copy):
            raise ValueError(f"copy {index} is a view of strides {copy.stride()}, not rows of contiguous elements")
        if copy is not None and copy.device != params[index].device:
            raise ValueError(f"copy {index} is on {copy.device}, its parameter on {params[index].device}")
    numels = np.array([p.numel() for p in params], dtype=np.int64)
    rows = [_rows(copy) if copy is not None else [1, 1] for copy in copies]
    spans = [row_stride * (copy.numel() // row_length) for copy, (row_length, row_stride) in zip(copies, rows)
             if copy is not None]
    if max([*numels + block, *spans], default=0) > 2 ** 31:
        raise ValueError("cflib's AdamW indexes each tensor with 32-bit offsets: a tensor (or a copy's span) "
                         "reaches 2^31 elements")
    chunks = -(-numels // block)
    device = params[0].device

    def table(values, dtype: torch.dtype) -> torch.Tensor:
        host = torch.as_tensor(np.asarray(values), dtype=dtype)
        # From pinned memory without waiting: a pageable copy would block the host until the backward ends.
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

    starts = np.concatenate([np.arange(count, dtype=np.int64) * block for count in chunks]) if len(chunks) else []
    return AdamWTables(
        chunk_tensor=table(np.repeat(np.arange(len(params)), chunks), torch.int32),
        chunk_start=table(starts, torch.int32), numel=table(numels, torch.int32),
        params=table([t.data_ptr() for t in params], torch.int64),
        grads=table([t.data_ptr() for t in grads], torch.int64),
        exp_avgs=table([t.data_ptr() for t in exp_avgs], torch.int64),
        exp_avg_sqs=table([t.data_ptr() for t in exp_avg_sqs], torch.int64),
        copies=table([0 if copy is None else copy.data_ptr() for copy in copies], torch.int64),
        copy_rows=table(rows, torch.int32).flatten(),
        copy_dtype=next(iter(copy_dtypes), torch.bfloat16), block=block, num_warps=num_warps)


def adamw_step_(tables: AdamWTables, coefficients: torch.Tensor, lr: float, weight_decay: float,
                betas: tuple[float, float], eps: float, grad_scale: torch.Tensor | None = None,
                found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update of every tensor in `tables`, in place. coefficients: FP32 [2, tensors], each tensor's
    step_size (lr / (1 - b1^t)) and bias2_sqrt (sqrt(1 - b2^t)); grad_scale, found_inf: one-element FP32
    device tensors (the clipping factor each gradient is divided by; nonzero skips the update)."""
    programs = tables.chunk_tensor.numel()
    if programs == 0:
        return
    beta1, beta2 = betas
    dummy = coefficients  # an unused pointer argument (its constexpr flag is off)
    _adamw_kernel[(programs,)](
        tables.chunk_tensor, tables.chunk_start, tables.numel, tables.params, tables.grads, tables.exp_avgs,
        tables.exp_avg_sqs, coefficients, tables.copies, tables.copy_rows,
        dummy if grad_scale is None else grad_scale, dummy if found_inf is None else found_inf,
        tables.numel.numel(), lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        HAS_DECAY=weight_decay != 0, HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        COPY_BF16=tables.copy_dtype == torch.bfloat16, BLOCK=tables.block, num_warps=tables.num_warps,
        enable_fp_fusion=False)  # no multiply-add contracted into one rounding: the reference's operations


def step_coefficients(steps: torch.Tensor, lr: float, betas: tuple[float, float]) -> torch.Tensor:
    """[2, tensors] FP32: lr / (1 - b1^t) and sqrt(1 - b2^t) for each tensor's step t (computed in FP64, as
    torch's fused AdamW computes its bias corrections), on the steps' device without reading them back."""
    steps = steps.double()
    return torch.stack([lr / (1.0 - betas[0] ** steps), (1.0 - betas[1] ** steps).sqrt()]).float()


@torch.no_grad()
def adamw_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     step: int, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                     grad_scale: float = 1.0) -> None:
    """The same update in PyTorch for one tensor, operation by operation in FP32 (the kernel's tests)."""
    def fp32(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=param.device)

    (beta1, beta2), step_size, bias2_sqrt = betas, *step_coefficients(fp32(step), lr, betas)
    grad = grad / fp32(grad_scale)
    if weight_decay != 0:
        param.copy_(param - fp32(lr * weight_decay) * param)
    exp_avg.copy_(fp32(beta1) * exp_avg + fp32(1.0 - beta1) * grad)
    exp_avg_sq.copy_(fp32(beta2) * exp_avg_sq + fp32(1.0 - beta2) * grad * grad)
    root = exp_avg_sq.double().sqrt().float()  # correctly rounded (torch's FP32 sqrt on a CPU may not be)
    param.copy_(param - step_size * exp_avg / (root / bias2_sqrt + fp32(eps)))
