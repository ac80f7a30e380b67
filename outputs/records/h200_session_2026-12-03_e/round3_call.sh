# Device side, after .fa4/3/install.sh: the full H200 throughput profile (every default path), out_dir under $OUT
# so a run cut short still brings its progress back.
set -o pipefail
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi_round3.txt
mkdir -p $OUT/full
timeout 540 papermill notebooks/measure_throughput.ipynb $OUT/full/measure_throughput.200m_h200.ipynb \
  -f params/throughput_200m_h200.yaml -p out_dir $OUT/full > $OUT/full.log 2>&1
rm -rf $OUT/full/runs $OUT/full/random_tokens $OUT/full/realistic_lengths $OUT/full/lora_base
grep -E "tokens/s|oom|failed|skipped" $OUT/full.log | tail -20
