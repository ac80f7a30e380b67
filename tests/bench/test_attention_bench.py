"""The attention A/B benchmark's plumbing at smoke size on a CPU: what cannot run here is recorded as skipped
with the check that failed, the rest is measured and read back. Its figures are made on a GPU."""
from __future__ import annotations

import json

from cflib.bench.attention import parse_args, run


def test_the_benchmark_records_every_backend_measured_or_skipped_with_its_reason(tmp_path):
    out = tmp_path / "ab"
    record = run(parse_args(["--out", str(out), "--model", "smoke", "--seq-len", "64", "--median-length", "12", "--micro-batch", "2",
                             "--warmup-steps", "1", "--timed-steps", "1", "--profile-steps", "1",
                             "--parts", "kernels,steps", "--kernels", "reference", "--dense", "fa4,sdpa_mask",
                             "--packed", "fa4,sdpa_mask", "--device", "cpu"]), log=lambda line: None)
    assert json.loads((out / "record.json").read_text())["job"] == "attention_ab"
    kernels = {(r["kind"], r["kernel"]): r for r in record["attention_kernels"]["rows"]}
    assert kernels[("dense", "fa4")] == {"kind": "dense", "kernel": "fa4", "status": "skipped",
                                         "reason": "no GPU: the device is cpu"}
    for key in (("dense", "torch_sdpa"), ("packed", "sdpa_mask")):
        assert kernels[key]["status"] == "ok" and kernels[key]["kernel_ran"] == key[1]
        assert kernels[key]["fwd_bwd_ms"] > 0 and kernels[key]["max_abs_error_vs_fp32"] < 1e-5
    assert 0 < record["attention_kernels"]["documents"]["useful_pairs_vs_dense"] < 1
    steps = {(r["kind"], r["attention_backend"]): r for r in record["steps"]}
    skipped = steps[("packed", "fa4")]
    assert skipped["status"] == "skipped" and "attention_backend: fa4, but no GPU" in skipped["reason"]
    packed, dense = steps[("packed", "sdpa_mask")], steps[("dense", "sdpa_mask")]
    assert packed["kernel_path"]["attention"] == "sdpa_mask" and dense["kernel_path"]["attention"] == "torch_sdpa"
    assert packed["tokens_per_s"] > packed["supervised_tokens_per_s"] > 0
    assert packed["profile"]["status"] == "ok" and (out / "profiles" / "packed-sdpa_mask.txt").is_file()
