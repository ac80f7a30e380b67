# Device side, after .fa4/3/install.sh: the cross-entropy kernel's tiles, then the floors with the variants.
set -o pipefail
mkdir -p /tmp/fl
timeout 120 python3 outputs/records/h200_session_2026-12-03_b/ce_probe.py > $OUT/ce_probe.json 2> $OUT/ce_probe.err
timeout 420 papermill notebooks/measure_throughput.ipynb /tmp/fl/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_bf16_residual_gradient, production_loss_chunk_4096, peer_liger_fa4, peer_padding_free], micro_batches: [16, 48], batches: [random_rows, realistic], repetitions: 2}" \
  -p out_dir /tmp/fl > $OUT/floors.log 2>&1
cp /tmp/fl/record.json $OUT/record.json
python3 -m cflib.bench perf-table /tmp/fl/record.json >> $OUT/floors.log 2>&1
cat $OUT/ce_probe.json; grep -A60 "| path | micro-batch | tokens/s" $OUT/floors.log | head -70
