# Device side, after the FlashAttention-4 install: cflib.bench.step_ab's first GPU run, the embedding's backward at 16 and 48.
set -o pipefail
P=outputs/records/h200_session_2026-12-04_c/embedding_patch.py
for mb in 16 48; do
  timeout 170 python3 -m cflib.bench.step_ab --before $P:torch_backward --change $P:index_add --micro-batch $mb \
    --rounds 10 --out $OUT/step_ab_embedding_mb$mb.json > $OUT/step_ab_embedding_mb$mb.log 2>&1; echo "mb $mb rc=$?"
  tail -1 $OUT/step_ab_embedding_mb$mb.log
done
