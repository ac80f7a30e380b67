#!/usr/bin/env bash
# Device side, after the FlashAttention-4 install (see the README beside this): the card, then the GPU test tier.
# Expects CFLIB_COMMIT, PYTHONPATH and PATH exported by the caller; writes under $OUT.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,temperature.gpu,driver_version --format=csv \
  > "$OUT/smi.txt"
cat "$OUT/smi.txt"
python3 -c "import torch, transformers, liger_kernel, flash_attn.cute, quack; print(torch.__version__, transformers.__version__)"
timeout 400 make test-gpu GPU_WORKERS=15 GPU_PYTHON=python3 > "$OUT/test_gpu.log" 2>&1; echo "test-gpu rc=$?"
tail -3 "$OUT/test_gpu.log"
