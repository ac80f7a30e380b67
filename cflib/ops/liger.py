"""Liger-Kernel's functional ops, as cflib uses them (through their autograd functions, no patching of models)."""
from __future__ import annotations

from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # noqa: E402
from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: E402
from liger_kernel.ops.rope import LigerRopeFunction  # noqa: E402
from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # noqa: E402

from cflib.ops.interpreter import close_liger_gaps

close_liger_gaps()  # before Liger's kernels first run under TRITON_INTERPRET=1

__all__ = ["LigerFusedLinearCrossEntropyFunction", "LigerRMSNormFunction", "LigerRopeFunction", "LigerSiLUMulFunction"]
