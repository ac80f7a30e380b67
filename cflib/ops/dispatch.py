"""Which kernels run: the checks behind `use_custom_kernels` / `require_liger`, decided before any step.

`auto` takes a fast path only where every check passes and otherwise stays on
PyTorch; `true` (and `require_liger: true`) stops before any training step with
the check that failed. The kernels that actually ran are read back from the
modules after a forward (`TRMoEModel.kernel_path()`, the loss's `last_backend`),
never inferred from these flags.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cflib.errors import KernelUnavailable
from cflib.ops.attention import check_attention


@dataclass(frozen=True)
class KernelChoice:
    liger: bool  # Liger's RMSNorm, RoPE, SwiGLU and fused linear CE
    custom: bool  # cflib's Triton TR-MoE block, QKV/norm kernels and fused linear CE
    notes: tuple[str, ...] = ()  # why `auto` left a fast path off
    attention: str = "auto"  # attention_backend, checked here (cflib.ops.attention)
    epilogue_swiglu: bool = False  # the TR-MoE block's SwiGLU in quack's GEMM epilogue (with custom)
    quack_gemms: bool = False  # the step's other GEMMs on quack's kernel or cuBLAS, the faster (cflib.ops.gemm)

    def describe(self) -> str:
        chosen = [name for name, on in (("Liger", self.liger), ("cflib Triton", self.custom),
                                        ("quack SwiGLU GEMMs", self.epilogue_swiglu),
                                        ("quack GEMMs where faster", self.quack_gemms)) if on]
        text = " + ".join(chosen) if chosen else "PyTorch reference"
        return text + "".join(f"; {note}" for note in self.notes)


def refuse_if_required(flag_name: str, mode: str, problem: str | None) -> None:
    """KernelUnavailable naming the flag, where it is `true` and `problem` says why its path cannot run."""
    if mode == "true" and problem is not None:
        raise KernelUnavailable(f"{flag_name}: true, but {problem}")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_problem(device: torch.device, rocm_opt_in: bool) -> str | None:
    """Why Triton kernels cannot run on `device`, or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if triton_interpreting():
        return None if device.type == "cpu" else f"TRITON_INTERPRET=1 runs kernels on the CPU, not on {device}"
    if device.type != "cuda":
        return (f"no GPU: the device is {device} (TRITON_INTERPRET=1 runs the kernels in Triton's interpreter, to "
                "test them: far slower than PyTorch)")
    if torch.version.hip is not None and not rocm_opt_in:
        return "ROCm device: the kernels are tuned and validated on CUDA; use true to opt in"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (bfloat16 Triton kernels need Ampere or newer)"
    return None


def liger_problem() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def quack_problem(device: torch.device) -> str | None:
    """Why quack's GEMMs (the SwiGLU epilogue's, and the plain ones of quack_gemms) cannot run here, or None."""
    if device.type != "cuda":
        return f"no GPU: the device is {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor}: quack's GEMMs are measured on Hopper (9.x) only"
    spec = importlib.util.find_spec("quack")
    if spec is None or importlib.util.find_spec("quack.mlp") is None:
        return "quack-kernels is not installed (pip install quack-kernels, or cflib[gpu])"
    if not any(f"{os.sep}{folder}{os.sep}" in (spec.origin or "") for folder in ("site-packages", "dist-packages")):
        # quack keys its compiled epilogues on the code they call and trusts only installed libraries (under
        # site-packages); elsewhere it walks into CUTLASS DSL's globals and refuses them with a TypeError.
        return f"quack is imported from {spec.origin}, outside a site-packages folder, where its GEMMs refuse to compile"
    return None


def choose_kernels(use_custom_kernels: str, require_liger: bool, device: torch.device,
                 attention_backend: str = "auto", head_dim: int = 64, packed: bool = False,
                 epilogue_swiglu: str = "false", weight_copies_problem: str | None = None,
                 quack_gemms: str = "false") -> KernelChoice:
    """Resolve the flags against this device, or raise KernelUnavailable naming the check.

    Shapes need no check here but attention's (head_dim; packed: whether training rows are packed windows):
    every valid ModelConfig (even head_dim) runs on every other path. `weight_copies_problem`: why the run
    reads no BF16 weight copies, if it reads none; `auto` takes quack's GEMMs only with them, where they were
    measured faster (`true` runs the SwiGLU epilogue without, laying the weights out in every forward)."""
    notes: list[str] = list(check_attention(attention_backend, device, head_dim, packed))

    def decide(flag_name: str, mode: str, problem: str | None) -> bool:
        if mode == "false":
            return False
        if problem is None:
            return True
        refuse_if_required(flag_name, mode, problem)
        notes.append(f"{flag_name}: {problem}")
        return False

    common = triton_problem(device, rocm_opt_in=use_custom_kernels == "true")
    # The interpreter proves kernels correct at a snail's pace: on a CPU it runs only what a flag requires, cflib's
    # kernels with use_custom_kernels: true (Liger's beside them, as on a GPU), Liger's alone with require_liger.
    interpreted = "no GPU: Triton's interpreter runs only when a fast path is required (true)" \
        if common is None and device.type == "cpu" else None
    custom = decide("use_custom_kernels", use_custom_kernels,
                    common or (None if use_custom_kernels == "true" else interpreted))
    # use_custom_kernels: true requires cflib's kernels; Liger is required only by require_liger.
    # The reference path (use_custom_kernels: false) is plain PyTorch unless Liger is required.
    liger_mode = "true" if require_liger else ("false" if use_custom_kernels == "false" else "auto")
    liger_required = require_liger or use_custom_kernels == "true"
    liger = decide("require_liger" if require_liger else "use_custom_kernels (Liger)", liger_mode,
                   common or (None if liger_required else interpreted) or liger_problem())
    epilogue = _decide_quack("epilogue_swiglu", epilogue_swiglu, custom, device, weight_copies_problem, decide)
    gemms = _decide_quack("quack_gemms", quack_gemms, custom, device, weight_copies_problem, decide)
    return KernelChoice(liger=liger, custom=custom, notes=tuple(notes), attention=attention_backend,
                      epilogue_swiglu=epilogue, quack_gemms=gemms)


def _decide_quack(flag_name: str, mode: str, custom: bool, device: torch.device, weight_copies_problem: str | None,
                  decide: Callable[[str, str, str | None], bool]) -> bool:
    """A quack GPU refinement of cflib's path: refused without cflib's kernels where required; auto says nothing
    of it where those run interpreted, and takes it only with the BF16 weight copies, as measured."""
    if mode == "true" and not custom:
        raise KernelUnavailable(f"{flag_name}: true, but it runs inside cflib's fast path, which is off here "
                                "(use_custom_kernels)")
    on = custom and (device.type == "cuda" or mode == "true")
    problem = quack_problem(device)
    if problem is None and mode == "auto" and weight_copies_problem is not None:
        problem = f"it reads the BF16 weight copies, off here ({weight_copies_problem})"
    return decide(flag_name, mode if on else "false", problem)
