"""LoRA runs end to end on CPU: the base's loss at step 0, adapter checkpoints, merging, bad input."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sft_shard_helpers import write_shard
from tiny_models import KERNEL_DEVICE

from cflib.data.tasks import generate
from cflib.export.peft import merge, read_adapter
from cflib.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import DORA_TARGETS, LoraSettings, adapter_parameter_count, adapter_state_dict
from cflib.train import prepare, train
from cflib.train.adapters import resumed_model
from cflib.train.params import ParamError, TrainParams

FAST = {"seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16, "lr": 1e-2, "exact_match_limit": 8,
        "device": "cpu"}
# cflib's kernels where the tests run them: the GPU where there is one, else Triton's interpreter on the CPU.
KERNELS = {"use_custom_kernels": "true", "device": KERNEL_DEVICE.type}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:40], eval_examples[:8] + eval_examples[-8:],
                       max_seq_len=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(3)
    return save_checkpoint(TRMoEModel(preset("smoke")), tmp_path_factory.mktemp("base") / "base")


def lora_params(shard: Path, base: Path, out_dir: Path, **overrides) -> dict:
    return {**FAST, "data": str(shard), "init_checkpoint": str(base), "out_dir": str(out_dir),
            "full_parameter": False, "lora_rank": 4, "lora_alpha": 8, **overrides}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kernels", ["false", "true"], ids=["reference", "production"])
def test_a_fresh_adapter_gives_exactly_the_base_model_s_loss(tmp_path, shard, base, kernels):
    common = {"max_steps": 0, "use_custom_kernels": kernels, "exact_match_limit": 0,
              **(KERNELS if kernels == "true" else {})}
    full = train({**FAST, **common, "data": str(shard), "init_checkpoint": str(base),
                  "out_dir": str(tmp_path / "full")}, progress=False)
    adapted = train(lora_params(shard, base, tmp_path / "lora", **common), progress=False)
    assert adapted["eval"]["at_start"]["loss"] == full["eval"]["at_start"]["loss"]


def test_a_lora_run_trains_only_its_adapters_and_saves_them_in_peft_s_format(tmp_path, shard, base):
    before = digest(base / "model.safetensors")
    record = train(lora_params(shard, base, tmp_path / "run", max_steps=None, epochs=2), progress=False)
    assert record["eval"]["final"]["loss"] < record["eval"]["at_start"]["loss"]
    config = preset("smoke")
    lora = record["lora"]
    assert lora["rank"] == 4 and lora["alpha"] == 8 and lora["scale"] == 2 and lora["dropout"] == 0
    assert lora["base"]["path"] == str(base.resolve()) and lora["base"]["sha256"] == before
    assert record["params_trainable"] == lora["adapter_parameters"] == adapter_parameter_count(
        config, LoraSettings(rank=4, alpha=8))
    assert record["params_total"] == config.num_parameters() + record["params_trainable"]
    assert record["kernel_path"]["lora"] == "branch"
    assert record["memory_estimate"]["model_and_optimizer_bytes"] == (
        4 * config.num_parameters() + 16 * record["params_trainable"])
    assert digest(base / "model.safetensors") == before  # the base is never written
    checkpoint = tmp_path / "run" / "checkpoints" / "epoch-2"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                            "cflib_adapter.json"]
    peft_config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 4 and peft_config["lora_alpha"] == 8
    assert peft_config["base_model_name_or_path"] == str(base.resolve())
    keys = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert keys["base_model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, config.hidden_size)
    assert keys["base_model.model.layers.0.self_attn.q_proj.lora_B.weight"].abs().sum() > 0  # it trained


@pytest.mark.slow
def test_merged_checkpoint_gives_the_adapted_model_s_logits(tmp_path, shard, base):
    train(lora_params(shard, base, tmp_path / "run", max_steps=2, **KERNELS), progress=False)
    adapter = tmp_path / "run" / "checkpoints" / "last"
    summary = merge(adapter, tmp_path / "merged")
    assert summary["base_matches_training"] is True and summary["base"] == str(base.resolve())
    params = TrainParams.from_dict(lora_params(shard, base, tmp_path / "x", resume="x"))
    adapted, _ = resumed_model(adapter, params.lora_settings(), params.init_checkpoint)
    merged = load_checkpoint(tmp_path / "merged")
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted.eval()(ids) @ adapted.head_weight.t()
        got = merged.eval()(ids) @ merged.head_weight.t()
        plain = load_checkpoint(base).eval()(ids) @ merged.head_weight.t()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (plain - expected).abs().max() > 1e-4  # the adapters changed the model, and the merge kept it
    # the merged checkpoint is an ordinary one: a full run starts from it
    again = train({**FAST, **KERNELS, "data": str(shard), "init_checkpoint": str(tmp_path / "merged"), "max_steps": 0,
                   "exact_match_limit": 0, "out_dir": str(tmp_path / "again")}, progress=False)
    final = json.loads((tmp_path / "run" / "record.json").read_text())["eval"]["final"]["loss"]
    assert again["eval"]["final"]["loss"] == pytest.approx(final, abs=1e-5)


def test_merging_onto_a_base_of_another_shape_is_refused(tmp_path, shard, base):
    train(lora_params(shard, base, tmp_path / "run", max_steps=1, eval_at_start=False), progress=False)
    other = save_checkpoint(TRMoEModel(preset("quickstart")), tmp_path / "other")
    refused = r"adapter 'layers\.0\.[\w.]+' has shape \[4, \d+\], a base of this shape needs"
    with pytest.raises(CheckpointError, match=refused):
        merge(tmp_path / "run" / "checkpoints" / "last", tmp_path / "merged", base_dir=other)
    assert not (tmp_path / "merged").exists()


def test_only_the_named_targets_are_adapted_and_base_dtype_bf16_runs(tmp_path, shard, base):
    record = train(lora_params(shard, base, tmp_path / "run", max_steps=2, lora_targets="q_proj, v_proj",
                               base_dtype="bfloat16", bf16=True), progress=False)
    assert record["lora"]["targets"] == ["q_proj", "v_proj"] and record["lora"]["base_dtype"] == "bfloat16"
    settings, _, adapters = read_adapter(tmp_path / "run" / "checkpoints" / "last")
    assert {name.split(".")[3] for name in adapters} == {"q_proj", "v_proj"}
    assert np.isfinite(record["eval"]["final"]["loss"])


def test_train_tasks_trains_on_those_tasks_and_evaluates_every_task(tmp_path, shard, base):
    record = train(lora_params(shard, base, tmp_path / "run", max_steps=2, train_tasks="uppercase",
                               exact_match_limit=None),
                   progress=False)
    uppercase = sum(1 for _ in filter(lambda e: e.meta["task"] == "uppercase", generate(seed=1)[0][:40]))
    assert record["data"]["train_examples"] == uppercase
    assert set(record["eval"]["final"]["exact_match"]) == {"addition", "uppercase", "overall"}
    with pytest.raises(ParamError, match="train_tasks: no example .* has task 'poetry'; its tasks: addition, upp"):
        train(lora_params(shard, base, tmp_path / "bad", train_tasks=["poetry"]), progress=False)


@pytest.mark.parametrize("bad, words", [
    ({"full_parameter": True}, ["lora_rank", "full_parameter"]),
    ({"lora_rank": 0}, ["lora_rank", "positive"]),
    ({"lora_rank": -2}, ["lora_rank"]),
    ({"lora_targets": "q_proj,embed_tokens"}, ["lora_targets", "'embed_tokens'", "expert_down"]),
    ({"lora_targets": ["q_proj", "q_proj"]}, ["lora_targets", "repeats"]),
    ({"lora_dropout": 1.0}, ["lora_dropout"]),
    ({"lora_alpha": 0}, ["lora_alpha"]),
    ({"base_dtype": "float16"}, ["base_dtype", "float16"]),
    ({"base_dtype": "bfloat16"}, ["base_dtype", "bf16"]),
    ({"init_checkpoint": None}, ["full_parameter", "init_checkpoint"]),
    ({"lora_trainable_tokens": "250-300"}, ["lora_trainable_tokens", "260", "vocabulary"]),
    ({"lora_dora": True, "lora_targets": "q_proj,expert_down"}, ["lora_dora", "lora_targets names expert_down",
                                                                 "q_proj,k_proj,v_proj,o_proj,shared_gate,shared_up,"
                                                                 "shared_down, or leave it unset"]),
])
def test_bad_lora_settings_stop_before_anything_runs(tmp_path, shard, base, bad, words):
    with pytest.raises(ParamError) as caught:
        train(lora_params(shard, base, tmp_path / "run", **bad), progress=False)
    for word in words:
        assert word in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_resuming_across_full_and_lora_is_refused(tmp_path, shard, base):
    lora = lora_params(shard, base, tmp_path / "lora", max_steps=3, save_every_steps=2)
    train(lora, progress=False)
    (tmp_path / "lora" / "COMPLETE").unlink()  # as if killed after step 2's checkpoint
    full = {k: v for k, v in lora.items() if k not in ("full_parameter", "lora_rank", "lora_alpha")}
    with pytest.raises(ParamError, match="checkpoint of a LoRA run: it resumes with full_parameter: false"):
        train({**full, "resume": "latest"}, progress=False)
    with pytest.raises(ParamError, match="trained with lora_rank 4, this run has 8"):
        train({**lora, "resume": "latest", "lora_rank": 8}, progress=False)
    with pytest.raises(ParamError, match="trained with lora_scaling standard, this run has rslora"):
        train({**lora, "resume": "latest", "lora_scaling": "rslora"}, progress=False)
    # LoRA+'s ratio decides the optimizer's groups: fixed for a run (1 is off, as the run's None)
    with pytest.raises(ParamError, match=r"written with lora_plus_ratio None, this run has 16.0: it sets the "
                                         r"optimizer's parameter groups"):
        prepare(TrainParams.from_dict({**lora, "resume": "latest", "lora_plus_ratio": 16}))
    assert prepare(TrainParams.from_dict({**lora, "resume": "latest", "lora_plus_ratio": 1})).resume_state
    with pytest.raises(ParamError, match="holds LoRA adapters, not a model: merge"):
        train({**full, "out_dir": str(tmp_path / "x"), "init_checkpoint": str(tmp_path / "lora/checkpoints/step-2")},
              progress=False)
    train({**full, "out_dir": str(tmp_path / "full")}, progress=False)
    (tmp_path / "full" / "COMPLETE").unlink()
    with pytest.raises(ParamError, match="checkpoint of a full-parameter run: it resumes with full_parameter: true"):
        train({**lora, "out_dir": str(tmp_path / "full"), "resume": "latest"}, progress=False)


def test_rslora_is_one_of_the_adapters_settings_their_later_runs_keep(tmp_path, shard, base):
    """lora_scaling is recorded with the adapters: a run started from them takes it when unset and refuses another;
    a resume must keep it; adapters saved before the setting existed (no `scaling` recorded) are standard."""
    from cflib.export.peft import CFLIB_ADAPTER_FILE, describe_base
    from cflib.model.lora import attach_lora
    from cflib.train.adapters import LoraRun, with_adapter_settings

    rslora = LoraSettings(rank=4, alpha=8, scaling="rslora")
    adapters = LoraRun(rslora, describe_base(base)).save(attach_lora(load_checkpoint(base), rslora),
                                                         tmp_path / "adapters")
    unset = TrainParams.from_dict({k: v for k, v in lora_params(shard, base, tmp_path / "run",
                                                                  init_checkpoint=str(adapters)).items()
                                   if k not in ("lora_rank", "lora_alpha")})
    filled = with_adapter_settings(unset)
    assert filled.lora_scaling == "rslora" and filled.lora_settings() == rslora
    assert "rsLoRA scale alpha / sqrt(rank) 4" in resumed_model(adapters, rslora, str(base))[1].describe()
    with pytest.raises(ParamError, match="trained with lora_scaling rslora, this run has standard"):
        resumed_model(adapters, LoraSettings(rank=4, alpha=8), str(base))
    description = adapters / CFLIB_ADAPTER_FILE
    meta = json.loads(description.read_text())
    description.write_text(json.dumps({**meta, "lora": {k: v for k, v in meta["lora"].items() if k != "scaling"}}))
    assert with_adapter_settings(unset).lora_scaling == "standard"
    model, run = resumed_model(adapters, LoraSettings(rank=4, alpha=8), str(base))
    assert run.settings.scale == 2.0 and model.lora_settings.scaling == "standard"
    with pytest.raises(ParamError, match="trained with lora_scaling standard, this run has rslora"):
        resumed_model(adapters, rslora, str(base))


def test_a_dora_run_trains_its_magnitudes_and_keeps_dora_in_later_runs(tmp_path, shard, base):
    """lora_dora: the fused kernels run on DoRA's effective weights, the magnitudes train and are saved under PEFT's
    name; the merge is the adapted model; a run from the adapters takes DoRA when unset, a resume or a run that
    sets it otherwise is refused; adapters saved before the setting existed (no `dora`) are plain LoRA."""
    from cflib.export.peft import CFLIB_ADAPTER_FILE
    from cflib.train.adapters import with_adapter_settings

    run = lora_params(shard, base, tmp_path / "run", max_steps=2, save_every_steps=1, lora_dora=True, **KERNELS)
    record = train(run, progress=False)  # lora_targets unset: every linear target
    settings = LoraSettings(rank=4, alpha=8, dora=True, targets=DORA_TARGETS)
    assert tuple(record["lora"]["targets"]) == DORA_TARGETS
    assert record["lora"]["dora"] is True and record["kernel_path"]["lora"] == "effective_weight"
    assert record["params_trainable"] == adapter_parameter_count(preset("smoke"), settings)
    adapters = tmp_path / "run" / "checkpoints" / "last"
    saved = load_file(str(adapters / "adapter_model.safetensors"))
    start = load_checkpoint(base).layers[0].self_attn.q_proj.weight.norm(dim=1)
    magnitude = saved["base_model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
    assert magnitude.shape == start.shape and not torch.equal(magnitude, start)  # it trained
    assert json.loads((adapters / "adapter_config.json").read_text())["use_dora"] is True
    model, _ = resumed_model(adapters, settings, str(base))
    merge(adapters, tmp_path / "merged")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "merged").eval()(ids), model.eval()(ids),
                                   rtol=0, atol=1e-5)
    unset = TrainParams.from_dict({**run, "init_checkpoint": str(adapters), "lora_dora": None, "lora_targets": None})
    assert with_adapter_settings(unset).lora_settings() == settings
    with pytest.raises(ParamError, match="trained with lora_dora True, this run has False"):
        resumed_model(adapters, LoraSettings(rank=4, alpha=8, targets=settings.targets), str(base))
    (tmp_path / "run" / "COMPLETE").unlink()
    with pytest.raises(ParamError, match="trained with lora_dora True, this run has False"):
        train({**run, "resume": "latest", "lora_dora": False}, progress=False)
    description = adapters / CFLIB_ADAPTER_FILE  # written before DoRA: the key absent
    meta = json.loads(description.read_text())
    description.write_text(json.dumps({**meta, "lora": {k: v for k, v in meta["lora"].items() if k != "dora"}}))
    assert with_adapter_settings(unset).lora_dora is False


def test_a_lora_run_with_dropout_resumes_to_the_uninterrupted_adapters(tmp_path, shard, base):
    """Dropout draws its masks from the device's generator (the GPU's on a GPU): a resume restores it along with the
    CPU's, so the steps after the checkpoint draw the masks the uninterrupted run drew."""
    run = lora_params(shard, base, tmp_path / "whole", max_steps=5, save_every_steps=2, lora_dropout=0.2,
                      device=KERNEL_DEVICE.type)
    train(run, progress=False)
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "whole", killed)
    for name in ("COMPLETE", "record.json"):
        (killed / name).unlink()  # as if killed after step-4's checkpoint
    record = train({**run, "out_dir": str(killed), "resume": "latest"}, progress=False)
    assert "step-4" in record["model_source"]
    adapters = lambda folder: load_file(str(folder / "checkpoints" / "last" / "adapter_model.safetensors"))  # noqa: E731
    whole, resumed = adapters(tmp_path / "whole"), adapters(killed)
    for key, tensor in whole.items():  # a GPU's atomics may reorder sums: far below what other masks change
        torch.testing.assert_close(resumed[key], tensor, rtol=0, atol=0 if KERNEL_DEVICE.type == "cpu" else 1e-6)


