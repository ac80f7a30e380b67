"""One-off: production against production_epilogue_swiglu with the sweep's best quack tiles pinned, side by side
in one measure() (random rows at mb16 and 48, realistic lengths at 16)."""
import json, os, sys
import yaml
import cflib.ops.gemm as gemm
from cflib.bench import ThroughputParams, measure, perf_table

sweep = json.load(open(os.environ["OUT"] + "/config_sweep_h200.json"))
gemm.GATED_TILE = sweep.get("best_forward", {}).get("tile")
gemm.DGATED_TILE = sweep.get("best_backward", {}).get("tile")
print("pinned", gemm.GATED_TILE, gemm.DGATED_TILE, flush=True)
raw = yaml.safe_load(open("params/throughput_200m_h200.yaml"))
raw.update(paths=["production", "production_epilogue_swiglu"], micro_batches=[16, 48], batches=["random_rows", "realistic"],
           repetitions=2, out_dir="/tmp/tp/run_ab")
record = measure(ThroughputParams.from_dict(raw))
record["pinned_tiles"] = {"gated": gemm.GATED_TILE, "dgated": gemm.DGATED_TILE}
json.dump(record, open(os.environ["OUT"] + "/throughput_gated_pinned_h200.json", "w"), indent=1, default=str)
print(perf_table(record))
