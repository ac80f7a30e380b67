# Device side, after .fa4/3/install.sh: three A/B probes of the production step at micro-batch 48.
set -o pipefail
D=outputs/records/h200_session_2026-12-03_f
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round1.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
for v in fa4_dq_swap race_sustained fa4_dq_atom1; do
  timeout 170 python3 $D/ab_probe.py $v $OUT/ab_$v.json 48 8 8 > $OUT/ab_$v.log 2>&1
  echo "== $v rc=$?"; grep -E "^built|^\{" $OUT/ab_$v.log | cut -c1-600; tail -3 $OUT/ab_$v.log | grep -i error | cut -c1-400
done
