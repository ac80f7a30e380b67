"""The optimizer a run chooses (`optimizer`: adamw, adafactor, muon; cflib.train.optim, cflib.train.optimizer_choice)
and `embedding_lr_multiplier`: real steps of the smoke model on the embedded data, the plan and the record naming
which weights each optimizer stepped, the state a resume continues, the memory estimate's count of each optimizer's
state, and the runs refused before step 1. AdamW's own paths: tests/train/test_optim_groups.py and
test_triton_adamw.py; two processes: tests/train/test_distributed.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import tiny_model

from cflib.lab.sweep import SweepParams, expand_sweep
from cflib.model.checkpoint import load_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import LoraSettings, attach_lora
from cflib.model.weight_copies import WeightCopies, rows
from cflib.ops.dispatch import KernelUnavailable
from cflib.train import train
from cflib.train.distributed import training_state_bytes
from cflib.train.execution import plan_execution
from cflib.train.optim import MuonWithAdamW, OptimizerSettings, describe_groups, make_optimizer
from cflib.train.optimizer_choice import optimizer_memory, state_bytes, weight_copies_writer
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics

# Six steps of 8 examples at a constant rate: enough for each optimizer to lower the loss, a second or two each.
RUN = {"model": "smoke", "device": "cpu", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 8, "max_steps": 6,
       "warmup_ratio": 0.0, "lr_schedule": "constant", "eval_at_start": False, "exact_match_limit": 0,
       "save_checkpoints": False}
# Ten times the default lr: enough for six steps to lower the loss well (Adafactor reads lr as AdamW does).
LR = {"adafactor": 1e-2, "muon": 1e-2}
SETTINGS = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def train_losses(out_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train"]


@pytest.mark.parametrize("optimizer, kernel, parts, embedding", [
    ("adafactor", "torch_adafactor", {"adafactor": (["attention", "embeddings", "experts", "norms", "shared"], 30)},
     1.0),
    ("muon", "torch_muon+torch", {"muon": (["attention", "shared"], 14),
                                  "adamw": (["embeddings", "experts", "norms"], 16)}, 0.5),
])
def test_each_optimizer_lowers_the_loss_and_the_record_says_what_stepped_what(tmp_path, optimizer, kernel, parts,
                                                                              embedding):
    record = train({**RUN, "optimizer": optimizer, "lr": LR[optimizer], "embedding_lr_multiplier": embedding,
                    "out_dir": str(tmp_path / "run")}, progress=False)
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    # The logged rate is lr's own (constant here), not the embedding group's, which comes first.
    rates = [row["lr"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if row["event"] == "train"]
    assert rates == [LR[optimizer]] * 6 and record["optimizer_groups"][0]["lr"] == LR[optimizer] * embedding
    assert record["kernel_path"]["optimizer"] == kernel and record["execution_plan"]["optimizer"] == "torch"
    choice = record["execution_plan"]["optimizer_choice"]
    assert {name: (part["families"], part["tensors"]) for name, part in choice["parts"].items()} == parts
    assert sum(part["params"] for part in choice["parts"].values()) == record["params_trainable"]
    assert choice["weight_copies"] is None  # a CPU run reads none (the plan's reason says why)
    groups = record["optimizer_groups"]
    assert {group["optimizer"] for group in groups} == set(parts)
    assert all(group["momentum"] == 0.95 and group["adjust_lr_fn"] == "match_rms_adamw"
               for group in groups if group["optimizer"] == "muon")
    assert record["memory_estimate"]["optimizer"]["state_bytes"] < 8 * record["params_trainable"]  # AdamW's moments
    assert record["memory_estimate"]["model_and_optimizer_bytes"] == (
        8 * record["params_total"] + record["memory_estimate"]["optimizer"]["state_bytes"])


@pytest.mark.parametrize("optimizer, state", [("adafactor", {"row_var", "col_var", "step"}),
                                              ("muon", {"momentum_buffer"})])
def test_a_resumed_run_continues_the_optimizer_s_state_to_the_uninterrupted_weights(tmp_path, optimizer, state):
    """The state is saved by parameter name beside the step-2 checkpoint and loaded back: steps 3 and 4 end where the
    uninterrupted run's did (a fresh state would not: Muon's momentum, Adafactor's moments and step). The rate
    changes at every step (a warm-up, then cosine) and the embedding's group has its own, so a step that read the
    groups built before the state was loaded, not the loaded ones the schedule sets, would end elsewhere."""
    run = {**RUN, "optimizer": optimizer, "lr": LR[optimizer], "max_steps": 4, "save_checkpoints": True,
           "save_every_steps": 2, "warmup_steps": 2, "lr_schedule": "cosine", "embedding_lr_multiplier": 0.5,
           "out_dir": str(tmp_path / "run")}
    train(run, progress=False)
    whole = load_checkpoint(tmp_path / "run" / "checkpoints" / "last").state_dict()
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=True)
    assert set(saved["optimizer"]["state"]["layers.0.self_attn.q_proj.weight"]) == state
    (tmp_path / "run" / "COMPLETE").unlink()  # as if killed after step 4
    resumed = train({**run, "resume": "latest"}, progress=False)
    assert resumed["model_source"].endswith("step-2 at step 2") and resumed["schedule"]["steps_done"] == 4
    after = load_checkpoint(tmp_path / "run" / "checkpoints" / "last").state_dict()
    for name, value in whole.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-6, msg=name)


def test_muon_with_adamw_steps_on_after_its_state_is_loaded_as_one_optimizer_would():
    """torch's load_state_dict replaces the groups and the state: the parts must step the loaded ones. The fused
    AdamW part runs on a CPU too. The BF16 weight copies are refreshed by a post-step hook, as the training step
    registers it for any optimizer but cflib's AdamW kernel: they hold the masters Muon and AdamW wrote."""
    def step(model, optimizer, seed):
        torch.manual_seed(seed)
        model(torch.randint(0, 50, (2, 8))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    settings = OptimizerSettings(**SETTINGS, optimizer="muon")
    whole, split = tiny_model(seed=1).train(), tiny_model(seed=1).train()
    whole_optimizer = make_optimizer(whole, settings, fused=True)
    copies = WeightCopies()
    masters = (whole.layers[0].self_attn.q_proj.weight, whole.embed_tokens.weight)  # stepped by Muon, by AdamW
    for index, master in enumerate(masters):
        copies.add(str(index), (master,), (rows(0, master.shape[0]),), tuple(master.shape))
    whole_optimizer.register_step_post_hook(lambda optimizer, args, kwargs: copies.refresh())
    first = make_optimizer(split, settings, fused=True)
    for seed in (0, 1):
        step(whole, whole_optimizer, seed)
    step(split, first, 0)
    second = make_optimizer(split, settings, fused=True)
    second.load_state_dict(first.state_dict())
    step(split, second, 1)
    assert isinstance(second, MuonWithAdamW)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(split.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for index, master in enumerate(masters):
        assert torch.equal(copies.copies[str(index)].tensor, master.detach().to(torch.bfloat16))  # no read-side write
    assert weight_copies_writer("muon", "torch_fused", True) == (
        "refreshed from the masters after each step of torch's Muon + AdamW")
    assert weight_copies_writer("adamw", "cflib_adamw", True) == "cflib's AdamW kernel, as it steps each master"


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int,
           watched: torch.nn.Parameter | None = None) -> list[float]:
    """`count` steps of the tiny model on random ids; the share of each step of `watched` that weight decay took:
    lr x weight_decay x RMS(weight) (torch's AdamW and Adafactor both scale the weights by 1 - lr x weight_decay)
    over the RMS of the whole step."""
    shares = []
    for seed in range(count):
        torch.manual_seed(seed)
        before = None if watched is None else watched.detach().clone()
        model.train()(torch.randint(0, 50, (2, 8))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if before is not None:
            group = next(g for g in optimizer.param_groups if any(p is watched for p in g["params"]))
            decay = group["lr"] * group["weight_decay"] * before.pow(2).mean().sqrt()
            shares.append((decay / (watched.detach() - before).pow(2).mean().sqrt()).item())
    return shares


def test_adafactor_s_lr_is_its_step_as_adamw_s_is():
    """Adafactor's lr is the size of its step, as in transformers' `optim: adafactor` (no step relative to the weight's
    RMS): LoRA's B matrices, which start at zero, move as far as under AdamW at the same lr, and weight decay takes
    a share of each step like AdamW's (relative steps sized it about 1/RMS(weight) times larger)."""
    moved = {}
    for name in ("adamw", "adafactor"):
        model = attach_lora(tiny_model(), LoraSettings(rank=2, alpha=4.0, targets=("q_proj",)))
        for parameter_name, parameter in model.named_parameters():
            parameter.requires_grad_("lora_" in parameter_name)
        _steps(model, make_optimizer(model, OptimizerSettings(lr=2e-4, weight_decay=0.0, betas=(0.9, 0.95),
                                                              optimizer=name)), 5)
        moved[name] = model.layers[0].self_attn.q_proj.lora_B.weight.detach().pow(2).mean().sqrt().item()
    assert 0.1 < moved["adafactor"] / moved["adamw"] < 10, moved
    shares = {}
    for name in ("adamw", "adafactor"):
        model = tiny_model()
        settings = OptimizerSettings(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), optimizer=name)
        optimizer = make_optimizer(model, settings)
        shares[name] = sum(_steps(model, optimizer, 5, model.layers[0].self_attn.q_proj.weight)) / 5
    assert 0.2 < shares["adafactor"] / shares["adamw"] < 5, shares


def test_the_default_is_torch_s_adamw_as_before():
    optimizer = make_optimizer(tiny_model(), OptimizerSettings(**SETTINGS))
    assert type(optimizer) is torch.optim.AdamW and not any("optimizer" in group for group in optimizer.param_groups)
    assert {group["optimizer"] for group in describe_groups(optimizer)} == {"adamw"}


def _rates(model: torch.nn.Module, **settings: object) -> dict[str, float]:
    optimizer = make_optimizer(model, OptimizerSettings(**SETTINGS, **settings))
    return {group["name"]: group["lr"] for group in describe_groups(optimizer)}


def test_the_embedding_learns_at_its_multiple_of_lr_beside_the_other_groups():
    assert _rates(tiny_model(), embedding_lr_multiplier=3.0, expert_lr_multiplier=0.5) == pytest.approx({
        "decay+embeddings": 3e-3, "decay": 1e-3, "no_decay": 1e-3, "decay+experts": 5e-4})
    # Under Muon the embedding (the tied head) steps AdamW, at its own rate.
    muon = make_optimizer(tiny_model(), OptimizerSettings(**SETTINGS, optimizer="muon", embedding_lr_multiplier=3.0))
    groups = {group["name"]: group for group in describe_groups(muon)}
    assert set(groups) == {"decay+embeddings", "decay+muon", "decay", "no_decay"}
    assert groups["decay+embeddings"]["optimizer"] == "adamw" and groups["decay+embeddings"]["lr"] == 3e-3
    assert groups["decay+muon"]["tensors"] == 14 and groups["decay"]["tensors"] == 6  # the experts' 3-D stacks
    # LoRA: the trainable embedding rows (lora_trainable_tokens) are the embedding that trains.
    lora = attach_lora(tiny_model(), LoraSettings(rank=2, alpha=2.0, targets=("q_proj",), trainable_tokens=(1, 2)))
    assert _rates(lora, embedding_lr_multiplier=2.0, lora_lr_multiplier=4.0) == pytest.approx({
        "decay+embeddings": 2e-3, "decay+lora": 4e-3})


def test_the_memory_estimate_counts_each_optimizer_s_state():
    shapes = {"layers.0.self_attn.q_proj.weight": (4, 6), "layers.0.mlp.engine.expert_up": (2, 4, 6),
              "embed_tokens.weight": (10, 4), "norm.weight": (5,)}
    assert state_bytes("adamw", shapes) == 8 * (24 + 48 + 40 + 5)
    assert state_bytes("muon", shapes) == 4 * 24 + 8 * (48 + 40 + 5)  # Muon's momentum on its matrix alone
    assert state_bytes("adafactor", shapes) == 4 * ((4 + 6) + 2 * (4 + 6) + (10 + 4) + 5)  # rows + columns
    config = preset("smoke")
    params = TrainParams.from_dict({"optimizer": "adafactor", "frozen_modules": "experts"})
    estimated = optimizer_memory(params, config)  # on a model of the config on the meta device
    built = TRMoEModel(config)
    assert estimated == optimizer_memory(params, config, built)
    trained = sum(p.numel() for name, p in built.named_parameters() if ".expert_" not in name)
    weights = {"trainable_params": trained, "frozen_params": config.num_parameters() - trained,
               "frozen_dtype": "float32", "frozen_by": "frozen_modules"}
    assert training_state_bytes(config, weights, estimated)[0] == (
        4 * weights["frozen_params"] + 8 * trained + estimated["state_bytes"])
    assert training_state_bytes(config, weights)[0] == 4 * weights["frozen_params"] + 16 * trained  # AdamW
    assert optimizer_memory(TrainParams.from_dict({}), config) is None


@pytest.mark.parametrize("raw, words", [
    ({"optimizer": "sgd"}, "optimizer must be one of adamw, adafactor, muon, got 'sgd'"),
    ({"optimizer": "adafactor", "beta1": 0.8}, "beta1 0.8 is set, but optimizer: adafactor keeps no first moment"),
    ({"optimizer": "adafactor", "adam_epsilon": 1e-6}, "adam_epsilon 1e-06 is set, but optimizer: adafactor"),
    ({"muon_momentum": 0.9}, "muon_momentum 0.9 is set, but only optimizer: muon reads it"),
    ({"optimizer": "muon", "muon_momentum": 1.0}, "muon_momentum must be in [0, 1)"),
    ({"optimizer": "muon", "full_parameter": False, "init_checkpoint": "base"}, "LoRA trains low-rank factors"),
    ({"embedding_lr_multiplier": 0}, "embedding_lr_multiplier must be positive"),
    ({"embedding_lr_multiplier": 2, "frozen_modules": "embeddings"}, "frozen_modules freezes the embeddings"),
    ({"lr": 1.0, "embedding_lr_multiplier": 20}, "(embedding_lr_multiplier 20.0) gives a group the learning rate 20"),
])
def test_settings_no_optimizer_can_use_are_refused(raw, words):
    with pytest.raises(ParamError) as caught:
        TrainParams.from_dict(raw)
    assert words in str(caught.value)


def _plan(resolved: str = "single", model: torch.nn.Module | None = None, **raw: object):
    """The plan of a run of `raw` on a CPU whose strategy resolved to `resolved`."""
    params = TrainParams.from_dict({"device": "cpu", **raw})
    return plan_execution(params, model if model is not None else TRMoEModel(preset("smoke")), resolved,
                          torch.device("cpu"))


def test_what_the_chosen_optimizer_cannot_serve_stops_the_run_before_step_1():
    with pytest.raises(ParamError, match="optimizer: adafactor cannot step FSDP's sharded weights"):
        _plan("fsdp", optimizer="adafactor", nproc_per_node=2, strategy="fsdp")
    with pytest.raises(ParamError, match="no weight that trains is a 2-D matrix Muon steps"):
        _plan(optimizer="muon", frozen_modules="attention,shared")
    with pytest.raises(KernelUnavailable, match=r"cflib_adamw: true, but optimizer: muon \(cflib's kernel steps"):
        _plan(optimizer="muon", kernel_overrides={"cflib_adamw": "true"})
    lora = attach_lora(TRMoEModel(preset("smoke")), LoraSettings())
    with pytest.raises(ParamError, match="LoRA trains adapters on a frozen embedding"):
        _plan(model=lora, full_parameter=False, init_checkpoint="base", embedding_lr_multiplier=2.0)
    plan = _plan("fsdp", optimizer="muon", nproc_per_node=2, strategy="fsdp")  # DTensor shards take Muon's steps
    assert plan.describe().split(" + AdamW")[0].endswith("Muon (attention, shared)")
    assert plan.reasons["cflib_adamw"] == "optimizer: muon (cflib's kernel steps AdamW alone)"


def test_a_sweep_and_a_curriculum_stage_may_choose_the_optimizer(tmp_path):
    sweep = expand_sweep(SweepParams.from_dict({"grid": {"optimizer": ["adamw", "muon", "adafactor"]},
                                                "out_dir": str(tmp_path / "sweep")}))  # params/sweep_smoke.yaml's base
    assert sweep.swept == ["optimizer"] and [p.status for p in sweep.points] == ["queued"] * 3
    curriculum = tmp_path / "curriculum.yaml"
    curriculum.write_text(yaml.safe_dump({"version": 1, "stages": [
        {"name": "adamw", "max_steps": 2}, {"name": "muon", "max_steps": 2, "optimizer": "muon", "lr": 1e-2}]}))
    train({**RUN, "curriculum": str(curriculum), "out_dir": str(tmp_path / "run")}, progress=False)
    records = [json.loads((tmp_path / "run" / "stages" / name / "record.json").read_text())
               for name in ("adamw", "muon")]
    assert [record["kernel_path"]["optimizer"] for record in records] == ["torch", "torch_muon+torch"]
    shutil.rmtree(tmp_path / "run")
