"""benchmarks/step_ab.py: two production sessions in one process, a change between their builds, alternating blocks."""
from __future__ import annotations

import json

import pytest

import step_ab

from cflib.train.params import ParamError

CHANGE = '''
CALLS = []


def apply():
    CALLS.append("change")
    return {"changed": True}


def before():
    CALLS.append("before")
'''


def test_the_change_runs_between_the_builds_and_the_blocks_alternate(tmp_path, monkeypatch):
    patch = tmp_path / "patch.py"
    patch.write_text(CHANGE)
    built = []
    real_session = step_ab.project_session

    def session(name, tparams, stream=None):
        built.append(tparams.out_dir)
        return real_session(name, tparams, stream)

    monkeypatch.setattr(step_ab, "project_session", session)
    out = tmp_path / "ab.json"
    step_ab.main(["-f", "params/throughput_smoke.yaml", "--change", f"{patch}:apply", "--before", f"{patch}:before",
                  "--micro-batch", "2", "--rounds", "2", "--steps-per-block", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["job"] == "step_ab" and record["change_returned"] == "{'changed': True}"
    assert [b["side"] for b in record["blocks"]] == ["a", "b", "b", "a"]
    assert [p.rsplit("/", 1)[-1] for p in built] == ["run-a", "run-b"]
    summary = record["summary"]
    ratios = [record["blocks"][1]["tokens_per_s"] / record["blocks"][0]["tokens_per_s"],
              record["blocks"][2]["tokens_per_s"] / record["blocks"][3]["tokens_per_s"]]
    assert summary["b_over_a_per_round"] == pytest.approx(ratios)
    assert record["kernel_path"]["a"]["rmsnorm"] == record["kernel_path"]["b"]["rmsnorm"]


def test_before_runs_first_and_the_change_after_a_is_built(tmp_path, monkeypatch):
    order = []

    def session(name, tparams, stream=None):
        order.append(f"build {tparams.out_dir.rsplit('/', 1)[-1]}")
        return _Session()

    monkeypatch.setattr(step_ab, "project_session", session)
    monkeypatch.setattr(step_ab, "load_change", lambda spec: lambda: order.append(spec))
    step_ab.compare_step("params/throughput_smoke.yaml", "change", "before", 1, 1, 1, tmp_path)
    assert order == ["before", "build run-a", "change", "build run-b"]


class _Session:
    def step(self, *_):
        return {}

    def kernel_path(self):
        return {}


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "name it as module:function"),
    ("cflib.no_such_module:f", "cannot import cflib.no_such_module"),
    ("step_ab:no_such_function", "has no function no_such_function"),
    ("missing/file.py:f", "no file missing/file.py"),
])
def test_a_change_that_names_nothing_is_refused_before_any_build(spec, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        step_ab.main(["-f", "params/throughput_smoke.yaml", "--change", spec, "--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_balanced_ratio_cancels_what_the_second_block_loses_by_its_place():
    """B as fast as A, but the second block of every round 2% slower: each round's ratio is 0.98 or 1/0.98, their
    median wherever the rounds fall; the pairs' geometric means are 1."""
    blocks = [{"side": side, "tokens_per_s": 100.0 if i % 2 == 0 else 98.0}
              for i, side in enumerate(step_ab.block_order(4))]
    summary = step_ab.summarize(blocks)
    assert summary["b_over_a_per_round"] == pytest.approx([0.98, 1 / 0.98, 0.98, 1 / 0.98])
    assert summary["b_over_a_balanced"] == pytest.approx(1.0)


def test_rounds_alternate_which_side_goes_first():
    assert step_ab.block_order(3) == ["a", "b", "b", "a", "a", "b"]


def test_load_change_returns_the_named_function():
    assert step_ab.load_change("step_ab:block_order") is step_ab.block_order
    with pytest.raises(ParamError):
        step_ab.load_change(":f")
