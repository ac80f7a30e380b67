# Device side, on the warm machine after call3: three profiled steps of production and its BF16-gradient variant.
set -o pipefail
timeout 280 papermill notebooks/measure_throughput.ipynb /tmp/pr/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_bf16_residual_gradient], micro_batches: [16], batches: [random_rows], profile_steps: 3, compare_micro_batch: 16, repetitions: 1}" \
  -p out_dir /tmp/pr > $OUT/profile.log 2>&1
cp /tmp/pr/record.json $OUT/profile_record.json; ls /tmp/pr/profiles; cp /tmp/pr/profiles/*production-mb16.txt /tmp/pr/profiles/*gradient-mb16.txt $OUT/ 2>/dev/null
ls $OUT
