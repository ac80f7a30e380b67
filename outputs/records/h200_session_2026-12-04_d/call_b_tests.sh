# Device side, after the FlashAttention-4 install: the GPU tier on QK-norm's backward from q and k.
set -o pipefail
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null
timeout 420 make test-gpu GPU_WORKERS=15 GPU_PYTHON=python3 > $OUT/test_gpu_qk.log 2>&1; echo "test-gpu rc=$?"; tail -2 $OUT/test_gpu_qk.log
