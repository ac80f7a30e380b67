"""One-off probe on the H200, after grouped_mlp_probe.py: the grouped block's weight gradients (quack varlen-K, one
FP32 output per expert-pair group), where the grouped down weight's gradient ran 15% slower than the wide one.
Each at quack's default configuration and autotuned, and split: the shared columns' gradient as one dense GEMM over
all tokens, only the experts' columns per group. Medians of 8 alternating rounds of 10 calls after 100 ms of heat.

    python wgrad_probe.py OUT.json [micro_batch]
"""
import json
import statistics
import sys
import time

import torch
from quack.gemm_interface import gemm

dev = torch.device("cuda")
micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 48
N, D, SHARED, ROUTED, GROUPS = micro_batch * 2048, 896, 3072, 128, 6
gen = torch.Generator(device=dev).manual_seed(0)
group = torch.randint(0, GROUPS, (N,), generator=gen, device=dev).sort().values
cu = torch.zeros(GROUPS + 1, dtype=torch.int32, device=dev)
cu[1:] = torch.cumsum(torch.bincount(group, minlength=GROUPS), 0).to(torch.int32)
x = torch.randn(N, D, generator=gen, device=dev).to(torch.bfloat16)
dout = torch.randn(N, D, generator=gen, device=dev).to(torch.bfloat16)
act = torch.randn(N, SHARED + ROUTED, generator=gen, device=dev).to(torch.bfloat16)
act_wide = torch.randn(N, SHARED + 2 * ROUTED, generator=gen, device=dev).to(torch.bfloat16)
dpre = torch.randn(N, 2 * (SHARED + ROUTED), generator=gen, device=dev).to(torch.bfloat16)
dpre_wide = torch.randn(N, 2 * (SHARED + 2 * ROUTED), generator=gen, device=dev).to(torch.bfloat16)
f32 = torch.float32

cases = {
    "down_wide_cublas": lambda: torch.mm(dout.t(), act_wide, out_dtype=f32),
    "down_grouped": lambda: gemm(dout.t(), act, cu_seqlens_k=cu, out_dtype=f32, tuned=False),
    "down_grouped_tuned": lambda: gemm(dout.t(), act, cu_seqlens_k=cu, out_dtype=f32, tuned=True),
    "down_split": lambda: (torch.mm(dout.t(), act[:, :SHARED], out_dtype=f32),
                           gemm(dout.t(), act[:, SHARED:], cu_seqlens_k=cu, out_dtype=f32, tuned=False)),
    "gate_up_wide_cublas": lambda: torch.mm(dpre_wide.t(), x, out_dtype=f32),
    "gate_up_grouped": lambda: gemm(dpre.t(), x, cu_seqlens_k=cu, out_dtype=f32, tuned=False),
    "gate_up_grouped_tuned": lambda: gemm(dpre.t(), x, cu_seqlens_k=cu, out_dtype=f32, tuned=True),
    "gate_up_split": lambda: (torch.mm(dpre[:, :2 * SHARED].t(), x, out_dtype=f32),
                              gemm(dpre[:, 2 * SHARED:].t(), x, cu_seqlens_k=cu, out_dtype=f32, tuned=False)),
}
record = {"micro_batch": micro_batch, "errors": {}}
for name, fn in list(cases.items()):
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as error:
        record["errors"][name] = repr(error)[:400]
        del cases[name]
print("errors", record["errors"], flush=True)


def timed(fn, reps=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
until = time.perf_counter() + 0.1
while time.perf_counter() < until:
    a @ a
    torch.cuda.synchronize()
times = {k: [] for k in cases}
for _ in range(8):
    for name, fn in cases.items():
        times[name].append(timed(fn))
record["ms_median"] = {k: statistics.median(v) for k, v in times.items()}
print(json.dumps(record["ms_median"]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(record, f, indent=1)
