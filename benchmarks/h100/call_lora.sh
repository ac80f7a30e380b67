#!/usr/bin/env bash
# Device side, on the warm machine after call_tests.sh: params/throughput_lora_200m_<card>.yaml (card: the first
# argument, h100 by default, or h200) through the notebook: full-parameter training, LoRA and DoRA side by side;
# then benchmarks/dora_memory.py under BF16 autocast. Brings back both records and the executed notebook.
set -o pipefail
card=${1:-h100}
run=/tmp/throughput-lora-200m-$card
mkdir -p "$run"
timeout 240 papermill --log-output notebooks/measure_throughput.ipynb "$OUT/measure_throughput.lora_200m_$card.ipynb" \
  -f "params/throughput_lora_200m_$card.yaml" -p out_dir "$run" > "$OUT/lora.log" 2>&1; echo "lora rc=$?"
cp "$run/record.json" "$OUT/throughput_lora_200m_$card.json"
timeout 150 python3 benchmarks/dora_memory.py --autocast --out "$OUT/dora_memory_$card.json" > "$OUT/dora.log" 2>&1
echo "dora_memory rc=$?"
grep -E "tokens/s|skipped|failed|oom" "$OUT/lora.log" | tail -12
tail -5 "$OUT/dora.log"
