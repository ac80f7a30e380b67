# Device side, after the FlashAttention-4 install: every fast path against float64 at the tiny and the 200M
# shapes (validate_kernels as it is), the TR-MoE layer timed; then the step's profile at 16 with its tables.
set -o pipefail
export CFLIB_COMMIT=52e006677b927ae28c4b2cd7d11d8a02141766d7
mkdir -p $OUT/validate /tmp/pr $OUT/profile16
timeout 330 papermill notebooks/validate_kernels.ipynb $OUT/validate/validate_kernels.executed.ipynb \
  -p out_dir $OUT/validate > $OUT/validate.log 2>&1; echo "validate rc=$?"
python3 -c "import json; r = json.load(open('$OUT/validate/record.json')); print(r['summary']); print(r.get('trmoe_layer_ms'))"
timeout 120 papermill notebooks/measure_throughput.ipynb /tmp/pr/measure_throughput.ipynb -f params/throughput_200m_h200.yaml \
  -y "{paths: [production], micro_batches: [16], batches: [random_rows], repetitions: 1, profile_steps: 2, ceiling_sustained_s: 0}" \
  -p out_dir /tmp/pr > $OUT/profile16.log 2>&1
cp -r /tmp/pr/record.json /tmp/pr/profiles $OUT/profile16/; ls $OUT/profile16/profiles
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/bench/test_validate.py > $OUT/validate_tests.log 2>&1; tail -2 $OUT/validate_tests.log
