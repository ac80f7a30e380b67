"""The generate() step profile: both sides measured, their ratio and the counts the diagnosis reads."""
from __future__ import annotations

import json

from generate_profile import main


def test_the_smoke_profile_records_both_sides(tmp_path):
    record = main(["--smoke", "--steps", "2", "--out", str(tmp_path / "profile.json")])
    assert json.loads((tmp_path / "profile.json").read_text())["job"] == "generate_profile"
    for side in ("hf_bundle", "hf_llama"):
        found = record[side]
        assert found["step_ms"] > 0 and found["host_ops_per_step"] > 0
        assert found["gpu_kernels_per_step"] == 0  # the CPU launches none
        assert "aten::scaled_dot_product_attention" in found["top_level_ops_per_step"]
    # the bundle's frozen projections: per layer one GEMM for q, k and v, one for o, two for the MoE block; the head
    layers, ops = 2, record["hf_bundle"]["top_level_ops_per_step"]
    assert ops["aten::linear"] == layers * 2 + 1 and ops["aten::matmul"] == layers * 2
    assert record["bundle_vs_llama_step_time"] == record["hf_llama"]["step_ms"] / record["hf_bundle"]["step_ms"]