def test_a_lora_run_whose_base_moved_resumes_from_the_same_weights_named_anew(tmp_path, shard, base):
    """outputs/ moved to another disk: the base's path is gone, its weights (by SHA-256) are where
    init_checkpoint now says; the run resumes on them, and its adapters name the new place. Other weights there
    are refused, as a changed base is."""
    moved = save_checkpoint(load_checkpoint(base), tmp_path / "base")
    lora = lora_params(shard, moved, tmp_path / "run", max_steps=3, save_every_steps=2)
    train(lora, progress=False)
    (tmp_path / "run" / "COMPLETE").unlink()
    elsewhere = tmp_path / "other-disk" / "base"
    shutil.move(str(moved), str(elsewhere))
    with pytest.raises(ParamError, match="which is gone; if it moved, name its new place as init_checkpoint"):
        train({**lora, "resume": "latest"}, progress=False)
    record = train({**lora, "init_checkpoint": str(elsewhere), "resume": "latest"}, progress=False)
    assert "step-2" in record["model_source"]
    newest = [path for name, path in record["checkpoints"].items() if name != "best_step"][-1]
    saved = json.loads((Path(newest) / "cflib_adapter.json").read_text())
    assert Path(saved["base"]["path"]) == elsewhere.resolve()


def test_a_lora_run_from_adapters_resumes_naming_those_adapters_only(tmp_path, shard, base):
    """The base is matched by its SHA-256, so other adapters on it would load as well: a resume names the adapters
    the run started from (by their file's SHA-256: a copy elsewhere is them), or its base alone (found after a
    move), and its record and checkpoints keep naming that start; other adapters are refused before step 1,
    naming both, unless allowed. A run that started from its base is refused adapters named on resume."""
    first = lora_params(shard, base, tmp_path / "first", max_steps=4, save_every_steps=2, exact_match_limit=0)
    train(first, progress=False)
    started = tmp_path / "first" / "checkpoints" / "last"
    other = tmp_path / "other"  # adapters of the same settings on the same base, other values
    shutil.copytree(started, other)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    save_file({name: tensor * 2 for name, tensor in tensors.items()}, str(other / "adapter_model.safetensors"))
    run = lora_params(shard, base, tmp_path / "run", max_steps=3, save_every_steps=2, exact_match_limit=0,
                      init_checkpoint=str(started))
    train(run, progress=False)
    (tmp_path / "run" / "COMPLETE").unlink()  # as if killed after step 2's checkpoint
    before = digest(tmp_path / "run" / "metrics.jsonl")
    with pytest.raises(ParamError) as caught:
        train({**run, "init_checkpoint": str(other), "resume": "latest"}, progress=False)
    for word in ["step-2 continues a LoRA run that started from the adapters", str(started.resolve()),
                 f"init_checkpoint {other.resolve()} holds other adapters", "allow_resume_changes: model"]:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert digest(tmp_path / "run" / "metrics.jsonl") == before
    prepare(TrainParams.from_dict({**run, "init_checkpoint": str(other), "resume": "latest",
                                   "allow_resume_changes": "model"}))
    copy = shutil.copytree(started, tmp_path / "elsewhere")
    for named, start in ((copy, copy), (base, started)):  # the same adapters at another place; the base alone
        resumed = prepare(TrainParams.from_dict({**run, "init_checkpoint": str(named), "resume": "latest"}))
        assert resumed.init_adapters == {"path": str(start.resolve()),
                                         "sha256": digest(started / "adapter_model.safetensors")}
    record = train({**run, "init_checkpoint": str(base), "resume": "latest"}, progress=False)
    assert "step-2" in record["model_source"]
    assert record["lora"]["init_adapters"] == {"path": str(started.resolve()),
                                               "sha256": digest(started / "adapter_model.safetensors")}
    # A run that started from its base: adapters named on resume are not where it started.
    (tmp_path / "first" / "COMPLETE").unlink()
    with pytest.raises(ParamError, match="continues a LoRA run that started from its base, not from adapters"):
        prepare(TrainParams.from_dict({**first, "init_checkpoint": str(other), "resume": "latest"}))


