"""LoRA checkpoints in PEFT's format: PEFT itself reads them, and the merge CLI."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cflib.export.__main__ import main as export_main
from cflib.export.peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CFLIB_ADAPTER_FILE,
    describe_base,
    load_merged,
    peft_config,
    read_adapter,
)
from cflib.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
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
        for name, param in adapter_state_dict(model).items():
            if name.endswith(".lora_magnitude_vector"):  # DoRA's: off the base's row norms
                param.mul_(1 + 0.2 * torch.randn_like(param))
            else:
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
    assert config.revision is None
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft_config(settings, "org/base", "0a" * 20)))
    config = peft.LoraConfig.from_pretrained(str(tmp_path))  # a base on the Hub, at the commit trained on
    assert (config.base_model_name_or_path, config.revision) == ("org/base", "0a" * 20)


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


def test_peft_loads_rslora_adapters_with_their_scale(tmp_path):
    """lora_scaling rslora writes use_rslora: true, so PEFT scales by alpha / sqrt(r) as cflib does (on the linear
    and the expert adapters alike); read as standard adapters, the same files would give other logits."""
    peft = pytest.importorskip("peft")
    settings = LoraSettings(rank=16, alpha=8, scaling="rslora", targets=("q_proj", "shared_down", "expert_up"))
    adapter, model = saved_adapter(tmp_path, settings)
    config = peft.LoraConfig.from_pretrained(str(adapter))
    assert config.use_rslora is True and json.loads((adapter / CFLIB_ADAPTER_FILE).read_text())["lora"][
        "scaling"] == "rslora"
    config.task_type = None  # cflib's decoder is no transformers causal LM; the generic PeftModel wraps it
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    got = {}
    for rslora in (True, False):
        config.use_rslora = rslora
        wrapped = peft.PeftModel.from_pretrained(load_checkpoint(tmp_path / "base"), str(adapter), config=config)
        with torch.no_grad():
            got[rslora] = wrapped.eval()(ids)
    with torch.no_grad():
        expected = model.eval()(ids)
    torch.testing.assert_close(got[True], expected, rtol=0, atol=1e-5)
    assert (got[False] - expected).abs().max() > 1e-3  # alpha / r would be a quarter of the scale
    assert read_adapter(adapter)[0] == settings
    merged = load_merged(adapter)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids), expected, rtol=0, atol=1e-5)


def test_peft_loads_dora_adapters_with_their_magnitudes_and_computes_the_same(tmp_path):
    """lora_dora writes use_dora: true and each weight's lora_magnitude_vector under PEFT's saved name: PEFT's
    DoRA layers give cflib's logits, and its training gradients (the norm detached in both); read as plain LoRA
    (use_dora false) the same factors give other logits; the merge is PEFT's DoRA weight."""
    peft = pytest.importorskip("peft")
    settings = LoraSettings(rank=4, alpha=8, dora=True, targets=LINEAR_TARGETS)
    adapter, model = saved_adapter(tmp_path, settings)
    base = tmp_path / "base"
    config = peft.LoraConfig.from_pretrained(str(adapter))
    assert config.use_dora is True and json.loads((adapter / CFLIB_ADAPTER_FILE).read_text())["lora"]["dora"] is True
    assert "base_model.model.layers.0.self_attn.q_proj.lora_magnitude_vector" in load_file(
        str(adapter / ADAPTER_WEIGHTS_FILE))
    config.task_type = None  # cflib's decoder is no transformers causal LM; the generic PeftModel wraps it
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    got = {}
    for dora in (True, False):
        config.use_dora = dora
        wrapped = peft.PeftModel.from_pretrained(load_checkpoint(base), str(adapter), config=config,
                                                 is_trainable=dora)
        with torch.no_grad():
            got[dora] = wrapped.eval()(ids)
    with torch.no_grad():
        expected = model.eval()(ids)
    torch.testing.assert_close(got[True], expected, rtol=0, atol=1e-5)
    assert (got[False] - expected).abs().max() > 1e-3
    assert read_adapter(adapter)[0] == settings
    with torch.no_grad():
        torch.testing.assert_close(load_merged(adapter).eval()(ids), expected, rtol=0, atol=1e-5)
    config.use_dora = True
    wrapped = peft.PeftModel.from_pretrained(load_checkpoint(base), str(adapter), config=config, is_trainable=True)
    for net in (model.train(), wrapped.train()):
        net(ids).logsumexp(-1).sum().backward()
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
              for n, p in wrapped.named_parameters() if p.requires_grad}
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(ours) == {n.replace("lora_magnitude_vector.weight", "lora_magnitude_vector") for n in theirs}
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name.replace("lora_magnitude_vector.weight", "lora_magnitude_vector")], grad,
                                   rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("targets, tokens, dora", [(LINEAR_TARGETS, (), False), (tuple(TARGETS), (70, 71, 102), False),
                                                  (LINEAR_TARGETS, (), True)],
                         ids=["linear", "all_and_token_rows", "dora"])
