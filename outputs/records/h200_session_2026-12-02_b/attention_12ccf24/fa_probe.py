"""One-off: FlashAttention-4 at the 200M shapes (16 x 2,048, GQA 14/2, head dim 64, causal, BF16) on SM90:
the forward's tile options, the backward's configs (interface._tile_size_bwd_sm90 replaced), and GQA against
K/V expanded to 14 heads (dK/dV summed per group after). Each variant's outputs against the default's."""
import json, os, sys, time
import torch
from triton.testing import do_bench
import flash_attn.cute.interface as I

deadline = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 300)
torch.manual_seed(0)
B, S, H, HK, D = 16, 2048, 14, 2, 64
dev = "cuda"
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, S, HK, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, S, HK, D, device=dev, dtype=torch.bfloat16)
do = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
res = {"shape": [B, S, H, HK, D], "forward": [], "backward": []}

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

out, lse = I._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
ref = I._flash_attn_bwd(q, k, v, out, do, lse, causal=True)[:3]
res["default_forward_ms"] = do_bench(lambda: I._flash_attn_fwd(q, k, v, causal=True, return_lse=True), rep=200)
res["default_backward_ms"] = do_bench(lambda: I._flash_attn_bwd(q, k, v, out, do, lse, causal=True), rep=200)
print("default fwd", res["default_forward_ms"], "bwd", res["default_backward_ms"], flush=True)

# GQA against expanded K/V: expansion + MHA forward + MHA backward + the group sums, against the default pair.
def expanded():
    ke, ve = k.repeat_interleave(H // HK, dim=2), v.repeat_interleave(H // HK, dim=2)
    o, l = I._flash_attn_fwd(q, ke, ve, causal=True, return_lse=True)[:2]
    dq, dke, dve = I._flash_attn_bwd(q, ke, ve, o, do, l, causal=True)[:3]
    return o, dq, dke.unflatten(2, (HK, H // HK)).sum(3), dve.unflatten(2, (HK, H // HK)).sum(3)
try:
    o, dq, dk, dv = expanded()
    res["expanded_kv"] = {"ms_forward_backward": do_bench(expanded, rep=200),
                          "default_ms_forward_backward": res["default_forward_ms"] + res["default_backward_ms"],
                          "rel": [rel(o, out), rel(dq, ref[0]), rel(dk, ref[1]), rel(dv, ref[2])]}
except Exception as err:  # noqa: BLE001
    res["expanded_kv"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
print("expanded", res["expanded_kv"], flush=True)

for opts in [dict(pack_gqa=False), dict(pack_gqa=True), dict(tile_mn=(128, 128), mma_pv_is_rs=True, intra_wg_overlap=True),
             dict(tile_mn=(192, 128), mma_pv_is_rs=False, intra_wg_overlap=True),
             dict(tile_mn=(128, 176), mma_pv_is_rs=True, intra_wg_overlap=True),
             dict(tile_mn=(192, 160), mma_pv_is_rs=True, intra_wg_overlap=True)]:
    if time.time() > deadline:
        break
    entry = {"options": {k_: list(v_) if isinstance(v_, tuple) else v_ for k_, v_ in opts.items()}}
    try:
        o = I._flash_attn_fwd(q, k, v, causal=True, return_lse=True, **opts)[0]
        entry["rel"] = rel(o, out)
        entry["ms"] = do_bench(lambda: I._flash_attn_fwd(q, k, v, causal=True, return_lse=True, **opts), rep=200)
    except Exception as err:  # noqa: BLE001
        entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    res["forward"].append(entry); print("fwd", entry, flush=True)

original = I._tile_size_bwd_sm90
C = I.BwdConfig
for name, cfg in [
    ("m64n128", C(64, 128, 2, 2, 2, True, False, False, 1, 2, 1)),
    ("m64n128_dq1wg", C(64, 128, 2, 2, 2, True, False, False, 1, 2, 1, dQ_single_wg=True)),
    ("m128n128_noswap", C(128, 128, 2, 2, 2, False, False, False, 2, 2, 2)),
    ("m128n128_pds1", C(128, 128, 2, 2, 1, True, False, False, 1, 2, 2)),
    ("m128n96", C(128, 96, 2, 2, 2, True, False, False, 1, 2, 2)),
    ("m128n128_dqswap", C(128, 128, 2, 2, 2, True, False, True, 1, 2, 2)),
    ("m80n128_dqswap", C(80, 128, 2, 2, 2, True, False, True, 1, 2, 1)),
    ("m128n64", C(128, 64, 2, 2, 2, True, False, False, 1, 1, 2)),
]:
    if time.time() > deadline:
        break
    I._tile_size_bwd_sm90 = lambda *a, _cfg=cfg, **kw: _cfg
    entry = {"config": name}
    try:
        t0 = time.time()
        g = I._flash_attn_bwd(q, k, v, out, do, lse, causal=True)[:3]
        torch.cuda.synchronize()
        entry["compile_s"] = round(time.time() - t0, 1)
        entry["rel"] = [rel(a, b) for a, b in zip(g, ref)]
        entry["ms"] = do_bench(lambda: I._flash_attn_bwd(q, k, v, out, do, lse, causal=True), rep=200)
    except Exception as err:  # noqa: BLE001
        entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    res["backward"].append(entry); print("bwd", entry, flush=True)
I._tile_size_bwd_sm90 = original
json.dump(res, open(os.environ["OUT"] + "/fa_probe_h200.json", "w"), indent=1)
