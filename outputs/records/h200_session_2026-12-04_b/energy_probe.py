"""Where a step's energy goes at the power limit: each kernel family of the 200M step looped alone at the step's
shapes (micro-batch 16 x 2,048 tokens, BF16), its time per call with the board's power (W) and SM clock (MHz) read
through NVML while it runs. Energy per call = median W x time per call; per FLOP for the compute-bound families,
per HBM byte for the memory-bound ones.

    python energy_probe.py OUT.json [seconds per family]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from cflib.bench.timing import gpu_clock_and_power
from cflib.ops.add_rms_norm import add_rms_norm

DEVICE = torch.device("cuda")
TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 16 * 2048, 896, 14, 2, 64, 2048


def gemm(m: int, k: int, n: int):
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    return (lambda: torch.mm(a, b)), {"flop": 2 * m * k * n}


def attention():
    from flash_attn.cute import flash_attn_func
    batch = TOKENS // SEQ
    q = torch.randn(batch, SEQ, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, SEQ, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, SEQ, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, SEQ, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)

    def call():
        out = flash_attn_func(q, k, v, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
    # causal: half the score matrix; forward 2 GEMMs, backward 5 (FA's count), each 2 x T x T/2 x D per head
    return call, {"flop": 7 * 2 * batch * HEADS * SEQ * (SEQ // 2) * HEAD_DIM}


def norm():
    h = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.float32, requires_grad=True)
    delta = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(HIDDEN, device=DEVICE, dtype=torch.float32, requires_grad=True)
    g_stream = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.float32)
    g_out = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16)

    def call():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            stream, out = add_rms_norm(h, delta, weight, 1e-6, False, True)
        torch.autograd.backward((stream, out), (g_stream, g_out))
    # forward 12 B an element (h, delta in; sum, output out), backward 14 (docs/kernels.md)
    return call, {"hbm_bytes": 26 * TOKENS * HIDDEN}


def copy():
    src = torch.randn(TOKENS, 2 * 3328, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), {"hbm_bytes": 2 * src.numel() * src.element_size()}


FAMILIES = {
    "matmul_8192": lambda: gemm(8192, 8192, 8192),
    "gemm_gate_up_fwd": lambda: gemm(TOKENS, HIDDEN, 2 * 3328),
    "gemm_down_wgrad": lambda: gemm(3328, TOKENS, HIDDEN),
    "fa4_fwd_bwd": attention,
    "add_rms_norm_fwd_bwd": norm,
    "copy_bf16": copy,
}


def measure(name: str, seconds: float) -> dict:
    call, work = FAMILIES[name]()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    warm_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < warm_end:  # to the power limit's clocks
        call()
    torch.cuda.synchronize()
    samples, calls = [], 0
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end = time.perf_counter() + seconds
    next_sample = 0.0
    while time.perf_counter() < end:
        call()
        calls += 1
        now = time.perf_counter()
        if now >= next_sample:
            samples.append(gpu_clock_and_power(DEVICE))
            next_sample = now + 0.05
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / calls
    watts = statistics.median(w for _, w in samples)
    row = {"family": name, "calls": calls, "ms_per_call": ms, "watts": watts,
           "mhz": statistics.median(c for c, _ in samples), "mj_per_call": watts * ms, **work}
    if "flop" in work:
        row["tflop_per_s"] = work["flop"] / ms / 1e9
        row["pj_per_flop"] = watts * ms * 1e-3 / work["flop"] * 1e12
    if "hbm_bytes" in work:
        row["tb_per_s"] = work["hbm_bytes"] / ms / 1e9
        row["pj_per_byte"] = watts * ms * 1e-3 / work["hbm_bytes"] * 1e12
    return row


def main() -> None:
    out, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    idle = []
    for _ in range(10):
        time.sleep(0.1)
        idle.append(gpu_clock_and_power(DEVICE))
    rows = [{"family": "idle", "watts": statistics.median(w for _, w in idle),
             "mhz": statistics.median(c for c, _ in idle)}]
    for name in FAMILIES:
        try:
            rows.append(measure(name, seconds))
        except Exception as error:  # noqa: BLE001  (one family failing leaves the others)
            rows.append({"family": name, "error": f"{type(error).__name__}: {error}"[:400]})
        print(json.dumps(rows[-1]), flush=True)
    json.dump({"seconds_per_family": seconds, "tokens": TOKENS, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
