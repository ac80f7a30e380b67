# Device side, after .fa4/3/install.sh: the TR-MoE block's GEMMs wide against grouped by expert pair.
set -o pipefail
D=outputs/records/h200_session_2026-12-04
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_probe.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 300 python3 $D/grouped_mlp_probe.py $OUT/grouped_mlp_probe.json 48 8 > $OUT/grouped_mlp_probe.log 2>&1
echo "probe rc=$?"; grep -E "failed|errors|^sets|^singles" $OUT/grouped_mlp_probe.log | cut -c1-1500
tail -5 $OUT/grouped_mlp_probe.log | grep -i error | cut -c1-600
