"""The GEMMs of the 200M step whose outputs leave SMs idle, at micro-batches 16 and 48: cuBLAS (as cflib calls
it) against every candidate RacedGemms races (cflib.ops.gemm.race_candidates: quack's tiles unsplit and split
over K), each timed as the race times it, best of 3 rounds of 5 calls after a warm call. One JSON line a shape.

    python split_k_probe.py OUT.jsonl"""
import json
import sys
import time

import torch

from cflib.ops.gemm import _event_time, _quack_gemm, accumulate_product, race_candidates

device = torch.device("cuda")
gen = torch.Generator(device=device).manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def shapes(tokens: int):
    # (name, kind, a, b, out): a @ b into out, as RacedGemms calls each kind
    grad_qkv, grad_d, x, h = randn(tokens, 1152), randn(tokens, 896), randn(tokens, 896), randn(tokens, 3328)
    yield "qkv_weight_grad", "weight_gradient", grad_qkv.t(), x, torch.empty(1152, 896, device=device)
    yield "o_weight_grad", "weight_gradient", grad_d.t(), x, torch.empty(896, 896, device=device)
    yield "down_weight_grad", "weight_gradient", grad_d.t(), h, torch.empty(896, 3328, device=device)
    logits_grad, head = randn(1024, 32000), randn(32000, 896)
    yield "head_input_grad", "matmul", logits_grad, head, torch.empty(1024, 896, device=device, dtype=torch.bfloat16)


def cublas(kind, a, b):
    if kind == "weight_gradient":
        return lambda o: torch.mm(a, b, out_dtype=torch.float32, out=o)
    if kind == "accumulate":
        return lambda o: accumulate_product(o, a, b)
    return lambda o: torch.mm(a, b, out=o)


with open(sys.argv[1], "w") as log:
    log.write(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}) + "\n")
    for tokens in (16 * 2048, 48 * 2048):
        for name, kind, a, b, out in shapes(tokens):
            run = cublas(kind, a, b)
            run(out)
            reference = out.clone()
            row = {"gemm": name, "tokens": tokens, "shape": [a.shape[0], a.shape[1], b.shape[1]],
                   "cublas_us": min(_event_time(lambda: run(out)) for _ in range(3)) * 1e3}
            for candidate in race_candidates(kind, a, b):
                label = f"{candidate[0]} split {candidate[1]}"
                try:
                    started = time.perf_counter()
                    _quack_gemm(a, b, out, candidate, kind == "accumulate")
                    torch.cuda.synchronize()
                    first = time.perf_counter() - started
                except Exception as err:  # noqa: BLE001
                    row[label] = f"refused: {type(err).__name__}: {err}"[:200]
                    continue
                row[label] = {"us": min(_event_time(lambda: _quack_gemm(a, b, out, candidate, False))
                                        for _ in range(3)) * 1e3,
                              "first_call_s": round(first, 2),
                              "max_abs_diff": (out.float() - reference.float()).abs().max().item()}
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(name, tokens, round(row["cublas_us"], 1),
                  {k: (round(v["us"], 1) if isinstance(v, dict) else v) for k, v in row.items() if " split " in k})
