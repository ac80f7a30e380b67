"""The configurations triton.autotune picks for cflib's scaled SwiGLU kernels at the 200M block's shapes
(16 x 2,048 tokens, 3,328 columns), split and interleaved gate|up, with every candidate's time.

    python swiglu_tiles_probe.py OUT.json
"""
import json
import sys

import torch

from cflib.bench.timing import trmoe_bench_inputs
from cflib.model.config import preset
from cflib.ops import trmoe

config = preset("tr_hash_200m")
engine, _, ids, _ = trmoe_bench_inputs(config, 16 * 2048, torch.device("cuda"))
layout, table = trmoe.kernel_layout(engine), engine.route_table.contiguous()
rows, columns = ids.shape[0], config.shared_intermediate_size + config.intermediate_size
gate_up = torch.randn(rows, 2 * columns, device="cuda", dtype=torch.bfloat16)
hidden = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16)
grid = trmoe._grid(rows, columns)
timings = {}


def keep(name):
    tuner = getattr(trmoe, name.split()[0])
    torch.cuda.synchronize()
    timings[name] = {str(cfg): t for cfg, t in (getattr(tuner, "configs_timings", None) or {}).items()}


trmoe._scaled_swiglu_forward[grid](gate_up, ids, table, hidden, rows, columns, *layout, TOP_K=table.shape[0])
keep("_scaled_swiglu_forward")
for interleaved in (False, True):
    target = gate_up.view(torch.int32) if interleaved else gate_up
    trmoe._scaled_swiglu_backward[grid](hidden, target, ids, table, rows, columns, *layout, TOP_K=table.shape[0],
                                        INTERLEAVED=interleaved)
    keep(f"_scaled_swiglu_backward interleaved={interleaved}")
record = {"timings_ms": timings}
for name in ("_scaled_swiglu_forward", "_scaled_swiglu_backward"):
    record[name] = {str(key): str(cfg) for key, cfg in getattr(trmoe, name).cache.items()}
print(json.dumps(record, indent=1, default=str))
json.dump(record, open(sys.argv[1], "w"), indent=1, default=str)
