"""The trainer's own tokens/s (cflib.train.train: data loading, metrics, progress, all of it) on the release
profile over packed windows, for the trainer-vs-bare-step floor: measure_throughput's production path on the same
shard (`shard:`) is the bare step. Prints the record's steady-state figures.

    python trainer_floor.py OUT_DIR STEPS [SHARD_ROOT]   (no SHARD_ROOT: the embedded data)"""
import json
import sys

from cflib.train import train
from cflib.train.params import load_params_file

data = sys.argv[3] if len(sys.argv) > 3 else "embedded"
params = {**load_params_file("params/sft_200m_release.yaml"), "init_checkpoint": None, "data": data,
          "require_release_ready": False, "max_steps": int(sys.argv[2]), "eval_at_start": False,
          "exact_match_limit": 0, "save_checkpoints": False, "out_dir": sys.argv[1]}
record = train(params, progress=False)
keys = ("steady_state_tokens_per_s", "steady_state_supervised_tokens_per_s", "timed_steps")
print(json.dumps({key: record["throughput"].get(key) if isinstance(record.get("throughput"), dict) else record.get(key)
                  for key in keys} | {"kernel_path": record["kernel_path"]}))
