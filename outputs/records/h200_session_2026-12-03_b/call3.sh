# Device side, after .fa4/3/install.sh: the kernel probe, the A/B with the peers, the loss parity.
set -o pipefail
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
timeout 100 python3 outputs/records/h200_session_2026-12-03_b/kernel_probe.py > $OUT/kernel_probe.json 2> $OUT/kernel_probe.err
timeout 330 papermill notebooks/measure_throughput.ipynb /tmp/ab/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_bf16_residual_gradient, peer_liger_fa4, peer_padding_free], micro_batches: [16, 48], batches: [random_rows, realistic], repetitions: 2}" \
  -p out_dir /tmp/ab > $OUT/ab.log 2>&1
cp /tmp/ab/record.json $OUT/throughput_ab.json
python3 -m cflib.bench perf-table /tmp/ab/record.json >> $OUT/ab.log 2>&1
timeout 150 python3 -m cflib.bench.loss_parity -f params/sft_200m_release.yaml --steps 50 \
  --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=3e-4" \
  --variant bf16_residual_gradient=true --out $OUT/loss_parity.json > $OUT/loss_parity.log 2>&1
tail -5 $OUT/loss_parity.log; grep -A30 "tokens/s" $OUT/ab.log | head -60; cat $OUT/kernel_probe.json
