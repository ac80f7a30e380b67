# Device side, after .fa4/3/install.sh: at micro-batch 16, the residual norms from their output against the kept
# sum, the power-limit race against the burst race, and an A/A spread; 16 alternating rounds of 8 steps each.
set -o pipefail
D=outputs/records/h200_session_2026-12-04
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_ab16.txt
for v in norm_kept_sum race_burst none; do
  timeout 170 python3 $D/ab_probe.py $v $OUT/ab16_$v.json 16 16 8 > $OUT/ab16_$v.log 2>&1
  echo "== $v rc=$?"; grep -E "^built|^race differs|^\{" $OUT/ab16_$v.log | cut -c1-900; tail -3 $OUT/ab16_$v.log | grep -i error | cut -c1-400
done
