"""One-off probe on the H200 at the 200M shapes (16 x 2,048 tokens, width 896): the norm weights' partial sums
through torch and through cflib.ops.column_sums, and one residual add + RMSNorm forward + backward with the FP32
stream's gradient in FP32 and in BF16 (bf16_residual_gradient). Medians of triton.testing.do_bench, in us."""
import json
import sys

import torch
from triton.testing import do_bench

from cflib.ops.add_rms_norm import add_rms_norm
from cflib.ops.column_sums import column_sums

found = {}
for rows, cols in ((1056, 896), (8192, 128)):
    partial = torch.randn(rows, cols, device="cuda")
    torch.testing.assert_close(column_sums(partial), partial.sum(0), rtol=1e-4, atol=1e-3)
    found[f"sum0_{rows}x{cols}"] = do_bench(lambda: partial.sum(0), warmup=50, rep=300) * 1e3
    found[f"column_sums_{rows}x{cols}"] = do_bench(lambda: column_sums(partial), warmup=50, rep=300) * 1e3

tokens, dim = 16 * 2048, 896
weight = torch.ones(dim, device="cuda", requires_grad=True)
for split in (False, True):
    h0 = torch.randn(tokens, dim, device="cuda", requires_grad=True)
    delta = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        stream, _ = add_rms_norm(h0, None, weight, 1e-6, split)
        stream = stream.detach().requires_grad_(True)
        grad_stream = (torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)[..., None].expand(tokens, dim, 2)
                       if split else torch.randn(tokens, dim, device="cuda"))
        grad_out = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)

        def step():
            total, out = add_rms_norm(stream, delta, weight, 1e-6, split)
            # the stream's gradient computed as in a step, but not accumulated into a leaf
            torch.autograd.grad([total, out], [delta, weight], [grad_stream, grad_out])

        def forward():
            with torch.no_grad():
                add_rms_norm(stream, delta, weight, 1e-6, split)

        found[f"add_rms_norm_fwd_bwd_split_{split}"] = do_bench(step, warmup=20, rep=300) * 1e3
        found[f"add_rms_norm_fwd_split_{split}"] = do_bench(forward, warmup=20, rep=300) * 1e3
json.dump(found, sys.stdout, indent=1)
print()
