"""`python benchmarks/loss_parity.py`: a variant computing the same function trains within the baseline's noise,
one computing another does not, and a bad variant or parameter set stops before the first run."""
from __future__ import annotations

import json

import pytest

from loss_parity import BF16_FLOOR, deviation, main, parse_variant

from cflib.paths import project_root
from cflib.train.params import ParamError

SMOKE = project_root() / "params" / "smoke.yaml"


def test_the_same_function_is_within_the_noise_and_another_is_not(tmp_path):
    """cflib's AdamW kernel (the interpreter here) against torch's: within; a tenfold learning rate: outside."""
    out = tmp_path / "records" / "parity.json"  # its folder is made
    main(["-f", str(SMOKE), "--set", "lr=2e-3", "--steps", "3", "--variant", "kernel_overrides={cflib_adamw: true}",
          "--variant", "lr=1e-2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["job"] == "loss_parity" and record["steps"] == 3 and record["params"]["lr"] == 2e-3
    baseline, repeat, kernel, faster = record["runs"]
    assert len(baseline["losses"]) == 3 and repeat["deviation"] == 0.0  # a CPU run repeats exactly
    assert kernel["kernel_path"]["optimizer"] == "cflib_triton" and kernel["within_noise"]
    assert 0.0 < kernel["deviation"] <= BF16_FLOOR  # another rounding, not another function
    assert not faster["within_noise"] and faster["deviation"] > BF16_FLOOR


def test_deviation_is_the_largest_relative_step_difference():
    assert deviation([2.0, 1.1], [2.0, 1.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="2 steps against the baseline's 3"):
        deviation([1.0, 1.0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize("text, message", [("cflib_adamw", "'cflib_adamw' is not name=value"),
                                           ("=true", "'=true' is not name=value"), (" , ", "changes nothing")])
def test_a_malformed_variant_is_refused_by_its_text(text, message):
    with pytest.raises(ParamError, match=message):
        parse_variant(text)


def test_a_variant_naming_no_parameter_stops_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["-f", str(SMOKE), "--steps", "2", "--variant", "cflib_adamv=true",
              "--out", str(tmp_path / "parity.json")])
    assert "cflib_adamv" in capsys.readouterr().err
    assert not (tmp_path / "parity.json").exists()


def test_no_steps_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["-f", str(SMOKE), "--steps", "0", "--out", str(tmp_path / "parity.json")])
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err
