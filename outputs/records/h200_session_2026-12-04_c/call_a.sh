# Device side, after the FlashAttention-4 install: the block's GPU tests, the layer probe, then the step A/B at 16 and 48.
set -o pipefail
cp outputs/records/h200_session_2026-12-04_c/*.py /tmp/
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/smi.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_trmoe.py tests/model/test_fast.py tests/model/test_weight_copies.py > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 200 python3 /tmp/layer_probe.py $OUT/layer_probe.json > $OUT/layer_probe.log 2>&1; rc=$?; echo "layer rc=$rc"; tail -25 $OUT/layer_probe.log
[ $rc = 0 ] || exit 1
for mb in 16 48; do
  timeout 150 python3 /tmp/ab_probe.py route_scale_epilogue $OUT/ab_epilogue_mb$mb.json $mb 8 8 > $OUT/ab_epilogue_mb$mb.log 2>&1; echo "ab $mb rc=$?"; grep -E "built|b_over_a" $OUT/ab_epilogue_mb$mb.log | cut -c1-400
done
