# Device side, after the FlashAttention-4 install: the GPU tier.
set -o pipefail
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/smi.txt
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null
timeout 420 make test-gpu GPU_WORKERS=15 GPU_PYTHON=python3 > $OUT/test_gpu.log 2>&1; echo "test-gpu rc=$?"; tail -4 $OUT/test_gpu.log
