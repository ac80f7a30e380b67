"""FlashAttention-4's SM90 tile configurations at the 200M shapes (16 x 2,048, 14 query heads over 2 KV heads,
head dim 64, causal, BF16): each forward and backward configuration its feasibility search admits, put in place
of FA4's hard-coded choice (`_tile_size_fwd_sm90`, `_tile_size_bwd_sm90`), timed round robin (CUDA events,
median), its outputs and gradients checked against the default configuration's.

    python fa4_tiles_probe.py OUT.json
"""
import json
import statistics
import sys
import time

import torch
import flash_attn.cute.interface as fa
from flash_attn.cute import flash_attn_func

B, T, HQ, HKV, D = 16, 2048, 14, 2, 64
F, BW = fa.FwdConfig, fa.BwdConfig
FWD = {  # name: (FwdConfig, pack_gqa)
    "default": (None, None),
    "default_pack_gqa_false": (None, False),
    "default_pack_gqa_true": (None, True),
    "192x128_rs_noolap": (F(192, 128, True, False), None),
    "128x128_rs_olap": (F(128, 128, True, True), None),
    "128x160_rs_olap": (F(128, 160, True, True), None),
    "128x192_rs_olap": (F(128, 192, True, True), None),
    "192x160_rs_noolap": (F(192, 160, True, False), None),
    "192x192_rs_noolap": (F(192, 192, True, False), None),
}


def bwd(m, n, sdp, dkv, dq, a_sdp, a_dkv, a_dq, q_stages=2, do_stages=2, num_wg=2, dq_single_wg=False):
    return BW(m_block_size=m, n_block_size=n, num_stages_Q=q_stages, num_stages_dO=do_stages, num_stages_PdS=2,
              SdP_swapAB=sdp, dKV_swapAB=dkv, dQ_swapAB=dq, AtomLayoutMSdP=a_sdp, AtomLayoutNdKV=a_dkv,
              AtomLayoutMdQ=a_dq, num_wg=num_wg, dQ_single_wg=dq_single_wg)


BWD = {
    "default": None,
    "128x128_dQ_atom1": bwd(128, 128, True, False, False, 1, 2, 1),
    "128x128_noswap_atom2": bwd(128, 128, False, False, False, 2, 2, 2),
    "128x128_dQswap": bwd(128, 128, True, False, True, 1, 2, 2),
    "96x128": bwd(96, 128, True, False, True, 1, 2, 2),
    "80x128": bwd(80, 128, True, False, True, 1, 2, 2),
    "64x128": bwd(64, 128, True, False, False, 1, 2, 1),
    "64x192": bwd(64, 192, False, True, False, 1, 2, 1),
    "80x192": bwd(80, 192, True, True, True, 2, 2, 2),
    "128x96": bwd(128, 96, False, True, False, 2, 2, 2),
    "192x96_3wg": bwd(192, 96, False, True, False, 3, 3, 3, do_stages=1, num_wg=3),
}


def events_median(fn, repeats=30):
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
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    fwd_default, bwd_default = fa._tile_size_fwd_sm90, fa._tile_size_bwd_sm90
    record = {"shapes": dict(batch=B, seq=T, q_heads=HQ, kv_heads=HKV, head_dim=D, causal=True),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "forward": {}, "backward": {}}
    reference = {}

    def forward_with(config, pack_gqa):
        fa._tile_size_fwd_sm90 = fwd_default if config is None else (lambda *a, **kw: config)
        return lambda: flash_attn_func(q, k, v, causal=True, pack_gqa=pack_gqa)[0]

    runs = {}
    for name, (config, pack_gqa) in FWD.items():
        entry = record["forward"][name] = {"config": None if config is None else repr(config), "pack_gqa": pack_gqa}
        try:
            started = time.perf_counter()
            with torch.no_grad():
                out = forward_with(config, pack_gqa)()
            entry["compile_s"] = time.perf_counter() - started
            if name == "default":
                reference["out"] = out.float()
            entry["max_abs_diff"] = (out.float() - reference["out"]).abs().max().item()
            runs[name] = (config, pack_gqa)
        except Exception as err:  # noqa: BLE001 - a configuration that fails to compile is recorded
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print("fwd", name, entry, flush=True)
    for rep in range(3):  # round robin
        for name, (config, pack_gqa) in runs.items():
            fn = forward_with(config, pack_gqa)
            with torch.no_grad():
                record["forward"][name].setdefault("ms", []).append(events_median(fn))
    fa._tile_size_fwd_sm90 = fwd_default

    out = flash_attn_func(q, k, v, causal=True)[0]

    def backward_with(config):
        fa._tile_size_bwd_sm90 = bwd_default if config is None else (lambda *a, **kw: config)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    runs = {}
    for name, config in BWD.items():
        entry = record["backward"][name] = {"config": None if config is None else repr(config)}
        try:
            started = time.perf_counter()
            grads = backward_with(config)()
            entry["compile_s"] = time.perf_counter() - started
            if name == "default":
                reference["grads"] = [g.float() for g in grads]
            entry["max_abs_diff"] = [(g.float() - r).abs().max().item() for g, r in zip(grads, reference["grads"])]
            runs[name] = config
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print("bwd", name, entry, flush=True)
    for rep in range(3):
        for name, config in runs.items():
            record["backward"][name].setdefault("ms", []).append(events_median(backward_with(config)))
    fa._tile_size_bwd_sm90 = bwd_default
    for part in ("forward", "backward"):
        base = min(record[part]["default"]["ms"])
        for name, entry in record[part].items():
            if "ms" in entry:
                entry["best_ms"] = min(entry["ms"])
                entry["over_default"] = entry["best_ms"] / base
                print(part, f"{name:28s} {entry['best_ms']:.3f} ms  x{entry['over_default']:.3f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
