"""A bundle's own Python never runs unless the user trusts it: cflib loads bundles with its own modeling code.

A tampered bundle (its modeling module writes a marker file when imported) is refused by evaluate naming the
module, answers chat through cflib's own model, and exports to a bundle with cflib's modules; the marker is never
written. A bundle whose config cflib refuses is refused before lm-eval scores anything.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import importlib.util

import pytest
import torch

from cflib.errors import ParamError
from cflib.export import export_hub
from cflib.export.bundle import check_bundle_code, code_differences, load_bundle_model
from cflib.export.hub import HUB_MODULES
from cflib.lab.chat import ChatSession
from cflib.lab.evaluate import EvalParams, prepare_evaluation
from cflib.model import TRMoEModel, load_checkpoint, preset, save_checkpoint

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed (the eval extra)")

MODELING = "modeling_tr_hash_moe.py"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    torch.manual_seed(0)
    return export_hub(save_checkpoint(TRMoEModel(preset("smoke")), root / "ckpt"), root / "bundle", tokenizer="byte",
                      echo=None)


def tampered(bundle: Path, where: Path, change: str = "module") -> tuple[Path, Path]:
    """A copy of `bundle` changed as someone handing it over might, and the file its code would write if run."""
    copy = where / "tampered"
    shutil.copytree(bundle, copy)
    marker = where / "the-bundle-ran-its-code"
    payload = f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    if change == "module":
        (copy / MODELING).write_text((copy / MODELING).read_text() + payload)
    elif change == "extra-module":
        (copy / "helpers.py").write_text(payload)
        config = json.loads((copy / "config.json").read_text())
        config["auto_map"]["AutoModelForCausalLM"] = "helpers.Model"
        (copy / "config.json").write_text(json.dumps(config))
    return copy, marker


def test_a_bundle_cflib_exported_carries_exactly_cflibs_code(bundle):
    assert code_differences(bundle) == []
    assert sorted(p.name for p in bundle.glob("*.py")) == sorted(HUB_MODULES)


@pytest.mark.parametrize("change, words", [
    ("module", [MODELING, "differs from cflib's own module (SHA-256)"]),
    ("extra-module", ["helpers.py: a Python file cflib's bundles do not have", "and 1 more"]),
])
def test_a_tampered_bundle_is_refused_by_every_loader_and_its_code_never_runs(bundle, tmp_path, change, words):
    copy, marker = tampered(bundle, tmp_path, change)
    with pytest.raises(ParamError) as caught:
        check_bundle_code(copy, False, ParamError)
    for word in words + ["trust_bundle_code"]:
        assert word in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match="differs from cflib's own module|a Python file"):
        load_bundle_model(copy)
    assert check_bundle_code(copy, True, ParamError) is True  # the user's explicit choice: its code may run
    assert check_bundle_code(bundle, False, ParamError) is False and not marker.exists()


@pytest.mark.slow  # lm-eval's task registry is read first: seconds
@needs_lm_eval
def test_a_tampered_bundle_is_refused_under_evaluate_before_anything_is_written(bundle, tmp_path):
    copy, marker = tampered(bundle, tmp_path)
    out_dir = tmp_path / "eval"
    with pytest.raises(ParamError, match=rf"model {copy}: {copy / MODELING}: differs from cflib's own module .*"
                                         "trust_bundle_code: true"):
        prepare_evaluation(EvalParams(model=str(copy), tasks=["embedded_choice"], device="cpu", out_dir=str(out_dir)))
    assert not marker.exists() and not out_dir.exists()
    job = prepare_evaluation(EvalParams(model=str(copy), tasks=["embedded_choice"], device="cpu",
                                        out_dir=str(out_dir), trust_bundle_code=True))
    assert job.trust_remote_code is True and not marker.exists()  # transformers would run it: the user said so


def test_a_cflib_bundle_loads_in_transformers_with_cflibs_own_classes(bundle, tmp_path):
    copy, marker = tampered(bundle, tmp_path, change="none")
    model = load_bundle_model(copy)
    assert type(model).__module__ == "cflib.export.hub_modules.modeling_tr_hash_moe"
    ids = torch.tensor([[5, 6, 7, 8]])
    ours = load_checkpoint(copy)(ids) @ load_checkpoint(copy).head_weight.T
    torch.testing.assert_close(model(ids).logits, ours, rtol=1e-4, atol=1e-4)


def test_chat_answers_from_a_tampered_bundle_with_cflibs_own_model(bundle, tmp_path):
    copy, marker = tampered(bundle, tmp_path)
    session = ChatSession(copy, device="cpu")
    rows, _ = session.answer([[{"role": "user", "content": "12+34="}]], {"max_new_tokens": 3, "temperature": 0.0,
                                                                         "top_p": 1.0, "top_k": 0, "seed": 0},
                             progress=False)
    assert len(rows) == 1 and 1 <= len(rows[0]["answer_ids"]) <= 3 and not marker.exists()


def test_exporting_a_tampered_bundle_writes_cflibs_modules_and_runs_none(bundle, tmp_path):
    copy, marker = tampered(bundle, tmp_path)
    export_hub(copy, tmp_path / "again", tokenizer="byte", echo=None)
    assert code_differences(tmp_path / "again") == [] and not marker.exists()


@pytest.mark.slow  # lm-eval's task registry is read first: seconds
@needs_lm_eval
def test_a_bundle_whose_config_cflib_refuses_is_refused_before_lm_eval_scores_it(bundle, tmp_path, monkeypatch):
    import lm_eval

    copy = tmp_path / "bad-config"
    shutil.copytree(bundle, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "norm_eps": 1e300}))
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda *a, **k: pytest.fail("lm-eval scored a refused bundle"))
    with pytest.raises(ParamError, match=rf"{copy / 'config.json'}: norm_eps must be in"):
        prepare_evaluation(EvalParams(model=str(copy), tasks=["embedded_choice"], device="cpu",
                                      out_dir=str(tmp_path / "eval")))
    assert not (tmp_path / "eval").exists()
