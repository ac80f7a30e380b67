# Device side: losses over 50 steps, QK-norm's backward from q and k (and with the activation kept) against qkv kept;
# then the step side by side, qkv kept (A) against q and k read back (B), at micro-batch 16.
set -o pipefail
P=outputs/records/h200_session_2026-12-04_d
timeout 300 python3 $P/loss_parity_qk.py -f params/sft_200m_release.yaml --steps 50 \
  --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=3e-4" \
  --variant "lr=3e-4" --variant "kept_swiglu_layers=all" --out $OUT/loss_parity_qk.json > $OUT/loss_parity_qk.log 2>&1
echo "parity rc=$?"; tail -3 $OUT/loss_parity_qk.log
timeout 200 python3 -m cflib.bench.step_ab --before $P/qk_from_output.py:qkv_kept --change $P/qk_from_output.py:from_output \
  --micro-batch 16 --rounds 8 --out $OUT/step_ab_qk_mb16.json > $OUT/step_ab_qk_mb16.log 2>&1
echo "ab rc=$?"; tail -4 $OUT/step_ab_qk_mb16.log
