# Device side, on the warm machine after round2_call3: the GPU test tier, the loss parity of cuBLAS-only GEMMs
# against production's, then the trainer's own tokens/s beside the bare step's on the same shard.
set -o pipefail
d=outputs/records/h200_session_2026-12-03_c
timeout 280 make test-gpu GPU_WORKERS=15 > $OUT/test_gpu.log 2>&1; tail -3 $OUT/test_gpu.log
timeout 110 python3 -m cflib.bench.loss_parity -f params/sft_200m_release.yaml --steps 50 \
  --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=3e-4" \
  --variant quack_gemms=false --out $OUT/loss_parity_quack_gemms.json > $OUT/loss_parity_quack_gemms.log 2>&1
tail -3 $OUT/loss_parity_quack_gemms.log
timeout 100 python3 $d/trainer_floor.py /tmp/tf 80 > $OUT/trainer_floor.log 2>&1; tail -1 $OUT/trainer_floor.log
mkdir -p /tmp/bs
timeout 100 papermill notebooks/measure_throughput.ipynb /tmp/bs/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [16], batches: [realistic], shard: outputs/data/embedded-v5, repetitions: 1, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/bs > $OUT/bare_step.log 2>&1
cp /tmp/bs/record.json $OUT/bare_step_record.json; grep -A8 "| path | micro-batch" $OUT/bare_step.log | head -10
