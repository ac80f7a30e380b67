"""Every GEMM of the 200M training step at its shape, cuBLAS (as cflib calls it) against quack's GEMM.

For each: cuBLAS's time, quack's at its default configuration (tuned=False), and quack's autotuned choice
(tuned=True, every SM90 configuration compiled and timed by quack's autotuner), each timed here through CUDA
graphs (triton.testing.do_bench_cudagraph), with the largest difference from cuBLAS's output. One JSON line per
GEMM, printed as it finishes.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from quack.gemm_interface import _gemm_iface_plan_cache, gemm, gemm_add_inplace

M, D, QKV, GU, C, V, CHUNK = 32768, 896, 1152, 6656, 3328, 32000, 1024
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)


def rand(*shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen, device=dev) * 0.5).to(dtype)


def bench(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=60) * 1e3
    except Exception as err:  # noqa: BLE001
        print(f"# cudagraph failed ({type(err).__name__}: {err}); plain do_bench", file=sys.stderr)
        return triton.testing.do_bench(fn, rep=60) * 1e3


def case(name, flops, cublas, quack_call, check):
    """cublas(): the cuBLAS result; quack_call(tuned) -> result; check(a, b) -> max abs difference."""
    row = {"gemm": name, "gflop": flops / 1e9}
    ref = cublas()
    row["cublas_us"] = bench(cublas)
    for tuned in (False, True):
        label = "quack_tuned" if tuned else "quack_default"
        started = time.time()
        try:
            _gemm_iface_plan_cache.clear()
            out = quack_call(tuned)
            torch.cuda.synchronize()
            row[label + "_first_call_s"] = time.time() - started
            row[label + "_max_abs_diff"] = check(ref, out)
            row[label + "_us"] = bench(lambda: quack_call(tuned))
            plans = list(_gemm_iface_plan_cache.values())
            if plans:
                row[label + "_config"] = repr(plans[-1].config)
        except Exception as err:  # noqa: BLE001
            row[label + "_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    for key in [k for k in row if k.endswith("_us")]:
        row[key.replace("_us", "_tflops")] = flops / (row[key] * 1e-6) / 1e12
    print(json.dumps(row), flush=True)


def diff(a, b):
    return float((a.float() - b.float()).abs().max())


def linear_cases():
    x, h = rand(M, D), rand(M, C)
    for name, out_features, inp in (("qkv", QKV, x), ("o", D, x), ("down", D, h)):
        width = inp.shape[1]
        w, g = rand(out_features, width), rand(M, out_features)
        fl = 2 * M * width * out_features
        case(f"{name}_forward", fl, lambda: F.linear(inp, w), lambda t: gemm(inp, w.t(), tuned=t), diff)
        case(f"{name}_input_grad", fl, lambda: g @ w, lambda t: gemm(g, w, tuned=t), diff)
        case(f"{name}_weight_grad", fl, lambda: torch.mm(g.t(), inp, out_dtype=torch.float32),
             lambda t: gemm(g.t(), inp, out_dtype=torch.float32, tuned=t), diff)
    w, gp = rand(GU, D), rand(M, GU)
    fl = 2 * M * D * GU
    case("gate_up_input_grad", fl, lambda: gp @ w, lambda t: gemm(gp, w, tuned=t), diff)
    case("gate_up_weight_grad", fl, lambda: torch.mm(gp.t(), x, out_dtype=torch.float32),
         lambda t: gemm(gp.t(), x, out_dtype=torch.float32, tuned=t), diff)


def head_cases():
    h, w, dl = rand(CHUNK, D), rand(V, D), rand(CHUNK, V)
    fl = 2 * CHUNK * D * V
    case("head_logits", fl, lambda: h @ w.t(), lambda t: gemm(h, w.t(), tuned=t), diff)
    case("head_input_grad", fl, lambda: torch.mm(dl, w), lambda t: gemm(dl, w, tuned=t), diff)
    total = torch.zeros(V, D, device=dev)
    total_q = torch.zeros(V, D, device=dev)

    def cublas():
        torch.addmm(total, dl.t(), h, out_dtype=torch.float32, out=total)
        return total

    def quack(t):
        gemm_add_inplace(dl.t(), h, total_q, tuned=t)
        return total_q

    # both accumulate on every call: compare one call of each from zero
    def check(_, __):
        total.zero_(); total_q.zero_()
        return diff(cublas(), quack(False))

    case("head_weight_grad_accumulate", fl, cublas, quack, check)


if __name__ == "__main__":
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    which = sys.argv[1:] or ["linear", "head"]
    if "head" in which:
        head_cases()
    if "linear" in which:
        linear_cases()
