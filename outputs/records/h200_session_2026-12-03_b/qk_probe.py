"""One-off probe on the H200 at the 200M shapes (16 x 2,048 tokens, 14 query and 2 key/value heads of 64): the
QK-norm + RoPE backward (with its partials' sum) of cflib at this commit, whose programs each take rows of one
kind (query, or key with the value rows beside), against the kernel before it (`qk_norm_rope_mixed_rows.py`
beside this file: blocks of (token, head) rows over all three kinds, each row loading from all three gradients
under masks), over tiles (rows per block, blocks per program, warps). Medians of
triton.testing.do_bench_cudagraph in us; the outputs of the two are compared first."""
import importlib.util
import json
import pathlib
import sys

import torch
from triton.testing import do_bench_cudagraph

from cflib.ops import qk_norm_rope as split

spec = importlib.util.spec_from_file_location("mixed", pathlib.Path(__file__).with_name("qk_norm_rope_mixed_rows.py"))
mixed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixed)

tokens, q_heads, kv_heads, hd, seq = 16 * 2048, 14, 2, 64, 2048
gen = torch.Generator(device="cuda").manual_seed(0)
qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * hd, device="cuda", generator=gen).bfloat16()
q_weight, k_weight = (torch.rand(hd, device="cuda", generator=gen) + 0.5 for _ in range(2))
angles = torch.arange(seq, device="cuda")[:, None].float() * torch.rand(hd, device="cuda", generator=gen)[None, :]
cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
positions = torch.arange(seq, device="cuda", dtype=torch.int32).repeat(tokens // seq)
_, _, _, rstd = split.qk_norm_rope_forward(qkv, q_weight, k_weight, cos, sin, positions, q_heads, kv_heads, 1e-6)
grads = [torch.randn(tokens, h, hd, device="cuda", generator=gen).bfloat16() for h in (q_heads, kv_heads, kv_heads)]
args = (*grads, qkv, q_weight, k_weight, cos, sin, positions, rstd, q_heads, kv_heads)
found = {}
new_x, new_w = split.qk_norm_rope_backward(*args)
old_x, old_w = mixed.qk_norm_rope_backward(*args)
found["max_abs_diff_grad_qkv"] = float((new_x.float() - old_x.float()).abs().max())
found["max_rel_diff_grad_w"] = float(((new_w - old_w).abs() / old_w.abs().clamp_min(1e-6)).max())
found["mixed_default"] = do_bench_cudagraph(lambda: mixed.qk_norm_rope_backward(*args), rep=200) * 1e3
for tile in ((64, 1, 2), (32, 1, 2), (64, 1, 4), (128, 1, 4), (32, 1, 1), (16, 1, 1), (64, 2, 2), (64, 4, 4),
             (128, 2, 8), (256, 1, 8)):
    found[f"split_{tile[0]}x{tile[1]}x{tile[2]}"] = do_bench_cudagraph(
        lambda: split.qk_norm_rope_backward(*args, tile=tile), rep=200) * 1e3
json.dump(found, sys.stdout, indent=1)
print()
