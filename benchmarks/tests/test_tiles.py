"""The tile sweep (benchmarks/tiles.py): every candidate tile computes what the default tile computes, and a tile
that computes otherwise is caught; off a GPU nothing is timed."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_config

import tiles

CPU = torch.device("cpu")


def test_every_tile_of_each_kernel_computes_the_default_tiles_outputs():
    config = tiny_config()
    for sweep in (*tiles.qk_sweeps(config, 24, CPU, small=True), tiles.add_norm_sweep(config, 24, CPU, small=True),
                  tiles.adamw_sweep(config, CPU, small=True), *tiles.swiglu_sweeps(config, 24, CPU, small=True)):
        found = tiles.run_sweep(sweep, time_it=False)
        assert sweep.default in sweep.tiles and len(found["tiles"]) == len(sweep.tiles) > 1, sweep.name
        assert all(entry == {"same_outputs": True} for entry in found["tiles"].values()), (sweep.name, found)
        assert found["fastest"] is None


def test_a_tile_that_computes_otherwise_is_recorded_as_such():
    values = torch.arange(6.0)
    sweep = tiles.Sweep("probe", [(1,), (2,)], (1,), lambda tile: lambda: (values * tile[0],), (True,))
    found = tiles.run_sweep(sweep, time_it=False)
    assert found["tiles"] == {"1": {"same_outputs": True}, "2": {"same_outputs": False}}


def test_the_command_writes_its_record(tmp_path):
    out = tmp_path / "tiles.json"
    tiles.main(["--out", str(out), "--preset", "smoke", "--micro-batch", "1", "--seq-len", "16"])
    record = json.loads(out.read_text())
    assert record["job"] == "tiles" and set(record["kernels"]) == {
        "qk_norm_rope_forward", "qk_norm_rope_backward", "add_rms_norm_forward", "adamw", "scaled_swiglu_backward",
        "scaled_swiglu_backward_interleaved", "expert_scale"}
    assert all(all(e.get("same_outputs") for e in k["tiles"].values()) for k in record["kernels"].values())


def test_the_command_sweeps_only_the_kernels_named(tmp_path, capsys):
    out = tmp_path / "tiles.json"
    tiles.main(["--out", str(out), "--preset", "smoke", "--micro-batch", "1", "--seq-len", "16",
                "--kernels", "qk_norm_rope_forward"])
    assert set(json.loads(out.read_text())["kernels"]) == {"qk_norm_rope_forward"}
    with pytest.raises(SystemExit):
        tiles.main(["--out", str(tmp_path / "other.json"), "--preset", "smoke", "--kernels", "qk_norm"])
    assert "--kernels: no such kernel qk_norm (known: qk_norm_rope_forward," in capsys.readouterr().err
    assert not (tmp_path / "other.json").exists()
