# Device side: production, production with the activation kept in every layer, and the fastest peer, side by side.
set -o pipefail
mkdir -p $OUT/floors
timeout 560 papermill notebooks/measure_throughput.ipynb $OUT/floors/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_kept_activation, peer_liger_fa4], micro_batches: [16, 48], batches: [random_rows], repetitions: 2}" \
  -p out_dir $OUT/floors > $OUT/floors.log 2>&1; echo "floors rc=$?"; tail -5 $OUT/floors.log
python3 -m cflib.bench perf-table $OUT/floors/record.json 2>&1 | head -40