def test_a_changed_base_stops_the_resume(tmp_path, shard, base):
    moved = save_checkpoint(load_checkpoint(base), tmp_path / "base")
    lora = lora_params(shard, moved, tmp_path / "run", max_steps=3, save_every_steps=2)
    train(lora, progress=False)
    (tmp_path / "run" / "COMPLETE").unlink()
    model = load_checkpoint(moved)
    with torch.no_grad():
        model.norm.weight.add_(0.5)
    save_checkpoint(model, moved)
    with pytest.raises(ParamError, match="changed since .* was written"):
        train({**lora, "resume": "latest"}, progress=False)


def test_adapter_tensors_round_trip_through_peft_names(tmp_path, shard, base):
    run = prepare(TrainParams.from_dict(lora_params(shard, base, tmp_path / "run", lora_rank=3)))
    with torch.no_grad():
        for param in adapter_state_dict(run.model).values():
            param.normal_()
    run.lora.save(run.model, tmp_path / "saved")
    _, _, adapters = read_adapter(tmp_path / "saved")
    own = adapter_state_dict(run.model)
    assert set(adapters) == set(own)
    for name in own:
        assert torch.equal(adapters[name], own[name].detach()), name
    assert not (tmp_path / "run").exists()  # prepare wrote nothing


def test_lora_and_expert_multipliers_and_lora_plus_give_the_adapters_their_own_learning_rates(tmp_path, shard, base):
    record = train(lora_params(shard, base, tmp_path / "run", max_steps=2, exact_match_limit=0, lr=1e-2,
                               lora_lr_multiplier=2.0, expert_lr_multiplier=0.25, lora_plus_ratio=4), progress=False)
    groups = {group["name"]: group["lr"] for group in record["optimizer_groups"]}
    # Adapters on attention and the shared MLP: lora only; on the routed experts: both multipliers; B x the ratio.
    assert groups == pytest.approx({"decay+lora_A": 2e-2, "decay+lora_B": 8e-2, "decay+experts+lora_A": 5e-3,
                                    "decay+experts+lora_B": 2e-2})
    assert record["params"]["lora_plus_ratio"] == 4.0
    trainable = sum(group["params"] for group in record["optimizer_groups"])
    assert trainable == record["params_trainable"]


