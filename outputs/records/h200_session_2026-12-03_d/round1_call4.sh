# Device side, on the warm machine after round1_call3: a profile of production at micro-batch 48 (its best, where
# it holds the power limit), then the trainer-vs-bare-step floor on full-length rows.
set -o pipefail
d=outputs/records/h200_session_2026-12-03_d
mkdir -p /tmp/pr /tmp/bs
timeout 150 papermill notebooks/measure_throughput.ipynb /tmp/pr/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [48], compare_micro_batch: 48, batches: [random_rows], repetitions: 1, profile_steps: 2, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/pr > $OUT/profile48.log 2>&1
mkdir -p $OUT/profile48; cp -r /tmp/pr/record.json /tmp/pr/profiles $OUT/profile48/
grep -A3 "| path | micro-batch" $OUT/profile48.log | head -5
timeout 120 python3 $d/trainer_floor.py /tmp/rows /tmp/tf 60 > $OUT/trainer_floor.log 2>&1; tail -1 $OUT/trainer_floor.log
timeout 120 papermill notebooks/measure_throughput.ipynb /tmp/bs/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [16], batches: [realistic], shard: /tmp/rows, warmup_steps: 6, timed_steps: 54, repetitions: 1, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/bs > $OUT/bare_step.log 2>&1
mkdir -p $OUT/bare_step; cp /tmp/bs/record.json $OUT/bare_step/record.json; grep -A4 "| path | micro-batch" $OUT/bare_step.log | head -6
