# Device side, after .fa4/3/install.sh: production and the peer at micro-batches 48, 96 and 128 in one run (each
# side's best), then the graph-launch probe at 48.
set -o pipefail
mkdir -p /tmp/big
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round1.txt
timeout 400 papermill notebooks/measure_throughput.ipynb /tmp/big/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, peer_liger_fa4], micro_batches: [48, 96, 128], compare_micro_batch: 48, batches: [random_rows], repetitions: 2}" \
  -p out_dir /tmp/big > $OUT/big.log 2>&1
mkdir -p $OUT/big; cp /tmp/big/record.json $OUT/big/record.json 2>/dev/null || cp /tmp/big/progress.json $OUT/big/progress.json
grep -E "tokens/s|oom|failed|skipped" $OUT/big.log | tail -14
python3 -m cflib.bench perf-table /tmp/big/record.json > $OUT/big_table.md 2>&1; grep -A14 "| ratio" $OUT/big_table.md
timeout 120 python3 outputs/records/h200_session_2026-12-03_e/launch_probe.py $OUT/launch_probe.json 48 > $OUT/launch_probe.log 2>&1
tail -8 $OUT/launch_probe.log | cut -c1-1500
