# Device side, after .fa4/3/install.sh: the GEMM tests on the GPU, then the floors with the GEMMs on quack or
# cuBLAS (production) beside cuBLAS alone (production_cublas_gemms), peer_packed included.
set -o pipefail
mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round2.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_gemm.py tests/ops/test_cross_entropy.py tests/ops/test_trmoe.py \
  tests/model/test_weight_copies.py tests/ops/test_rows.py tests/ops/test_qk_norm_rope.py > $OUT/gemm_tests.log 2>&1
tail -3 $OUT/gemm_tests.log
timeout 450 papermill notebooks/measure_throughput.ipynb /tmp/ab/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_cublas_gemms, peer_liger_fa4, peer_padding_free, peer_packed], micro_batches: [16, 48], batches: [random_rows, realistic], repetitions: 2}" \
  -p out_dir /tmp/ab > $OUT/floors.log 2>&1
cp /tmp/ab/record.json $OUT/record.json
python3 -m cflib.bench perf-table /tmp/ab/record.json >> $OUT/floors.log 2>&1
grep -A40 "| path | micro-batch" $OUT/floors.log | head -45
python3 -c "
import json; r=json.load(open('$OUT/record.json'))
for e in r['paths']:
    kp = e.get('kernel_path') or {}
    if 'gemms' in kp: print(e.get('path'), e.get('batches'), e.get('micro_batch'), kp['gemms'])
" 2>&1 | sort -u | head
