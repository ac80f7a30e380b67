"""One-off probe on the H200: cflib's weighted cross-entropy kernel (cflib.ops.cross_entropy) on one chunk of the
200M head's logits (1,024 rows of 32,000 BF16 logits, overwritten in place by their gradient) over elements per
block x warps. Fewer, wider programs keep fewer rows in flight, so the second read of each row may come from L2
(50 MB) instead of HBM. Medians of triton.testing.do_bench_cudagraph, in us."""
import json
import sys

import torch
from triton.testing import do_bench_cudagraph

from cflib.ops.cross_entropy import _weighted_cross_entropy

rows, vocab = 1024, 32000
logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
targets = torch.randint(0, vocab, (rows,), device="cuda")
losses = torch.empty(rows, device="cuda")
found = {}
for block in (2048, 4096, 8192, 16384, 32768):
    for warps in (4, 8, 16, 32):
        def launch():
            _weighted_cross_entropy.fn[(rows,)](logits, logits.stride(0), targets, losses, losses, vocab,
                                             HAS_WEIGHTS=False, BLOCK_V=block, num_warps=warps)
        try:
            found[f"{block}x{warps}"] = do_bench_cudagraph(launch, rep=200) * 1e3
        except Exception as error:  # a tile past the registers' limit
            found[f"{block}x{warps}"] = repr(error)[:120]
json.dump(found, sys.stdout, indent=1)
print()
