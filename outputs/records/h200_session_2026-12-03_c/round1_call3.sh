# Device side, after .fa4/3/install.sh: every GEMM of the step, cuBLAS against quack; the BF16 stream gradient's
# loss parity at another seed; the QK and rows tests on the GPU.
set -o pipefail
d=outputs/records/h200_session_2026-12-03_c
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
QUACK_CACHE_DIR=/tmp/qc timeout 330 python3 $d/gemm_probe.py head linear > $OUT/gemm_probe.jsonl 2> $OUT/gemm_probe.err
tail -5 $OUT/gemm_probe.err
for seed in 1; do
  timeout 120 python3 -m cflib.bench.loss_parity -f params/sft_200m_release.yaml --steps 50 \
    --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=3e-4,seed=$seed" \
    --variant bf16_residual_gradient=true --out $OUT/loss_parity_bf16_gradient_seed$seed.json > $OUT/loss_parity_seed$seed.log 2>&1
  tail -3 $OUT/loss_parity_seed$seed.log
done
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/gemm_probe.jsonl"):
    r = json.loads(line)
    if "gemm" in r:
        print(r["gemm"], {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items() if k.endswith(("_us", "tflops", "_s", "diff", "error"))})
PY
timeout 90 python3 -m pytest -q -n 4 tests/ops/test_qk_norm_rope.py tests/ops/test_rows.py > $OUT/qk_rows_tests.log 2>&1; tail -2 $OUT/qk_rows_tests.log
