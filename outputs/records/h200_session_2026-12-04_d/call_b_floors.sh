# Device side: production (QK-norm's backward from q and k), the same with the activation kept, and the peer.
set -o pipefail
mkdir -p $OUT/floors_qk
timeout 560 papermill notebooks/measure_throughput.ipynb $OUT/floors_qk/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_kept_activation, peer_liger_fa4], micro_batches: [16, 48], batches: [random_rows], repetitions: 2}" \
  -p out_dir $OUT/floors_qk > $OUT/floors_qk.log 2>&1; echo "floors rc=$?"
python3 -m cflib.bench perf-table $OUT/floors_qk/record.json 2>&1 | sed -n 3,12p
