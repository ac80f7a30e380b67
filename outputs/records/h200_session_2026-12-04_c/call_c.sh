# Device side, after the FlashAttention-4 install: the embedding's GPU tests, the step A/B at 16 and 48, the GPU tier.
set -o pipefail
cp outputs/records/h200_session_2026-12-04_c/ab_probe.py /tmp/
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_embedding.py tests/model/test_fast.py > $OUT/embedding_tests.log 2>&1; echo "tests rc=$?"; tail -1 $OUT/embedding_tests.log
for mb in 16 48; do
  timeout 150 python3 /tmp/ab_probe.py embedding_index_add $OUT/ab_embedding_mb$mb.json $mb 8 8 > $OUT/ab_embedding_mb$mb.log 2>&1; echo "ab $mb rc=$?"
done
python3 -c "
import json
for mb in (16, 48):
    d = json.load(open('$OUT/ab_embedding_mb%d.json' % mb)); s = d['summary']
    print(mb, round(s['a']['median']), round(s['b']['median']), round(s['b_over_a_median'], 4), sum(r > 1 for r in s['b_over_a_per_round']), round(d['peak_memory_gib'], 2))
"
make test-gpu GPU_WORKERS=15 > $OUT/test_gpu_embedding.log 2>&1; echo "test-gpu rc=$?"; tail -1 $OUT/test_gpu_embedding.log
