# Device side, after .fa4/3/install.sh: the residual norms' backward from their output against the kept sum
# (loss parity over 50 steps, then side by side in the step at micro-batch 48; A's race is the power-limit one).
set -o pipefail
D=outputs/records/h200_session_2026-12-03_f
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round2.txt
timeout 200 python3 $D/norm_parity.py $OUT/norm_parity.json 50 > $OUT/norm_parity.log 2>&1; echo "parity rc=$?"
tail -2 $OUT/norm_parity.log
timeout 200 python3 $D/ab_probe.py norm_kept_sum $OUT/ab_norm_kept_sum.json 48 8 8 > $OUT/ab_norm_kept_sum.log 2>&1
echo "ab rc=$?"; grep -E "^built|^\{" $OUT/ab_norm_kept_sum.log | cut -c1-700; tail -3 $OUT/ab_norm_kept_sum.log | grep -i error | cut -c1-400
python3 -c "
import json; d=json.load(open('$OUT/ab_norm_kept_sum.json'))
print('peak GiB', round(d['peak_memory_gib'],2)); [print(k, v) for k, v in d['race_choices_before'].items() if \"(17,\" in k]"
