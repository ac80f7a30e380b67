# Device side: production as it now runs by default (activation kept, QK-norm's backward from q and k) against the
# peers every floor names, random rows and realistic lengths.
set -o pipefail
mkdir -p $OUT/floors_default
timeout 540 papermill notebooks/measure_throughput.ipynb $OUT/floors_default/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, peer_liger_fa4, peer_padding_free, peer_packed], micro_batches: [16, 48], batches: [random_rows, realistic], repetitions: 2}" \
  -p out_dir $OUT/floors_default > $OUT/floors_default.log 2>&1; echo "floors rc=$?"
python3 -m cflib.bench perf-table $OUT/floors_default/record.json 2>&1 | sed -n 3,40p
