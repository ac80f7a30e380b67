"""The trainer-vs-bare-step floor on windows that all cost the same: a shard of full-length random-token rows (one
example a window), so every step does the same work and the two figures differ only by what the trainer adds.

    python trainer_floor.py SHARD_ROOT TRAIN_OUT STEPS

writes the shard at SHARD_ROOT (when absent) for measure_throughput's `shard:` (the bare step), then runs
cflib.train.train on the release profile over it and prints its tokens/s over every step after the sixth (the
bare step's warm-up) and the record's own steady state."""
import json
import sys
from pathlib import Path

from cflib.bench.synthetic import write_random_token_shard
from cflib.model.config import PRESETS
from cflib.train import train
from cflib.train.params import load_params_file
from cflib.train.records import read_metrics

shard, out_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
if not (shard / "train").is_dir():
    write_random_token_shard(shard, PRESETS["tr_hash_200m"].vocab_size, 2048, 16 * (steps + 10), 32, seed=0)
params = {**load_params_file("params/sft_200m_release.yaml"), "init_checkpoint": None, "data": str(shard),
          "require_release_ready": False, "max_steps": steps, "eval_at_start": False, "exact_match_limit": 0,
          "save_checkpoints": False, "out_dir": str(out_dir)}
record = train(params, progress=False)
rows = [row for row in read_metrics(out_dir / "metrics.jsonl") if row.get("event") == "train" and row["step"] > 6]
print(json.dumps({"steps_after_6": len(rows),
                  "tokens_per_s_after_6": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
                  "record_steady_state_tokens_per_s": record["throughput"]["steady_state_tokens_per_s"],
                  "kernel_path": record["kernel_path"]}))