def test_peft_loads_the_adapters_onto_the_exported_hub_model(tmp_path, targets, tokens, dora):
    """The Hub bundle of the base (cflib.export.hub) with PeftModel.from_pretrained: the adapted model's logits,
    and merge_and_unload gives those of cflib's merged checkpoint."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from cflib.export import export_hub
    from cflib.export.peft import merge

    adapter, model = saved_adapter(tmp_path, LoraSettings(rank=4, alpha=8, targets=targets, trainable_tokens=tokens,
                                                          dora=dora))
    export_hub(tmp_path / "base", tmp_path / "bundle", echo=None)
    hub = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bundle"), trust_remote_code=True,
                                                            dtype=torch.float32).eval()
    ids = torch.tensor([[70, 5, 102, 9, 71, 33, 1, 40, 8], [3, 71, 71, 6, 102, 9, 12, 70, 2]])
    with torch.no_grad():
        hub(input_ids=ids)  # the base's own logits first (a baseline): its fused weights must not outlive the merge
    wrapped = peft.PeftModel.from_pretrained(hub, str(adapter)).eval()
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
    run = tmp_path / "run"  # a LoRA run's folder stands for its best checkpoint, as in `export hub` and `adapters`
    shutil.copytree(adapter, run / "checkpoints" / "best")
    export_main(["merge", str(run), str(tmp_path / "merged-from-run")])
    assert (tmp_path / "merged-from-run" / "model.safetensors").read_bytes() == (merged / "model.safetensors").read_bytes()


EXPERT_B = "base_model.model.layers.0.mlp.engine.lora_B.weight"  # expert_up's [in, r * E], expert_down beneath
LINEAR_A = "base_model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("key, tensor, words", [
    (EXPERT_B, lambda t: torch.zeros(t.shape[0], 7), "an expert adapter stacks one rank-2 factor per expert, so 7"),
    (EXPERT_B, lambda t: torch.zeros(5), "has shape [5]; a LoRA factor is a matrix"),
    (LINEAR_A, lambda t: torch.tensor(1.0), "has shape []; a LoRA factor is a matrix"),
    (LINEAR_A, lambda t: t.to(torch.int32), "is stored as torch.int32; cflib reads adapters in float32 or bfloat16"),
    (LINEAR_A, lambda t: t.half(), "is stored as torch.float16"),
], ids=["expert-factor-not-a-multiple-of-the-rank", "expert-factor-1d", "linear-factor-0d", "integer", "fp16"])
def test_an_adapter_file_of_malformed_factors_is_refused_naming_the_file_and_tensor(tmp_path, key, tensor, words):
    """What PEFT's layout cannot hold, or a weight that would be cast silently, is refused by name: never a raw
    reshape or index error, never an integer adapter trained on or merged."""
    adapter, _ = saved_adapter(tmp_path, LoraSettings(rank=2, alpha=4, targets=("q_proj", "expert_up", "expert_down")))
    weights = adapter / ADAPTER_WEIGHTS_FILE
    tensors = load_file(str(weights))
    save_file({**tensors, key: tensor(tensors[key]).contiguous()}, str(weights))
    before = folder_bytes(tmp_path)
    for load in (read_adapter, load_merged):
        with pytest.raises(CheckpointError) as caught:
            load(adapter)
        assert str(caught.value).startswith(f"{weights}: tensor {key!r} ") and words in str(caught.value)
    assert folder_bytes(tmp_path) == before  # the adapter, its base and everything around them as they were


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("change, words", [
    ({"rank": 0}, "lora.rank must be a positive integer, got 0"),
    ({"rank": "2"}, "lora.rank must be a positive integer, got '2'"),
    ({"alpha": float("nan")}, "lora.alpha must be a positive finite number, got nan"),
    ({"dropout": 2}, "lora.dropout must be a number in [0, 1), got 2"),
    ({"targets": "q_proj"}, "lora.targets must be a list of targets among"),
    ({"base_dtype": "int8"}, "lora.base_dtype must be one of ('float32', 'bfloat16'), got 'int8'"),
    ({"trainable_tokens": "0-1000000000"}, "lora.trainable_tokens must be a list of token ids"),
    ({"scaling": "sqrt"}, "lora.scaling must be one of ('standard', 'rslora'), got 'sqrt'"),
    ({"dora": "yes"}, "lora.dora must be true or false, got 'yes'"),
    ({"dora": True}, "lora: DoRA adapts the linear targets only"),
], ids=["rank-0", "rank-a-string", "alpha-nan", "dropout-2", "targets-a-string", "base-dtype-int8", "tokens-a-range",
        "scaling-unknown", "dora-a-string", "dora-on-experts"])
def test_an_adapter_description_of_bad_settings_is_refused_by_key(tmp_path, change, words):
    """cflib_adapter.json's settings, edited or damaged: refused naming the file and key, never a division by zero
    or a NaN scale merged into the weights."""
    adapter, _ = saved_adapter(tmp_path, LoraSettings(rank=2, alpha=4, targets=("q_proj", "expert_up")))
    description = adapter / CFLIB_ADAPTER_FILE
    meta = json.loads(description.read_text())
    description.write_text(json.dumps({**meta, "lora": {**meta["lora"], **change}}))
    before = folder_bytes(tmp_path)
    for load in (read_adapter, load_merged):
        with pytest.raises(CheckpointError) as caught:
            load(adapter)
        assert str(caught.value).startswith(f"{description}: ") and words in str(caught.value), str(caught.value)
    assert folder_bytes(tmp_path) == before


@pytest.mark.parametrize("hub", [{"repo_id": "org/base", "commit": "main"}, {"repo_id": "no-owner", "commit": "0" * 40},
                                 "org/base"], ids=["a-branch", "no-owner", "a-string"])
def test_a_base_s_hub_bundle_that_names_no_repository_and_commit_is_refused(tmp_path, hub):
    """base.hub, which exported adapters name as their base_model_name_or_path and revision, is a repository and a
    commit in full, or the description is refused naming the file."""
    adapter, _ = saved_adapter(tmp_path, LoraSettings(rank=2, alpha=4, targets=("q_proj",)))
    description = adapter / CFLIB_ADAPTER_FILE
    meta = json.loads(description.read_text())
    description.write_text(json.dumps({**meta, "base": {**meta["base"], "hub": hub}}))
    with pytest.raises(CheckpointError, match="base.hub must name the Hub bundle the base was downloaded from"):
        read_adapter(adapter)


def test_a_bundle_peft_left_half_merged_refuses_to_save_until_every_layer_is_merged(tmp_path):
    """Adapters on the expert tensors and the shared-expert Linears: PEFT's merge_and_unload leaves the shared
    ones wrapped (the engine's own wrapper hides them); the bundle refuses a save whose reload would lose them,
    and once every layer is merged the saved model reloads as cflib's merged checkpoint."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from peft.tuners.tuners_utils import BaseTunerLayer

    from cflib.export import export_hub
    from cflib.export.peft import merge

    adapter, _ = saved_adapter(tmp_path, LoraSettings(rank=4, alpha=8, targets=tuple(TARGETS)))
    export_hub(tmp_path / "base", tmp_path / "bundle", echo=None)
    hub = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bundle"), trust_remote_code=True,
                                                            dtype=torch.float32)
    unloaded = peft.PeftModel.from_pretrained(hub, str(adapter)).merge_and_unload().eval()
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.engine\.shared_\w+ is still an adapter layer"):
        unloaded.save_pretrained(tmp_path / "half")
    assert not (tmp_path / "half" / "model.safetensors").exists()
    for name, module in list(unloaded.named_modules()):  # the merge docs/lora.md shows
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(unloaded.get_submodule(parent), child, module.get_base_layer())
    unloaded.save_pretrained(tmp_path / "whole")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole"), trust_remote_code=True,
                                                                 dtype=torch.float32).eval()
    merge(adapter, tmp_path / "merged")
    merged = load_checkpoint(tmp_path / "merged").eval()
    ids = torch.tensor([[70, 5, 102, 9, 71, 33, 1, 40, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, merged(ids) @ merged.head_weight.t(), rtol=0,
                                   atol=1e-4)


def test_adapter_files_are_as_readable_as_the_umask_makes_new_files(tmp_path):
    import os

    previous = os.umask(0o022)
    try:
        adapter, _ = saved_adapter(tmp_path, LoraSettings(rank=2, alpha=4))
    finally:
        os.umask(previous)
    assert {oct(entry.stat().st_mode & 0o777) for entry in adapter.iterdir()} == {"0o644"}


def test_adapters_exported_with_their_base_bundle_load_through_auto_peft(tmp_path):
    """--base-model names the base's bundle in adapter_config.json and the card: AutoPeftModelForCausalLM loads
    base and adapters in one call; without it no base is named (never a folder name of this machine)."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")  # AutoPeftModelForCausalLM loads through it
    from cflib.export import export_hub

    adapter, model = saved_adapter(tmp_path, LoraSettings(rank=4, alpha=8, targets=LINEAR_TARGETS))
    export_hub(tmp_path / "base", tmp_path / "bundle", echo=None)
    export_main(["adapters", str(adapter), str(tmp_path / "named"), "--base-model", str(tmp_path / "bundle")])
    export_main(["adapters", str(adapter), str(tmp_path / "plain")])
    assert json.loads((tmp_path / "plain" / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] is None
    card = (tmp_path / "named" / "README.md").read_text()
    assert f"base_model: {tmp_path / 'bundle'}" in card and f'from_pretrained("{tmp_path / "bundle"}"' in card
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "named"), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([[70, 5, 102, 9, 71, 33, 1, 40, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(ids) @ model.head_weight.t(),
                                   rtol=0, atol=1e-4)
    with pytest.raises(SystemExit):
        export_main(["adapters", str(adapter), str(tmp_path / "bad"), "--base-model", "a\nb"])
    assert not (tmp_path / "bad").exists()
