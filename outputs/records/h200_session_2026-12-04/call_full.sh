# Device side, warm: the default 200M profile as it is (every default path, random rows at 16 and 48, realistic at 16).
set -o pipefail
mkdir -p /tmp/full $OUT/full
timeout 575 papermill notebooks/measure_throughput.ipynb $OUT/full/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml -p out_dir /tmp/full > $OUT/full.log 2>&1; echo "rc=$?"
cp /tmp/full/record.json /tmp/full/throughput.png $OUT/full/ 2>/dev/null || cp /tmp/full/progress.json $OUT/full/ 2>/dev/null
grep -E "tokens/s|oom|failed|skipped" $OUT/full.log | tail -6
python3 -m cflib.bench perf-table /tmp/full/record.json 2>&1 | grep -A12 "| ratio"
