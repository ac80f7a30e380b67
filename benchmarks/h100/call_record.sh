#!/usr/bin/env bash
# Device side, on the warm machine after call_tests.sh: params/throughput_200m_<card>.yaml as it is (card: the
# first argument, h100 by default, or h200), from cold Triton and Inductor caches (every path's first step and
# compilation as a fresh machine pays them), through the notebook under papermill. Brings back the record, the
# executed notebook, the plot and the profiles in one archive.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$OUT/smi_record.txt"
card=${1:-h100}
rm -rf "$HOME/.triton/cache" "/tmp/torchinductor_$(whoami)"
run=/tmp/throughput-200m-$card
mkdir -p "$run"
timeout 560 papermill --log-output notebooks/measure_throughput.ipynb "$run/measure_throughput.executed.ipynb" \
  -f "params/throughput_200m_$card.yaml" -p out_dir "$run" > "$OUT/record.log" 2>&1; echo "record rc=$?"
(cd "$run" && tar czf "$OUT/record.tgz" --ignore-failed-read record.json progress.json throughput.png \
  measure_throughput.executed.ipynb profiles)
grep -E "tokens/s|skipped|failed|oom|ceiling|held" "$OUT/record.log" | tail -20
