# Device side, warm: production against production with the block grouped by route and the FA4 peer,
# random rows at micro-batches 16 and 48, two repetitions, in one run of measure_throughput.
set -o pipefail
mkdir -p /tmp/ab $OUT/ab
timeout 560 papermill notebooks/measure_throughput.ipynb $OUT/ab/measure_throughput.executed.ipynb \
  -f params/throughput_200m_h200.yaml \
  -y "{paths: [production, production_grouped_experts, peer_liger_fa4], micro_batches: [16, 48], batches: [random_rows], repetitions: 2}" \
  -p out_dir /tmp/ab > $OUT/ab.log 2>&1; echo "rc=$?"
cp /tmp/ab/record.json /tmp/ab/throughput.png $OUT/ab/ 2>/dev/null || cp /tmp/ab/progress.json $OUT/ab/ 2>/dev/null
grep -E "tokens/s|oom|failed|skipped|Error" $OUT/ab.log | tail -8 | cut -c1-400
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/ab/record.json"))
for row in r["paths"]:
    print({k: row.get(k) for k in ("path", "micro_batch", "repetition", "status", "tokens_per_s", "peak_memory_gib",
                                   "step_capture")}, row.get("kernel_path", {}).get("moe"), row.get("kernel_path", {}).get("swiglu"))
PY
