# Device side, on the warm machine: the GPU tier, the trainer beside the bare step on full-length rows, and a
# profile of the default step at micro-batch 16.
set -o pipefail
export CFLIB_COMMIT=fe5c60cd400b572c7d472533e2e348ceae06c349
r=outputs/records/h200_session_2026-12-03_d
timeout 330 make test-gpu GPU_WORKERS=15 GPU_PYTHON=python3 > $OUT/test_gpu.log 2>&1; echo "test-gpu rc=$?"; tail -3 $OUT/test_gpu.log
mkdir -p /tmp/bs /tmp/pr $OUT/bare_step $OUT/profile16
timeout 120 python3 $r/trainer_floor.py /tmp/rows /tmp/tf 60 > $OUT/trainer_floor.log 2>&1; tail -1 $OUT/trainer_floor.log
timeout 120 papermill notebooks/measure_throughput.ipynb /tmp/bs/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [16], batches: [realistic], shard: /tmp/rows, warmup_steps: 6, timed_steps: 54, repetitions: 1, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/bs > $OUT/bare_step.log 2>&1
cp /tmp/bs/record.json $OUT/bare_step/record.json; grep -A4 "| path | micro-batch" $OUT/bare_step.log | head -6
timeout 120 papermill notebooks/measure_throughput.ipynb /tmp/pr/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [16], batches: [random_rows], repetitions: 1, profile_steps: 2, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/pr > $OUT/profile16.log 2>&1
cp /tmp/pr/record.json /tmp/pr/profile-*.txt $OUT/profile16/; ls $OUT/profile16
