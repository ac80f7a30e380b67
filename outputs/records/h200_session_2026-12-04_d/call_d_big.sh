# Device side: production (default) and the fastest peer at micro-batches 48 and 96, one repetition: each side's best.
set -o pipefail
export CFLIB_COMMIT=ee763d4e07c0e9c772ba84bc766034ac471b12f4
mkdir -p $OUT/big
timeout 200 papermill notebooks/measure_throughput.ipynb $OUT/big/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, peer_liger_fa4], micro_batches: [48, 96], batches: [random_rows], repetitions: 1, compare_micro_batch: 48}" \
  -p out_dir $OUT/big > $OUT/big.log 2>&1; echo "big rc=$?"
python3 -m cflib.bench perf-table $OUT/big/record.json 2>&1 | sed -n 1,12p
