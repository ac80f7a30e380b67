#!/usr/bin/env bash
# Device side, after the FlashAttention-4 install: production beside its variant with the TR-MoE activation
# recomputed in backward and the two compiled peers, at micro-batches 16 and 48, two repetitions round robin, with
# each path's profile at 48 (where each side is at its best). Brings back the record and profiles in one archive.
set -o pipefail
run=/tmp/levers-200m-h100
mkdir -p "$run"
timeout 545 papermill --log-output notebooks/measure_throughput.ipynb "$run/measure_throughput.executed.ipynb" \
  -f params/throughput_200m_h100.yaml -y "{paths: [production, production_recomputed_activation, peer_compile_fa4,
  peer_compile_fa4_flce], batches: [random_rows], micro_batches: [16, 48], compare_micro_batch: 48, repetitions: 2,
  ceiling_sustained_s: 0}" -p out_dir "$run" > "$OUT/levers.log" 2>&1; echo "levers rc=$?"
(cd "$run" && tar czf "$OUT/levers.tgz" --ignore-failed-read record.json progress.json profiles)
grep -E "tokens/s|skipped|failed|oom" "$OUT/levers.log" | tail -20
