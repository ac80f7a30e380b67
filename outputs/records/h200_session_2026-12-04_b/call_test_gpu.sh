# Device side, after .fa4/3/install.sh: the GPU test tier at the commit without the grouped block.
set -o pipefail
timeout 280 make test-gpu GPU_WORKERS=15 > $OUT/test_gpu_final.log 2>&1; echo "test-gpu rc=$?"; tail -3 $OUT/test_gpu_final.log
grep -E "^(FAILED|ERROR)" $OUT/test_gpu_final.log | head -20 | cut -c1-300
