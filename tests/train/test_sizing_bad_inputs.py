"""The cluster sizing fed extreme and odd numbers: every one ends in a SizingError naming its key, never an
OverflowError or a traceback from the arithmetic."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from cflib.train.sizing import (
    SizingError,
    format_arithmetic,
    format_cluster_layout,
    main,
    run_arithmetic,
    validate_cluster_layout,
)

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = {"target_tokens": 2e9, "gpus": 8, "micro_batch_per_rank": 16, "seq_len": 2048,
              "tokens_per_s_per_gpu": 140000}
LAYOUT = {"model": {"params": 201194368},
        "parallel": {"tp": 1, "pp": 1, "dp": 8, "micro_batch_per_rank": 16, "global_batch": 128},
        "run": {"seq_len": 2048, "target_tokens": 2e9, "tokens_per_s_per_gpu": 140000}}
EXTREMES = [10**400, 2**1024, 1e308, float("inf"), float("nan"), 1e16, 0, -1, 0.5, 1e-308, 5e-324, True, "x",
            None, [1], {"a": 1}]


@pytest.mark.parametrize("value", EXTREMES, ids=lambda v: repr(v)[:12])
@pytest.mark.parametrize("key", [*ARITHMETIC, "grad_accum", "checkpoints", "checkpoint_every_minutes"])
def test_arithmetic_names_the_key_of_an_extreme_number(key, value):
    arguments = {**ARITHMETIC, key: value}
    try:
        report = run_arithmetic(**arguments)
    except SizingError as err:
        assert key in str(err), str(err)
        return
    format_arithmetic(report)  # what was accepted also prints
    assert all(v is None or isinstance(v, (int, str)) or v == v for v in report.values())


PLAN_KEYS = [("parallel", k) for k in LAYOUT["parallel"]] + [("run", k) for k in LAYOUT["run"]] + \
    [("run", "world_size"), ("model", "params")]


@pytest.mark.parametrize("value", EXTREMES, ids=lambda v: repr(v)[:12])
@pytest.mark.parametrize("section, key", PLAN_KEYS, ids=[f"{s}.{k}" for s, k in PLAN_KEYS])
def test_a_cluster_layout_names_the_key_of_an_extreme_number(section, key, value):
    layout = copy.deepcopy(LAYOUT)
    layout[section][key] = value
    try:
        report = validate_cluster_layout(layout)
    except SizingError as err:
        # The key itself, or for a layout that no longer adds up, the key it was checked against.
        assert key in str(err) or f"{section}." in str(err), str(err)
        return
    format_cluster_layout(report)


@pytest.mark.slow
def test_the_command_line_prints_the_error_not_a_traceback(tmp_path, capsys):
    assert main(["arithmetic", "--target-tokens", "2e9", "--gpus", "8", "--micro-batch-per-rank", "16",
                 "--seq-len", "2048", "--tokens-per-s-per-gpu", "1e-300"]) == 2
    assert "tokens_per_s_per_gpu" in capsys.readouterr().err
    layout = tmp_path / "layout.yaml"
    layout.write_text("model: {params: 1e400}\nparallel: {tp: 1, pp: 1, dp: 8, micro_batch_per_rank: 16, "
                    "global_batch: 128}\nrun: {seq_len: 2048, target_tokens: 2e9}\n")
    done = subprocess.run([sys.executable, "-m", "cflib.train.sizing", "check", str(layout)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "model.params" in done.stderr and "Traceback" not in done.stderr, done.stderr
    layout.write_bytes(b"\xff\xfe: [")
    assert main(["check", str(layout)]) == 2
    assert str(layout) in capsys.readouterr().err