def test_a_lora_run_started_from_adapters_trains_them_on(tmp_path, shard, base):
    """init_checkpoint may be a LoRA checkpoint (a curriculum's later stage starts so): its adapters on their base,
    their settings kept, a fresh optimizer; the adapters it saves still name the original base."""
    first = train(lora_params(shard, base, tmp_path / "first", max_steps=4), progress=False)
    adapters = tmp_path / "first" / "checkpoints" / "last"
    assert first["eval"]["final"]["step"] == 4
    second = train(lora_params(shard, base, tmp_path / "second", max_steps=2, init_checkpoint=str(adapters)),
                   progress=False)
    assert second["eval"]["at_start"]["loss"] == first["eval"]["final"]["loss"]
    assert second["eval"]["final"]["loss"] != second["eval"]["at_start"]["loss"]
    saved = json.loads((tmp_path / "second" / "checkpoints" / "last" / "adapter_config.json").read_text())
    assert Path(saved["base_model_name_or_path"]).resolve() == base.resolve()
    with pytest.raises(ParamError, match="trained with lora_rank 4, this run has 8"):
        train(lora_params(shard, base, tmp_path / "third", lora_rank=8, init_checkpoint=str(adapters)),
              progress=False)
    # Settings left unset are the adapters': the record names them, and the run resumes with its parameters.
    unset = {k: v for k, v in lora_params(shard, base, tmp_path / "fourth", max_steps=2, save_every_steps=1,
                                           init_checkpoint=str(adapters)).items() if k not in ("lora_rank", "lora_alpha")}
    fourth = train(unset, progress=False)
    assert (fourth["params"]["lora_rank"], fourth["params"]["lora_alpha"]) == (4, 8.0)
    assert fourth["eval"]["at_start"]["loss"] == first["eval"]["final"]["loss"]
    (tmp_path / "fourth" / "COMPLETE").unlink()
    shutil.rmtree(tmp_path / "fourth" / "checkpoints" / "last")
    prepare(TrainParams.from_dict({**unset, "resume": "latest"}))
    # Named by its base alone (as after a move), it resumes with the settings of the adapters it continues.
    assert prepare(TrainParams.from_dict({**unset, "init_checkpoint": str(base), "resume": "latest"})
                   ).params.lora_rank == 4
    # Checkpoints written before unset settings were filled recorded them unset: they resume too.
    for state_file in (tmp_path / "fourth" / "checkpoints").glob("*/trainer_state.pt"):
        state = torch.load(state_file, weights_only=True)
        torch.save({**state, "lora_rank": None, "lora_alpha": None}, state_file)
    prepare(TrainParams.from_dict({**unset, "resume": "latest"}))
