"""cflib's FlashAttention-4 call (its own autograd function, the backward on the tiles cflib chooses) against
FA4's `flash_attn_func` as it comes, at the 200M shapes (16 x 2,048, GQA 14/2, head dim 64, causal, BF16), on
the same inputs: gradients compared, forward + backward timed alternately (CUDA events, median of 20, 3 rounds).

    PYTHONPATH=. python fa4_cflib_call_ab.py OUT.json
"""
import json
import statistics
import sys

import torch
from flash_attn.cute import flash_attn_func

from cflib.ops.attention import _run_fa4

B, T, HQ, HKV, D = 16, 2048, 14, 2, 64


def median_ms(fn, repeats=20):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(out_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HQ, HKV, HKV))
    dout = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    ways = {"fa4_as_it_comes": lambda: flash_attn_func(q, k, v, causal=True)[0],
            "cflib": lambda: _run_fa4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None).transpose(1, 2)}
    grads = {name: torch.autograd.grad(way(), (q, k, v), dout) for name, way in ways.items()}
    record = {"max_abs_diff": [(a.float() - b.float()).abs().max().item()
                               for a, b in zip(grads["cflib"], grads["fa4_as_it_comes"])], "ms": {}}
    for _ in range(3):
        for name, way in ways.items():
            record["ms"].setdefault(name, []).append(median_ms(lambda: torch.autograd.grad(way(), (q, k, v), dout)))
    record["cflib_over_fa4"] = min(record["ms"]["cflib"]) / min(record["ms"]["fa4_as_it_comes"])
    print(json.dumps(record), flush=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
