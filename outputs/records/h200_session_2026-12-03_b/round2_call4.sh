# Device side, on the warm machine after round2_call3: the GPU test tier.
set -o pipefail
make test-gpu GPU_WORKERS=15 2>&1 | tee $OUT/test_gpu.log | tail -40
