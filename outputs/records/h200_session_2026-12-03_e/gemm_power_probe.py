"""Each GEMM of the 200M step at micro-batch 48, on cuBLAS and on quack's tiles the GEMM race tries, timed two
ways: as the race times it (best of 2 rounds of 5 calls, after a pause), and sustained (calls back to back for
0.5 s after 0.5 s of them: the clocks the board's power limit leaves), with the board's energy per call (NVML's
energy counter). Under the power limit a step's speed follows its energy: a kernel that wins a burst by drawing
more power can lose in the step. One JSON line per GEMM and candidate.

    python gemm_power_probe.py OUT.jsonl"""
import json
import sys
import time

import pynvml
import torch

from cflib.ops.gemm import QUACK_TILES, _event_time, _quack_gemm, accumulate_product

device = torch.device("cuda")
gen = torch.Generator(device=device).manual_seed(0)
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
T, S, C = 98304, 65536, 1024


def randn(*shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen, device=device) * 0.1).to(dtype)


def shapes():
    # (name, kind, a, b, out) as cflib.ops.gemm.RacedGemms calls each kind: out (+)= a @ b
    x, h = randn(T, 896), randn(T, 3328)
    w_qkv, w_o, w_d, w_gu, head = randn(1152, 896), randn(896, 896), randn(896, 3328), randn(6656, 896), randn(32000, 896)
    g_qkv, g_d, g_gu = randn(T, 1152), randn(T, 896), randn(T, 6656)
    bf = dict(device=device, dtype=torch.bfloat16)
    f32 = dict(device=device, dtype=torch.float32)
    yield "qkv_forward", "linear", x, w_qkv.t(), torch.empty(T, 1152, **bf)
    yield "o_forward", "linear", x, w_o.t(), torch.empty(T, 896, **bf)
    yield "down_forward", "linear", h, w_d.t(), torch.empty(T, 896, **bf)
    yield "qkv_input_grad", "matmul", g_qkv, w_qkv, torch.empty(T, 896, **bf)
    yield "o_input_grad", "matmul", g_d, w_o, torch.empty(T, 896, **bf)
    yield "down_input_grad", "matmul", g_d, w_d, torch.empty(T, 3328, **bf)
    yield "gate_up_input_grad", "matmul", g_gu, w_gu, torch.empty(T, 896, **bf)
    yield "qkv_weight_grad", "weight_gradient", g_qkv.t(), x, torch.empty(1152, 896, **f32)
    yield "o_weight_grad", "weight_gradient", g_d.t(), x, torch.empty(896, 896, **f32)
    yield "down_weight_grad", "weight_gradient", g_d.t(), h, torch.empty(896, 3328, **f32)
    yield "gate_up_weight_grad", "weight_gradient", g_gu.t(), x, torch.empty(6656, 896, **f32)
    logits_grad = randn(C, 32000)
    yield "head_logits", "linear", x[:C], head.t(), torch.empty(C, 32000, **bf)
    yield "head_input_grad", "matmul", logits_grad, head, torch.empty(C, 896, **bf)
    yield "head_weight_grad", "accumulate", logits_grad.t(), x[:C], torch.zeros(32000, 896, **f32)


def cublas(kind, a, b):
    if kind == "weight_gradient":
        return lambda o: torch.mm(a, b, out_dtype=torch.float32, out=o)
    if kind == "accumulate":
        return lambda o: accumulate_product(o, a, b)
    return lambda o: torch.mm(a, b, out=o)


def sustained(run, seconds=0.5):
    def loop(duration):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            for _ in range(20):
                run()
            count += 20
            torch.cuda.synchronize()
        return count, time.perf_counter() - start
    loop(seconds)
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    count, elapsed = loop(seconds)
    joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - energy) / 1e3
    clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    return {"sustained_us": elapsed / count * 1e6, "watts": joules / elapsed, "mj_per_call": joules / count * 1e3,
            "mhz": clock}


with open(sys.argv[1], "w") as log:
    for name, kind, a, b, out in shapes():
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        runs = {"cublas": (lambda o, a=a, b=b, kind=kind: cublas(kind, a, b)(o))}
        for tile in QUACK_TILES[kind]:
            runs[str(tile)] = (lambda o, a=a, b=b, tile=tile, kind=kind: _quack_gemm(a, b, o, tile, kind == "accumulate"))
        for label, run in runs.items():
            try:
                run(out)
            except Exception as err:  # noqa: BLE001
                print(json.dumps({"gemm": name, "candidate": label, "error": str(err)[:200]}), file=log, flush=True)
                continue
            torch.cuda.synchronize()
            time.sleep(0.3)
            burst = min(_event_time(lambda: run(out)) for _ in range(2)) * 1e3
            row = {"gemm": name, "kind": kind, "candidate": label, "burst_us": burst, **sustained(lambda: run(out))}
            row["sustained_tflops"] = flops / row["sustained_us"] / 1e6
            print(json.dumps(row), file=log, flush=True)
            print(name, label, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                                if k not in ("gemm", "candidate", "kind")}, flush=True)
