"""One-off probe on the H200: the TR-MoE block's GEMMs at the 200M shapes, as the step runs them today (one wide
SwiGLU over the shared columns and all four experts' for every token, the experts' columns zeroed per token by
their route weights) against the same block grouped by expert pair (tokens sorted into the six pairs of experts a
token can take, each group's GEMMs over the shared columns and its own two experts' only: 3,200 of 3,328 columns,
quack's varlen-M and varlen-K GEMMs with one weight slice per group).

The grouped block's GEMM FLOPs are 9,600 / 9,984 of the wide one's. This probe says whether the grouped GEMMs keep
the wide ones' speed (varlen tiles, six weight slices) so that the saving reaches the step; the data movement
around them (rows permuted by the norms' kernels, the weight slices written by the optimizer, the groups' weight
gradients summed) is not timed here.

    python grouped_mlp_probe.py OUT.json [micro_batch] [rounds]

Each variant runs the block's six GEMMs (gate|up with the SwiGLU epilogue, down; backward: the activation's
gradient, the down weight's gradient in FP32, the gate|up weight's gradient in FP32, the input's gradient) back to
back. After 100 ms of heat the variants alternate over `rounds` rounds of 10 repetitions each (CUDA events),
medians per variant; then each GEMM alone, the same way. Outputs are checked against float32 references on a few
rows and groups, so the API is read right.
"""
import json
import statistics
import sys
import time

import torch
from quack.gemm_interface import gemm, gemm_gated

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
micro_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 48
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
N, D, SHARED, EXPERTS, WIDTH = micro_batch * 2048, 896, 3072, 4, 64
PAIRS = [(a, b) for a in range(EXPERTS) for b in range(a + 1, EXPERTS)]  # six unordered pairs
bf = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)


def randn(*shape, scale=0.02):
    return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf)


# Weights as the step holds its BF16 copies: gate|up interleaved row by row [2C, D], down [D, C].
wide = SHARED + EXPERTS * WIDTH
w_gate_up = randn(2 * wide, D)
w_down = randn(D, wide)
pair_of_token = torch.randint(0, len(PAIRS), (N,), generator=gen, device=dev)
order = torch.argsort(pair_of_token, stable=True)
counts = torch.bincount(pair_of_token, minlength=len(PAIRS))
cu = torch.zeros(len(PAIRS) + 1, dtype=torch.int32, device=dev)
cu[1:] = torch.cumsum(counts, 0).to(torch.int32)


def group_columns(pair):
    """The activation columns of one group: the shared ones, then its two experts' (in the wide layout)."""
    cols = list(range(SHARED))
    for e in pair:
        cols += list(range(SHARED + e * WIDTH, SHARED + (e + 1) * WIDTH))
    return torch.tensor(cols, device=dev)


group_cols = [group_columns(p) for p in PAIRS]
narrow = len(group_cols[0])  # 3,200
# Per group: gate|up [2c, D] interleaved (rows 2j, 2j+1 = gate, up of column j), down [D, c].
interleaved = [torch.stack([2 * c, 2 * c + 1], 1).reshape(-1) for c in group_cols]
gu_groups = torch.stack([w_gate_up[rows] for rows in interleaved])          # [6, 2c, D]
down_groups = torch.stack([w_down[:, c] for c in group_cols])              # [6, D, c]

x = randn(N, D, scale=1.0)
x_sorted = x[order].contiguous()
dout = randn(N, D, scale=1.0)
dout_sorted = dout[order].contiguous()


def wide_set(quack_all: bool):
    pre, act = gemm_gated(x, w_gate_up.t(), activation="swiglu", tuned=False)
    mm = (lambda a, b, **k: gemm(a, b, tuned=False, **k)) if quack_all else None
    if quack_all:
        out = mm(act, w_down.t())
        dact = mm(dout, w_down)
        dw_down = mm(dout.t(), act, out_dtype=torch.float32)
        dw_gu = mm(pre.t(), x, out_dtype=torch.float32)  # pre stands in for its gradient: same shape, layout
        dx = mm(pre, w_gate_up)
    else:
        out = act @ w_down.t()
        dact = dout @ w_down
        dw_down = torch.mm(dout.t(), act, out_dtype=torch.float32)
        dw_gu = torch.mm(pre.t(), x, out_dtype=torch.float32)
        dx = pre @ w_gate_up
    return pre, act, out, dact, dw_down, dw_gu, dx


def grouped_set():
    pre, act = gemm_gated(x_sorted, gu_groups.transpose(1, 2), activation="swiglu", cu_seqlens_m=cu, tuned=False)
    out = gemm(act, down_groups.transpose(1, 2), cu_seqlens_m=cu, tuned=False)
    dact = gemm(dout_sorted, down_groups, cu_seqlens_m=cu, tuned=False)
    dw_down = gemm(dout_sorted.t(), act, cu_seqlens_k=cu, out_dtype=torch.float32, tuned=False)
    dw_gu = gemm(pre.t(), x_sorted, cu_seqlens_k=cu, out_dtype=torch.float32, tuned=False)
    dx = gemm(pre, gu_groups, cu_seqlens_m=cu, tuned=False)
    return pre, act, out, dact, dw_down, dw_gu, dx


