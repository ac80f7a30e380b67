"""One-off: quack's SM90 configs for the gated GEMM (forward) and the dgated GEMM (backward) at the 200M block's
shapes (16 x 2,048 tokens, D 896, C 3,328), each checked against the default config's outputs, timed by do_bench;
stops at a deadline. Writes config_sweep_h200.json and prints the winners."""
import json, os, sys, time
import torch
from triton.testing import do_bench
from quack.gemm_interface import gemm_gated, gemm_dgated
from quack.gemm_config import GemmConfig

deadline = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 200)
torch.manual_seed(0)
M, D, C = 16 * 2048, 896, 3328
dev = "cuda"
x = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
w = (torch.randn(2 * C, D, device=dev, dtype=torch.bfloat16) / D ** 0.5)
dy = torch.randn(M, D, device=dev, dtype=torch.bfloat16) * 0.01
down = (torch.randn(D, C, device=dev, dtype=torch.bfloat16) / C ** 0.5)
pre_ref, post_ref = gemm_gated(x, w.t(), activation="swiglu", tuned=False)
dx_ref, rec_ref = gemm_dgated(dy, down, pre_ref, activation="swiglu", tuned=False)
dx_buf, rec_buf = torch.empty_like(dx_ref), torch.empty_like(rec_ref)
pre_buf, post_buf = torch.empty_like(pre_ref), torch.empty_like(post_ref)

def cands():
    out = []
    for (m, n, pp) in [(128, 192, True), (256, 128, False), (256, 192, False), (128, 256, False), (256, 160, False),
                       (128, 224, False), (128, 128, True), (128, 160, True)]:
        for cl in [(2, 1), (1, 2)]:
            out.append(dict(tile_m=m, tile_n=n, pingpong=pp, cluster_m=cl[0], cluster_n=cl[1]))
    return out

res = {"shapes": {"M": M, "D": D, "C": C}, "forward": [], "backward": []}
res["default_forward_ms"] = do_bench(lambda: gemm_gated(x, w.t(), activation="swiglu", tuned=False,
                                                          preact_out=pre_buf, postact_out=post_buf), rep=100)
res["default_backward_ms"] = do_bench(lambda: gemm_dgated(dy, down, pre_ref, activation="swiglu", tuned=False,
                                                            dx_out=dx_buf, postact_out=rec_buf), rep=100)
print("default fwd", res["default_forward_ms"], "bwd", res["default_backward_ms"], flush=True)
for tile in cands():
    cfg = GemmConfig(**tile, is_dynamic_persistent=False, device_capacity=9)
    for kind in ("forward", "backward"):
        if time.time() > deadline:
            break
        entry = {"tile": tile}
        try:
            t0 = time.time()
            if kind == "forward":
                f = lambda: gemm_gated(x, w.t(), activation="swiglu", config=cfg, preact_out=pre_buf, postact_out=post_buf)
                f(); torch.cuda.synchronize()
                entry["max_abs_diff"] = max(float((pre_buf - pre_ref).abs().max()), float((post_buf - post_ref).abs().max()))
            else:
                f = lambda: gemm_dgated(dy, down, pre_ref, activation="swiglu", config=cfg, dx_out=dx_buf, postact_out=rec_buf)
                f(); torch.cuda.synchronize()
                entry["max_abs_diff"] = max(float((dx_buf - dx_ref).abs().max()), float((rec_buf - rec_ref).abs().max()))
            entry["compile_s"] = round(time.time() - t0, 1)
            entry["ms"] = do_bench(f, rep=100)
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        res[kind].append(entry)
        print(kind, entry, flush=True)
for kind in ("forward", "backward"):
    ok = [e for e in res[kind] if "ms" in e and e["max_abs_diff"] == 0.0]
    if ok:
        best = min(ok, key=lambda e: e["ms"])
        res["best_" + kind] = best
        print("BEST", kind, best["ms"], "default", res[f"default_{kind}_ms"], best["tile"], flush=True)
json.dump(res, open(os.environ["OUT"] + "/config_sweep_h200.json", "w"), indent=1)
