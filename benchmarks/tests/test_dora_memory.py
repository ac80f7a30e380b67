"""benchmarks/dora_memory.py at smoke size: each form's saved bytes and times reach the record, and DoRA's folded
weight keeps what plain LoRA's keeps and two [out] vectors, where autograd through the product kept a weight more
(the bytes are a property of the graph, not a timing)."""
from __future__ import annotations

import json

import dora_memory


def test_the_forms_saved_bytes_and_times_are_recorded(tmp_path):
    out = tmp_path / "dora_memory.json"
    record = dora_memory.main(["--out", str(out), "--layer-preset", "smoke", "--tokens", "32", "--step-tokens", "16",
                               "--rounds", "1", "--steps-per-block", "1"])
    assert json.loads(out.read_text())["layers"] == record["layers"] and record["job"] == "dora_memory"
    for layer in record["layers"].values():
        rows = layer["out_in"][0]
        kept = layer["saved_bytes"]
        assert kept["dora"] - kept["lora"] == 2 * rows * 4
        assert kept["dora_autograd"] - kept["dora"] == layer["weight_bytes_fp32"]
        assert set(layer["fwd_bwd_ms"]) == set(layer["weight_fwd_bwd_ms"]) == set(dora_memory.FORMS)
    step = record["step"]
    beyond = step["saved_bytes_per_adapted_layer_beyond_lora"]
    assert step["adapted_layers"] == 14 and 0 < beyond["dora"] < beyond["dora_autograd"]
    assert all(ms > 0 for ms in step["step_ms"].values())