def check_grouped(outs) -> dict:
    """Each grouped output against float32 on a few rows of two groups: the API read right."""
    pre, act, out, dact, dw_down, dw_gu, dx = outs
    errors = {}
    for g in (0, len(PAIRS) - 1):
        lo, hi = int(cu[g]), int(cu[g + 1])
        rows = slice(lo, lo + 64)
        xs, ds = x_sorted[rows].float(), dout_sorted[rows].float()
        ref_pre = xs @ gu_groups[g].float().t()
        gate, up = ref_pre.unflatten(1, (-1, 2)).unbind(2)
        ref_act = torch.nn.functional.silu(gate) * up
        errors[f"g{g}_pre"] = (pre[rows].float() - ref_pre).abs().max().item()
        errors[f"g{g}_act"] = (act[rows].float() - ref_act).abs().max().item()
        errors[f"g{g}_out"] = (out[rows].float() - act[rows].float() @ down_groups[g].float().t()).abs().max().item()
        errors[f"g{g}_dact"] = (dact[rows].float() - ds @ down_groups[g].float()).abs().max().item()
        errors[f"g{g}_dx"] = (dx[rows].float() - pre[rows].float() @ gu_groups[g].float()).abs().max().item()
        full = slice(lo, hi)
        ref_dw_down = dout_sorted[full].float().t() @ act[full].float()
        errors[f"g{g}_dw_down_rel"] = ((dw_down[g] - ref_dw_down).abs().max() / ref_dw_down.abs().max()).item()
        ref_dw_gu = pre[full].float().t() @ x_sorted[full].float()
        errors[f"g{g}_dw_gu_rel"] = ((dw_gu[g] - ref_dw_gu).abs().max() / ref_dw_gu.abs().max()).item()
    return errors


def timed(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def heat(ms: float) -> None:
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    until = time.perf_counter() + ms / 1e3
    while time.perf_counter() < until:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


record = {"micro_batch": micro_batch, "tokens": N, "group_rows": counts.tolist(), "narrow_columns": narrow,
          "wide_columns": wide, "flop_ratio": narrow / wide, "gpu": torch.cuda.get_device_name()}
variants = {"wide_cublas": lambda: wide_set(False), "wide_quack": lambda: wide_set(True), "grouped": grouped_set}
for name, fn in variants.items():  # compile and warm each
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as error:  # a variant the installed quack refuses
        record[f"{name}_error"] = repr(error)[:600]
        print(name, "failed:", repr(error)[:600], flush=True)
runnable = {k: v for k, v in variants.items() if f"{k}_error" not in record}
if "grouped" in runnable:
    record["grouped_errors"] = check_grouped(grouped_set())
    print("grouped errors", json.dumps(record["grouped_errors"]), flush=True)

heat(100)
times = {k: [] for k in runnable}
for _ in range(rounds):
    for name, fn in runnable.items():
        times[name].append(timed(fn, 10))
record["set_ms_rounds"] = times
record["set_ms_median"] = {k: statistics.median(v) for k, v in times.items()}
if "grouped" in runnable:
    for base in ("wide_cublas", "wide_quack"):
        if base in runnable:
            record[f"grouped_over_{base}"] = record["set_ms_median"]["grouped"] / record["set_ms_median"][base]
print("sets", json.dumps(record["set_ms_median"]), flush=True)

# Each GEMM alone, to see where a difference comes from.
if "grouped" in runnable:
    pre_w, act_w = gemm_gated(x, w_gate_up.t(), activation="swiglu", tuned=False)
    pre_g, act_g = gemm_gated(x_sorted, gu_groups.transpose(1, 2), activation="swiglu", cu_seqlens_m=cu, tuned=False)
    singles = {
        "gate_up_fwd": (lambda: gemm_gated(x, w_gate_up.t(), activation="swiglu", tuned=False),
                        lambda: gemm_gated(x_sorted, gu_groups.transpose(1, 2), activation="swiglu",
                                           cu_seqlens_m=cu, tuned=False)),
        "down_fwd": (lambda: act_w @ w_down.t(),
                     lambda: gemm(act_g, down_groups.transpose(1, 2), cu_seqlens_m=cu, tuned=False)),
        "down_dgrad": (lambda: dout @ w_down, lambda: gemm(dout_sorted, down_groups, cu_seqlens_m=cu, tuned=False)),
        "down_wgrad": (lambda: torch.mm(dout.t(), act_w, out_dtype=torch.float32),
                       lambda: gemm(dout_sorted.t(), act_g, cu_seqlens_k=cu, out_dtype=torch.float32, tuned=False)),
        "gate_up_wgrad": (lambda: torch.mm(pre_w.t(), x, out_dtype=torch.float32),
                          lambda: gemm(pre_g.t(), x_sorted, cu_seqlens_k=cu, out_dtype=torch.float32, tuned=False)),
        "gate_up_dgrad": (lambda: pre_w @ w_gate_up, lambda: gemm(pre_g, gu_groups, cu_seqlens_m=cu, tuned=False)),
    }
    single_times = {}
    heat(100)
    for name, (wide_fn, grouped_fn) in singles.items():
        pair = {"wide": [], "grouped": []}
        try:
            for _ in range(rounds):
                pair["wide"].append(timed(wide_fn, 10))
                pair["grouped"].append(timed(grouped_fn, 10))
        except Exception as error:
            single_times[name] = {"error": repr(error)[:400]}
            continue
        single_times[name] = {k: statistics.median(v) for k, v in pair.items()}
        single_times[name]["ratio"] = single_times[name]["grouped"] / single_times[name]["wide"]
    record["single_ms_median"] = single_times
    print("singles", json.dumps(single_times), flush=True)

with open(sys.argv[1], "w") as f:
    json.dump(record, f, indent=1)
