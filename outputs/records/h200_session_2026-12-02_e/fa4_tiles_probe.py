"""FlashAttention-4's SM90 tile configurations at the 200M shapes (16 x 2,048, 14 query heads over 2 KV heads,
head dim 64, causal, BF16): forward and backward configurations FA4's feasibility search
(`flash_attn/cute/sm90_config_search.py`) admits, each put in place of FA4's hard-coded choice
(`_tile_size_fwd_sm90`, `_tile_size_bwd_sm90`) in a process of its own, timed alternately with the default
(CUDA events, median), its outputs and gradients checked against the default's.

    python fa4_tiles_probe.py OUT.json
"""
import json
import statistics
import subprocess
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


def one(part, name):
    """In a process of its own (a configuration past the shared-memory limit aborts the process): the default and
    this configuration, outputs (forward) or gradients (backward) compared, timed alternately."""
    torch.manual_seed(0)
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    fwd_default, bwd_default = fa._tile_size_fwd_sm90, fa._tile_size_bwd_sm90
    if part == "forward":
        config, pack_gqa = FWD[name]

        def launch(candidate):
            fa._tile_size_fwd_sm90 = (lambda *a, **kw: config) if candidate and config else fwd_default
            with torch.no_grad():
                return [flash_attn_func(q, k, v, causal=True, pack_gqa=pack_gqa if candidate else None)[0]]
    else:
        config = BWD[name]
        out = flash_attn_func(q, k, v, causal=True)[0]

        def launch(candidate):
            fa._tile_size_bwd_sm90 = (lambda *a, **kw: config) if candidate else bwd_default
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    expected = [t.float() for t in launch(False)]
    started = time.perf_counter()
    got = launch(True)
    entry = {"config": repr(config), "compile_s": time.perf_counter() - started,
             "max_abs_diff": [(g.float() - e).abs().max().item() for g, e in zip(got, expected)],
             "ms": [], "default_ms": []}
    for _ in range(3):
        entry["default_ms"].append(events_median(lambda: launch(False)))
        entry["ms"].append(events_median(lambda: launch(True)))
    entry["over_default"] = min(entry["ms"]) / min(entry["default_ms"])
    print(json.dumps(entry))


def main(out_path):
    record = {"shapes": dict(batch=B, seq=T, q_heads=HQ, kv_heads=HKV, head_dim=D, causal=True),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "method": "one process per configuration, the default and it timed alternately (3 x median of 30, "
                        "CUDA events); forward alone, backward = FA4's pre-processing, kernel and post-processing",
              "forward": {}, "backward": {}}
    for part, names in (("backward", [n for n in BWD if n != "default"]), ("forward", list(FWD)[1:])):
        for name in names:
            try:
                done = subprocess.run([sys.executable, __file__, "--one", part, name], capture_output=True, text=True,
                                      timeout=120)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                entry = json.loads(lines[-1]) if lines else {
                    "error": f"exit {done.returncode}: " + " | ".join(
                        line for line in done.stderr.splitlines() if "rror" in line)[-400:]}
            except subprocess.TimeoutExpired:
                entry = {"error": "timed out after 120 s"}
            record[part][name] = entry
            print(part, f"{name:28s}", {key: entry.get(key) for key in ("over_default", "max_abs_diff", "error")},
                  flush=True)
            with open(out_path, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
