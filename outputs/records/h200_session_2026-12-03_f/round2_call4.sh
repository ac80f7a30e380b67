# Device side, warm: production (the norms' output path, the power-limit race) and the peer at 48 and 96.
set -o pipefail
mkdir -p /tmp/big
timeout 560 papermill notebooks/measure_throughput.ipynb /tmp/big/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, peer_liger_fa4], micro_batches: [48, 96], compare_micro_batch: 48, batches: [random_rows], repetitions: 1}" \
  -p out_dir /tmp/big > $OUT/big.log 2>&1; echo "rc=$?"
mkdir -p $OUT/big; cp /tmp/big/record.json $OUT/big/record.json 2>/dev/null || cp /tmp/big/progress.json $OUT/big/progress.json
grep -E "tokens/s|oom|failed|skipped" $OUT/big.log | tail -8
python3 -m cflib.bench perf-table /tmp/big/record.json > $OUT/big_table.md 2>&1; grep -A14 "| ratio" $OUT/big_table.md
