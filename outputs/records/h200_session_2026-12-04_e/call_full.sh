# Device side, after the FlashAttention-4 install: the full default profile (every path, micro-batches 16 and 48,
# random rows and realistic lengths), the headline record.
set -o pipefail
export CFLIB_COMMIT=fe5c60cd400b572c7d472533e2e348ceae06c349
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
mkdir -p $OUT/full
timeout 545 papermill notebooks/measure_throughput.ipynb $OUT/full/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml -p out_dir $OUT/full > $OUT/full.log 2>&1; echo "full rc=$?"
python3 -m cflib.bench perf-table $OUT/full/record.json 2>&1 | head -40
