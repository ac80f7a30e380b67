"""Every GEMM shape of the 200M production step (micro-batch 16 x 2,048), cuBLAS (torch.mm) against quack's
default GEMM (quack.gemm_interface.gemm, tuned=False), each on the operands' layouts as the step has them,
checked against each other, timed round robin (triton.testing.do_bench median), with per-step counts.

    python gemm_probe.py OUT.json
"""
import json
import sys

import torch
from triton.testing import do_bench

N, D, C, QKV, V, CHUNK = 16 * 2048, 896, 3328, 1152, 32000, 1024
LAYERS, CHUNKS = 16, 22  # 21,845 supervised tokens a step, 1,024 a loss chunk


def rows(m, k):
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16)


def cols(m, k):  # an [m, k] view of a row-major [k, m] tensor, as W.t() or g.t()
    return torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t()


# name, A, B, out dtype, per-step count
SHAPES = [
    ("fwd qkv", lambda: (rows(N, D), cols(D, QKV)), torch.bfloat16, LAYERS),
    ("fwd o", lambda: (rows(N, D), cols(D, D)), torch.bfloat16, LAYERS),
    ("fwd gate_up", lambda: (rows(N, D), cols(D, 2 * C)), torch.bfloat16, LAYERS),
    ("fwd down", lambda: (rows(N, C), cols(C, D)), torch.bfloat16, LAYERS),
    ("dgrad qkv", lambda: (rows(N, QKV), rows(QKV, D)), torch.bfloat16, LAYERS),
    ("dgrad o", lambda: (rows(N, D), rows(D, D)), torch.bfloat16, LAYERS),
    ("dgrad gate_up", lambda: (rows(N, 2 * C), rows(2 * C, D)), torch.bfloat16, LAYERS),
    ("dgrad down", lambda: (rows(N, D), rows(D, C)), torch.bfloat16, LAYERS),
    ("wgrad qkv fp32", lambda: (cols(QKV, N), rows(N, D)), torch.float32, LAYERS),
    ("wgrad o fp32", lambda: (cols(D, N), rows(N, D)), torch.float32, LAYERS),
    ("wgrad gate_up fp32", lambda: (cols(2 * C, N), rows(N, D)), torch.float32, LAYERS),
    ("wgrad down", lambda: (cols(D, N), rows(N, C)), torch.bfloat16, LAYERS),
    ("head fwd", lambda: (rows(CHUNK, D), cols(D, V)), torch.bfloat16, CHUNKS),
    ("head dgrad", lambda: (rows(CHUNK, V), rows(V, D)), torch.bfloat16, CHUNKS),
    ("head wgrad fp32", lambda: (cols(V, CHUNK), rows(CHUNK, D)), torch.float32, CHUNKS),
]


def main(out_path):
    from quack.gemm_interface import gemm
    results = []
    for name, make, out_dtype, count in SHAPES:
        a, b = make()
        m, n = a.shape[0], b.shape[1]
        out_cublas = torch.empty(m, n, device="cuda", dtype=out_dtype)
        out_quack = torch.empty(m, n, device="cuda", dtype=out_dtype)
        entry = {"shape": name, "m": m, "k": a.shape[1], "n": n, "out_dtype": str(out_dtype), "per_step": count,
                 "gflop": 2 * m * a.shape[1] * n / 1e9}
        cublas = (lambda: torch.mm(a, b, out_dtype=out_dtype)) if out_dtype == torch.float32 else (
            lambda: torch.mm(a, b, out=out_cublas))
        quack = lambda: gemm(a, b, out=out_quack, tuned=False)  # noqa: E731
        try:
            out_cublas.copy_(cublas())
            quack()
            torch.cuda.synchronize()
            entry["rel_diff"] = ((out_quack.float() - out_cublas.float()).norm() / out_cublas.float().norm()).item()
            times = {"cublas": [], "quack": []}
            for _ in range(3):
                times["cublas"].append(do_bench(cublas, warmup=25, rep=150, return_mode="median"))
                times["quack"].append(do_bench(quack, warmup=25, rep=150, return_mode="median"))
            entry.update({f"ms_{k}": min(v) for k, v in times.items()}, repeats=times)
            entry["quack_over_cublas"] = entry["ms_quack"] / entry["ms_cublas"]
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        results.append(entry)
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items() if k != "repeats"},
              flush=True)
    step = {k: sum(e[f"ms_{k}"] * e["per_step"] for e in results if f"ms_{k}" in e) for k in ("cublas", "quack")}
    best = sum(min(e["ms_cublas"], e["ms_quack"]) * e["per_step"] for e in results if "ms_quack" in e)
    print("per step ms:", step, "best of each:", best, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": results,
               "per_step_ms": step, "per_step_ms_best_of_each": best}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
