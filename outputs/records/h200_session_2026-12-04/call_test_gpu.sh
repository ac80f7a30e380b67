# Device side, warm: the GPU test tier.
make test-gpu GPU_WORKERS=15 > $OUT/test_gpu.log 2>&1; echo "rc=$?"; tail -3 $OUT/test_gpu.log
