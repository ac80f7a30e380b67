"""Two gaps of Triton's CPU interpreter that stop Liger's kernels, closed for TRITON_INTERPRET=1 only.

CI has no GPU, so every Triton kernel (Liger's and ours) is checked under the
interpreter. Two of its gaps break Liger's RMSNorm and SwiGLU there, though the
compiled kernels are fine (triton 3.6 and 3.9, liger-kernel 0.8.5):

1. Python float arguments reach the kernel as Python floats, where compiled
   Triton gives fp32 scalars; Liger calls `eps.to(tl.float32)` on them.
2. `libdevice.rsqrt`, imported by name into Liger's modules, has no interpreter
   implementation (it returns None); `tl.rsqrt` is the same function.

Nothing changes when the interpreter is off: compiled kernels never see this.
"""
from __future__ import annotations

import importlib.util
import os

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# The modules whose kernels Triton defines when they are imported: the switch must come before any of them.
KERNEL_MODULES = ("cflib.ops.add_rms_norm", "cflib.ops.adamw", "cflib.ops.column_sums", "cflib.ops.cross_entropy",
                  "cflib.ops.qk_norm_rope", "cflib.ops.rows", "cflib.ops.trmoe", "cflib.ops.liger", "liger_kernel")
_rsqrt = None  # tl.rsqrt as a Triton function, once the interpreter's gaps are closed


def _close_interpreter_gaps() -> None:
    """Gap 1 closed in Triton's interpreter, and the rsqrt gap 2 needs defined (close_liger_gaps applies it)."""
    # Module globals, not locals: the interpreter runs a jit'd function only where triton.language is among its
    # globals (the rsqrt below and _bf16_probe's kernel).
    global _rsqrt, np, triton, tl
    if importlib.util.find_spec("triton") is None:
        return
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    implicit_cvt = interpreter._implicit_cvt

    def implicit_cvt_with_floats(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return implicit_cvt(arg)

    @triton.jit
    def rsqrt(x):
        return tl.rsqrt(x)

    interpreter._implicit_cvt = implicit_cvt_with_floats
    _rsqrt = rsqrt


if INTERPRETING:
    _close_interpreter_gaps()


def interpret_without_gpu() -> bool:
    """On a machine without a CUDA device, Triton's interpreter on for this process (TRITON_INTERPRET=1), so the
    kernels run on the CPU, to be checked (validate_kernels); True when it is on. Triton reads the switch as it
    defines each kernel, so it must come before any kernel module is imported: after one, nothing changes. A
    TRITON_INTERPRET the user set is left as it is."""
    global INTERPRETING
    import sys

    import torch

    if INTERPRETING or torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return INTERPRETING
    if any(name in sys.modules for name in KERNEL_MODULES):
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETING = True
    _close_interpreter_gaps()
    return True


def close_liger_gaps() -> None:
    """Gap 2 closed in Liger's modules, under the interpreter only. cflib.ops.liger calls it when it imports Liger,
    not this module: importing Liger imports peft and transformers (3 s of CPU), which a process that never runs
    Liger's kernels (a torchrun worker, a notebook's kernel) would otherwise pay whenever it imports cflib.ops."""
    if not INTERPRETING or importlib.util.find_spec("triton") is None:
        return
    import liger_kernel.ops.fused_add_rms_norm
    import liger_kernel.ops.rms_norm

    liger_kernel.ops.rms_norm.rsqrt = _rsqrt
    liger_kernel.ops.fused_add_rms_norm.rsqrt = _rsqrt


def bf16_arithmetic_broken() -> bool:
    """True when the interpreter multiplies bf16 values wrongly (it does in triton 3.9: raw bits).

    Kernels that compute in fp32 and only store bf16 are unaffected; one that
    multiplies bf16 values (Liger's SwiGLU forward) cannot be checked there.
    """
    if not INTERPRETING or importlib.util.find_spec("triton") is None:
        return False
    import torch
    probe = _bf16_probe()
    a = torch.linspace(-3, 3, 16).bfloat16()
    out = torch.empty_like(a)
    probe[(1,)](a, a, out, BLOCK=16)
    return not torch.allclose(out.float(), (a.float() * a.float()).bfloat16().float(), rtol=1e-2)


def _bf16_probe():  # under the interpreter only: _close_interpreter_gaps has imported triton
    @triton.jit
    def multiply(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(a_ptr + offsets) * tl.load(b_ptr + offsets))
    return multiply
