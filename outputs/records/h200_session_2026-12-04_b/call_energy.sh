# Device side, after .fa4/3/install.sh: the energy probe (each kernel family alone at the power limit).
set -o pipefail
D=outputs/records/h200_session_2026-12-04_b
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_energy.txt
timeout 200 python3 $D/energy_probe.py $OUT/energy_probe.json 3 > $OUT/energy_probe.log 2>&1; echo "rc=$?"
cut -c1-600 $OUT/energy_probe.log | tail -12
