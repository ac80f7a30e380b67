# Device side (warm machine): the GEMMs sustained under the power limit, then the launch probe with BF16.
set -o pipefail
timeout 200 python3 outputs/records/h200_session_2026-12-03_e/gemm_power_probe.py $OUT/gemm_power_probe.jsonl > $OUT/gemm_power_probe.log 2>&1
tail -45 $OUT/gemm_power_probe.log | cut -c1-230
timeout 150 python3 outputs/records/h200_session_2026-12-03_e/launch_probe.py $OUT/launch_probe.json 48 > $OUT/launch_probe.log 2>&1
tail -4 $OUT/launch_probe.log | cut -c1-2500
