# Device side, after .fa4/3/install.sh: the GPU test tier at the session's starting tree, then the floors with the
# GEMMs on quack or cuBLAS (production) beside cuBLAS alone, realistic batches included.
set -o pipefail
mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round1.txt
timeout 280 make test-gpu GPU_WORKERS=15 > $OUT/test_gpu.log 2>&1; tail -3 $OUT/test_gpu.log
timeout 270 papermill notebooks/measure_throughput.ipynb /tmp/ab/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_cublas_gemms, peer_liger_fa4, peer_padding_free, peer_packed], micro_batches: [16, 48], batches: [random_rows, realistic], repetitions: 2}" \
  -p out_dir /tmp/ab > $OUT/floors.log 2>&1
mkdir -p $OUT/floors; cp /tmp/ab/record.json $OUT/floors/record.json
python3 -m cflib.bench perf-table /tmp/ab/record.json >> $OUT/floors.log 2>&1
grep -A40 "| path | micro-batch" $OUT/floors.log | head -45
