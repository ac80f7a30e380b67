"""Where a step's device time goes, family by family, for profiles measure_throughput wrote side by side.

Reads the `*-kernels.json` files `profile_steps` writes (every kernel by its full name, ms and launches per step)
and sorts each kernel into a family by its name: cuBLAS's (nvjet, cutlass, split-K reductions) and quack's GEMMs,
FlashAttention-4's kernels, the norms, RoPE (with QK-norm where one kernel does both), the SwiGLU, the loss, the
optimizer (with the gradient norm's clipping), the embedding's backward, copies and casts (with fills and memsets),
and the remaining elementwise kernels. Inductor's generated kernels (`triton_{poi,red,per}_fused_<ops>_<n>`) are
sorted by the ops their names list. GPU annotations (`## Call CompiledFxGraph ... ##`, `Optimizer.step#...`) span
kernels already counted and are left out.

    python benchmarks/profile_families.py OURS-kernels.json THEIRS-kernels.json [...]

prints a markdown table: each family's ms per step in each profile, and the difference to the first.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FAMILIES = ("GEMMs", "attention", "norms", "RoPE / QK-norm", "SwiGLU / TR-MoE", "loss", "optimizer",
            "embedding backward", "copies / casts / fills", "elementwise", "other")

# Kernels named by what they are (library and cflib kernels), first match wins.
NAMED = (
    (r"flash_attn|flash_fwd|flash_bwd|FlashAttention", "attention"),
    (r"(?i)gemm|nvjet|splitKreduce|sm90_xmma|cublas", "GEMMs"),  # quack's SwiGLU-epilogue GEMM among them
    (r"rms_norm|RMSNorm|rmsnorm|_column_sums|layer_norm", "norms"),
    (r"qk_norm_rope|rope|rotary", "RoPE / QK-norm"),
    (r"swiglu|SwiGLU|silu|_scale_columns", "SwiGLU / TR-MoE"),
    (r"cross_entropy|CrossEntropy|log_softmax|nll_loss|_fused_linear_cross|element_mul_kernel", "loss"),
    (r"adamw|Adam|FusedOptimizer|LpNorm|lpnorm|NormTwoOps|multi_tensor_apply", "optimizer"),
    (r"compute_grad_weight|sum_and_scatter|krn_partial|compute_num_of_partial|embedding|radix_sort|unique_by_key|"
     r"DeviceScan|DeviceCompact|vectorized_gather", "embedding backward"),
    (r"Memcpy|Memset|memset|copy_kernel|CatArrayBatchedCopy|FillFunctor|_scatter_rows|_scatter_gather",
     "copies / casts / fills"),
    (r"elementwise_kernel|reduce_kernel|Functor|arange", "elementwise"),
)
# Inductor's fused kernels, by the ops their names list.
INDUCTOR = (
    (("log_softmax", "nll_loss", "softmax"), "loss"),
    (("silu",), "SwiGLU / TR-MoE"),
    (("rsqrt", "pow"), "norms"),
    (("neg_slice", "cat_mul_neg", "slice_backward", "cos_mul_sin"), "RoPE / QK-norm"),
    (("embedding",), "embedding backward"),
)
ANNOTATION = re.compile(r"^## |^[\w.]+#")
INDUCTOR_NAME = re.compile(r"^triton_(poi|red|per)_fused_(?P<ops>.*)_\d+$")
MOVES = {"to_copy", "view", "unsafe_view", "t", "clone", "transpose", "unsqueeze", "expand", "permute", "slice",
         "squeeze", "reshape", "_to_copy", "_unsafe_view"}


def family(name: str) -> str | None:
    """The family of one kernel, or None for a GPU annotation."""
    if ANNOTATION.search(name):
        return None
    inductor = INDUCTOR_NAME.match(name)
    if inductor:
        ops = inductor["ops"]
        for markers, kind in INDUCTOR:
            if any(marker in ops for marker in markers):
                return kind
        words = {word for word in ops.replace("__", "_").strip("_").split("_") if word}
        return "copies / casts / fills" if words <= MOVES | {"to", "copy", "unsafe"} else "elementwise"
    for pattern, kind in NAMED:
        if re.search(pattern, name):
            return kind
    return "other"


def families(kernels: list[dict]) -> dict[str, list[float]]:
    """Family -> [ms per step, launches per step]."""
    totals = {kind: [0.0, 0.0] for kind in FAMILIES}
    for kernel in kernels:
        kind = family(kernel["name"])
        if kind is not None:
            totals[kind][0] += kernel["ms_per_step"]
            totals[kind][1] += kernel["calls_per_step"]
    return totals


def table(paths: list[Path]) -> str:
    found = [families(json.loads(path.read_text())) for path in paths]
    names = [path.name.removesuffix("-kernels.json") for path in paths]
    head = "| family | " + " | ".join(f"{name} ms (launches)" for name in names) + " | " + " | ".join(
        f"{name} - {names[0]} ms" for name in names[1:]) + " |"
    lines = [head, "| --- |" + " ---: |" * (2 * len(names) - 1)]
    for kind in (*FAMILIES, "total"):
        rows = [(sum(v[0] for v in f.values()), sum(v[1] for v in f.values())) if kind == "total" else f[kind]
                for f in found]
        if kind != "total" and not any(ms for ms, _ in rows):
            continue
        cells = [f"{ms:.1f} ({calls:.0f})" for ms, calls in rows]
        cells += [f"{ms - rows[0][0]:+.1f}" for ms, _ in rows[1:]]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) < 1:
        sys.exit(__doc__)
    print(table([Path(arg) for arg in argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
