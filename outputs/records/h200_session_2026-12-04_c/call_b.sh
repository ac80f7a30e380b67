# Device side (the keep-activation probe tree): the step A/B of the kept activation at 48 and 16.
set -o pipefail
cp outputs/records/h200_session_2026-12-04_c/ab_probe.py /tmp/
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_trmoe.py > $OUT/keep_tests.log 2>&1; echo "tests rc=$?"; tail -1 $OUT/keep_tests.log
for mb in 48 16; do
  timeout 150 python3 /tmp/ab_probe.py keep_activation $OUT/ab_keep_mb$mb.json $mb 8 8 > $OUT/ab_keep_mb$mb.log 2>&1; echo "ab $mb rc=$?"; grep -E "built|b_over_a" $OUT/ab_keep_mb$mb.log | cut -c1-300
done
python3 -c "
import json
for mb in (48, 16):
    d = json.load(open('$OUT/ab_keep_mb%d.json' % mb)); s = d['summary']
    print(mb, round(s['a']['median']), round(s['b']['median']), round(s['b_over_a_median'], 4), round(d['peak_memory_gib'], 2))
"
