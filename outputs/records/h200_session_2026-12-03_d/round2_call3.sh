# Device side, after .fa4/3/install.sh: the GEMM race's split-K candidates probed shape by shape and tested, then
# production (the race with them) beside cuBLAS alone and the peer, each at 16, 48 and 64.
set -o pipefail
d=outputs/records/h200_session_2026-12-03_d
mkdir -p /tmp/ab2
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round2.txt
timeout 150 python3 $d/split_k_probe.py $OUT/split_k_probe.jsonl > $OUT/split_k_probe.log 2>&1; cat $OUT/split_k_probe.log | grep -v Warn | tail -12
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_gemm.py tests/train/test_kernel_params.py > $OUT/gemm_tests.log 2>&1
tail -2 $OUT/gemm_tests.log
timeout 300 papermill notebooks/measure_throughput.ipynb /tmp/ab2/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_cublas_gemms, peer_liger_fa4], micro_batches: [16, 48, 64], batches: [random_rows], repetitions: 2}" \
  -p out_dir /tmp/ab2 > $OUT/floors.log 2>&1
mkdir -p $OUT/floors; cp /tmp/ab2/record.json $OUT/floors/record.json
python3 -m cflib.bench perf-table /tmp/ab2/record.json > $OUT/floors_table.md 2>&1; head -30 $OUT/floors_table.md
