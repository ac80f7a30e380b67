"""LoRA checkpoints in PEFT's format: PEFT itself reads them, and the merge CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cflib.export.peft import ADAPTER_CONFIG_FILE, describe_base, peft_config, read_adapter
from cflib.model.checkpoint import load_checkpoint, save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import LINEAR_TARGETS, TARGETS, LoraSettings, adapter_state_dict, attach_lora
from cflib.train.adapters import LoraRun

ROOT = Path(__file__).resolve().parents[2]


def saved_adapter(tmp_path: Path, settings: LoraSettings) -> tuple[Path, TRMoEModel]:
    torch.manual_seed(0)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    model = attach_lora(load_checkpoint(base), settings)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():
            param.normal_(0.0, 0.1)
    LoraRun(settings, describe_base(base)).save(model, tmp_path / "adapter")
    return tmp_path / "adapter", model


def test_peft_reads_the_adapter_config(tmp_path):
    peft = pytest.importorskip("peft")
    settings = LoraSettings(rank=4, alpha=16, dropout=0.05, targets=("q_proj", "shared_down", "expert_up"))
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft_config(settings, "/some/base")))
    config = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 16, 0.05)
    assert set(config.target_modules) == {"q_proj", "shared_down"} and config.target_parameters == ["expert_up"]
    assert config.base_model_name_or_path == "/some/base" and config.task_type == "CAUSAL_LM"


@pytest.mark.parametrize("targets", [tuple(TARGETS), LINEAR_TARGETS, ("k_proj", "expert_gate", "expert_down")],
                         ids=["all", "linear", "some"])
def test_peft_loads_the_adapters_onto_the_base_model_and_computes_the_same(tmp_path, targets):
    """PEFT's own loader and LoRA layers (lora.Linear, and lora.ParamWrapper for the expert tensors) on
    cflib's plain decoder give the adapted model's outputs: names, layouts and nesting are PEFT's."""
    peft = pytest.importorskip("peft")
    adapter, model = saved_adapter(tmp_path, LoraSettings(rank=4, alpha=8, targets=targets))
    config = peft.LoraConfig.from_pretrained(str(adapter))
    config.task_type = None  # cflib's decoder is no transformers causal LM; the generic PeftModel wraps it
    wrapped = peft.PeftModel.from_pretrained(load_checkpoint(tmp_path / "base"), str(adapter), config=config)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = model.eval()(ids), wrapped.eval()(ids)
        plain = load_checkpoint(tmp_path / "base").eval()(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (plain - expected).abs().max() > 1e-3


@pytest.mark.parametrize("targets, tokens", [(LINEAR_TARGETS, ()), (tuple(TARGETS), (70, 71, 102))],
                         ids=["linear", "all_and_token_rows"])
def test_peft_loads_the_adapters_onto_the_exported_hub_model(tmp_path, targets, tokens):
    """The Hub bundle of the base (cflib.export.hub) with PeftModel.from_pretrained: the adapted model's logits,
    and merge_and_unload gives those of cflib's merged checkpoint."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from cflib.export import export_hub
    from cflib.export.peft import merge

    adapter, model = saved_adapter(tmp_path, LoraSettings(rank=4, alpha=8, targets=targets, trainable_tokens=tokens))
    export_hub(tmp_path / "base", tmp_path / "bundle", echo=None)
    hub = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bundle"), trust_remote_code=True,
                                                            dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(hub, str(adapter)).eval()
    ids = torch.tensor([[70, 5, 102, 9, 71, 33, 1, 40, 8], [3, 71, 71, 6, 102, 9, 12, 70, 2]])
    with torch.no_grad():
        expected = model.eval()(ids) @ model.head_weight.t()
        torch.testing.assert_close(wrapped(input_ids=ids).logits, expected, rtol=0, atol=1e-4)
        merge(adapter, tmp_path / "merged")
        merged = load_checkpoint(tmp_path / "merged").eval()
        unloaded = wrapped.merge_and_unload()
        torch.testing.assert_close(unloaded(input_ids=ids).logits, merged(ids) @ merged.head_weight.t(),
                                   rtol=0, atol=1e-4)


@pytest.mark.slow
def test_merge_cli_writes_an_ordinary_checkpoint_and_refuses_another_shape(tmp_path):
    adapter, model = saved_adapter(tmp_path, LoraSettings(rank=2, alpha=4))
    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "cflib.export", "merge", str(adapter), str(merged)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["base_matches_training"] is True
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(merged).eval()(ids), model.eval()(ids), rtol=0, atol=1e-5)
    other = save_checkpoint(TRMoEModel(preset("quickstart")), tmp_path / "other")
    refused = subprocess.run([sys.executable, "-m", "cflib.export", "merge", str(adapter), str(tmp_path / "no"),
                              "--base", str(other)], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode != 0 and "a base of this shape needs" in refused.stderr
    assert not (tmp_path / "no").exists()
    _, base, _ = read_adapter(adapter)
    assert base["path"] == str((tmp_path / "base").resolve())
