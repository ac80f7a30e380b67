"""One-off: QK-norm + RoPE kernels' tile sweep at the 200M shapes (H200)."""
import json, os, sys, itertools
import torch, triton
from triton.testing import do_bench
from cflib.ops import qk_norm_rope as m

dev = torch.device("cuda")
T, HQ, HKV, HD = 32768, 14, 2, 64
qkv = torch.randn(T, (HQ + 2 * HKV) * HD, device=dev, dtype=torch.bfloat16)
qw = torch.rand(HD, device=dev) + 0.5; kw = torch.rand(HD, device=dev) + 0.5
cos = torch.randn(2048, HD, device=dev); sin = torch.randn(2048, HD, device=dev)
pos = m._positions(16, 2048, dev)
rows = T * (HQ + 2 * HKV)
q = torch.empty(T, HQ, HD, device=dev, dtype=torch.bfloat16); k = torch.empty(T, HKV, HD, device=dev, dtype=torch.bfloat16); v = torch.empty_like(k)
rstd = torch.empty(rows, device=dev)
gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
gx = torch.empty_like(qkv)
out = {"forward": {}, "backward": {}}
for br, w in itertools.product((16, 32, 64, 128, 256), (1, 2, 4, 8)):
    f = lambda: m._qk_norm_rope_forward[(triton.cdiv(rows, br),)](qkv, qkv.stride(0), qw, kw, cos, sin, pos, q, k, v, rstd, rows, HQ, HKV, 1e-6, HEAD_DIM=HD, BLOCK_R=br, num_warps=w)
    try:
        out["forward"][f"{br}x{w}"] = t = do_bench(f, warmup=25, rep=100)
        print("fwd", br, w, round(t * 1000, 1), "us", flush=True)
    except Exception as e:
        print("fwd", br, w, "error", str(e)[:100])
for br, blocks, w in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 4, 8)):
    programs = triton.cdiv(rows, br * blocks)
    partial = torch.empty(programs, 2, HD, device=dev)
    def f():
        m._qk_norm_rope_backward[(programs,)](gq, gk, gv, qkv, qkv.stride(0), qw, kw, cos, sin, pos, rstd, gx, gx.stride(0), partial, rows, HQ, HKV, HEAD_DIM=HD, BLOCK_R=br, BLOCKS=blocks, num_warps=w)
        partial.sum(0)
    try:
        out["backward"][f"{br}x{blocks}x{w}"] = t = do_bench(f, warmup=25, rep=100)
        print("bwd", br, blocks, w, round(t * 1000, 1), "us", flush=True)
    except Exception as e:
        print("bwd", br, blocks, w, "error", str(e)[:100])
for kind in out:
    best = min(out[kind], key=out[kind].get)
    print("best", kind, best, round(out[kind][best] * 1000, 1), "us")
json.dump(out, open(os.environ["OUT"] + "/qk_norm_rope_sweep_h200.json", "w"), indent=1)

# AdamW over the 200M model's parameters: BLOCK x num_warps, with BF16 copies of every 2-D weight.
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.ops.adamw import adamw_tables, adamw_step_, step_coefficients
model = TRMoEModel(preset("tr_hash_200m")).to(dev)
params = [p.data for p in model.parameters()]
for p in params:
    p.normal_(0, 0.02)
grads = [torch.randn_like(p) * 1e-3 for p in params]
ms = [torch.zeros_like(p) for p in params]; vs = [torch.zeros_like(p) for p in params]
copies = [torch.empty_like(p, dtype=torch.bfloat16) if p.dim() == 2 else None for p in params]
coeff = step_coefficients(torch.ones(len(params), device=dev), 1e-4, (0.9, 0.95))
out["adamw"] = {}
print("adamw params", sum(p.numel() for p in params), flush=True)
for block, w in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
    tables = adamw_tables(params, grads, ms, vs, copies, block=block, num_warps=w)
    try:
        out["adamw"][f"{block}x{w}"] = t = do_bench(lambda: adamw_step_(tables, coeff, 1e-4, 0.1, (0.9, 0.95), 1e-8), warmup=25, rep=200)
        print("adamw", block, w, round(t * 1000, 1), "us", flush=True)
    except Exception as e:
        print("adamw", block, w, "error", str(e)[:100])
best = min(out["adamw"], key=out["adamw"].get)
print("best adamw", best, round(out["adamw"][best] * 1000, 1), "us")
json.dump(out, open(os.environ["OUT"] + "/qk_norm_rope_sweep_h200.json", "w"), indent=1)
