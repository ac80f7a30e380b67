"""The attention A/B benchmark's plumbing at smoke size on a CPU: what cannot run here is recorded as skipped
with the check that failed, the rest is measured and read back; a folder it may not write into ends the command in
one line naming it. Its figures are made on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from attention_ab import parse_args, run

BENCHMARK = Path(__file__).resolve().parents[1] / "attention_ab.py"


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


@pytest.mark.slow
@pytest.mark.parametrize("where, words", [("measured", ["--out", "already holds a record (record.json)"]),
                                          ("afile/x", ["afile is a file"])], ids=["over-a-record", "under-a-file"])
def test_a_folder_it_may_not_write_into_ends_in_one_line_naming_it(tmp_path, where, words):
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "record.json").write_text("{}\n")
    done = subprocess.run([sys.executable, str(BENCHMARK), "--out", str(tmp_path / where), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert all(word in last for word in words), last
