"""frozen_modules / frozen_layers (cflib.train.freezing): the frozen weights keep their starting values on the
reference and the fused paths (BF16 weight copies, cflib's AdamW kernel), the others train; the plan and the record
say what is frozen; what cannot be frozen is refused before anything runs. Two processes: tests/train/
test_distributed.py (DDP and FSDP); a resume that changes them: tests/train/test_resume_identity.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sft_shard_helpers import task_shard
from tiny_models import KERNEL_DEVICE

from cflib.model.checkpoint import load_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.weight_copies import WeightCopies, rows
from cflib.ops.dispatch import KernelUnavailable
from cflib.train import prepare, train
from cflib.train.execution import plan_execution
from cflib.train.params import ParamError, TrainParams

EXPERTS_ALONE = ["embeddings", "attention", "shared", "norms"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 8, 2)


def run_params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 32, "micro_batch_per_rank": 2,
            "global_batch": 4, "max_steps": 2, "lr": 1e-2, "eval_at_start": False, "exact_match_limit": 0,
            "eval_micro_batch": 2, "device": "cpu", **overrides}


def starting_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The smoke preset's weights as prepare() draws them (torch.manual_seed(seed) first)."""
    torch.manual_seed(seed)
    return TRMoEModel(preset("smoke")).state_dict()


def changed(out_dir: Path) -> dict[str, bool]:
    """Each parameter of the checkpoint after the 2 steps: whether it moved from its starting value."""
    start, last = starting_weights(), load_checkpoint(out_dir / "checkpoints" / "epoch-1")
    return {name: not torch.equal(value, start[name]) for name, value in last.named_parameters()}


def test_the_reference_path_trains_the_experts_alone_and_records_it(tmp_path, shard):
    record = train(run_params(shard, tmp_path / "run", frozen_modules=EXPERTS_ALONE), progress=False)
    moved = changed(tmp_path / "run")
    assert {name for name, on in moved.items() if on} == {name for name in moved if ".expert_" in name}
    config = preset("smoke")
    experts = 3 * config.num_hidden_layers * config.num_experts * config.hidden_size * config.expert_width
    assert record["params_trainable"] == experts and record["params_total"] == config.num_parameters()
    assert [(group["name"], group["params"]) for group in record["optimizer_groups"]] == [("decay", experts)]
    assert record["execution_plan"]["frozen"] == {"modules": EXPERTS_ALONE, "layers": None, "tied_head": True,
                                                  "tensors": sum(not on for on in moved.values()),
                                                  "params": config.num_parameters() - experts}
    assert list(record["params"]["frozen_modules"]) == EXPERTS_ALONE
    frozen = config.num_parameters() - experts  # held at 4 B (fp32, no gradient, no moments), the experts at 16
    assert record["memory_estimate"]["model_and_optimizer_bytes"] == 4 * frozen + 16 * experts
    assert record["memory_estimate"]["weights"]["trainable_params"] == record["params_trainable"]


def test_the_fused_paths_keep_frozen_weights_and_their_bf16_copies(tmp_path, shard):
    """cflib's kernels (interpreted on a CPU), BF16 weight copies (the tied head's too) and cflib's AdamW kernel,
    which writes the copies of the weights it steps: the embeddings, the head and layer 0's experts stay put, the
    rest trains."""
    record = train(run_params(shard, tmp_path / "run", device=KERNEL_DEVICE.type, bf16=True, fp32_loss=False,
                              use_custom_kernels="true", frozen_modules="embeddings,experts", frozen_layers="0",
                              kernel_overrides={"bf16_weight_copies": "true", "cflib_adamw": "true",
                                                "cuda_graphs": "false"}), progress=False)
    assert record["kernel_path"]["weights"] == "bf16_copies" and record["kernel_path"]["optimizer"] == "cflib_triton"
    assert record["kernel_path"]["moe"] == "triton_fused"
    frozen = {"embed_tokens.weight", *(f"layers.0.mlp.engine.{name}" for name in
                                       ("expert_gate", "expert_up", "expert_down"))}
    assert {name for name, on in changed(tmp_path / "run").items() if not on} == frozen


def test_a_copy_of_frozen_weights_is_written_once_and_again_only_when_it_goes_stale():
    frozen, trained = torch.nn.Parameter(torch.randn(2, 3), requires_grad=False), torch.nn.Parameter(torch.randn(2, 3))
    copies = WeightCopies()
    copies.add("frozen", (frozen,), (rows(0, 2),), (2, 3))
    copies.add("trained", (trained,), (rows(0, 2),), (2, 3))
    copies.refresh()
    written = {name: copy.tensor.clone() for name, copy in copies.copies.items()}
    for copy in copies.copies.values():
        copy.tensor.zero_()  # what a refresh writes shows
    copies.refresh()
    assert torch.equal(copies.copies["frozen"].tensor, torch.zeros(2, 3))
    assert torch.equal(copies.copies["trained"].tensor, written["trained"])
    with torch.no_grad():
        frozen.mul_(2)  # an in-place edit moves its version: stale
    copies.refresh(stale_only=True)
    assert torch.equal(copies.copies["frozen"].tensor, frozen.to(torch.bfloat16))


def test_the_plan_names_what_is_frozen_and_cuda_graphs_stay_off(monkeypatch):
    import cflib.train.execution

    params = TrainParams.from_dict({"device": "cpu", "frozen_modules": ["embeddings", "attention"],
                                    "frozen_layers": "0"})
    model = TRMoEModel(preset("smoke"))
    monkeypatch.setattr(cflib.train.execution, "why_eager", lambda *args: None)  # as on a GPU where graphs run
    plan = plan_execution(params, model, "single", torch.device("cpu"))
    assert not plan.cuda_graphs and plan.reasons["cuda_graphs"].startswith("frozen_modules: CUDA graphs are not")
    assert "frozen embeddings (and the tied head); attention in layer 0: " in plan.describe()
    assert plan.frozen["tied_head"] and plan.frozen["layers"] == [0]
    required = TrainParams.from_dict({"device": "cpu", "frozen_modules": "embeddings",
                                      "kernel_overrides": {"cuda_graphs": "true"}})
    with pytest.raises(KernelUnavailable, match="cuda_graphs: true, but frozen_modules"):
        plan_execution(required, model, "single", torch.device("cpu"))


@pytest.mark.parametrize("given, words", [
    ({"frozen_modules": "embedding"}, ["frozen_modules", "'embedding' is not a module family", "embeddings"]),
    ({"frozen_modules": []}, ["frozen_modules", "names no module family"]),
    ({"frozen_modules": "experts,experts"}, ["frozen_modules repeats"]),
    ({"frozen_modules": "experts", "full_parameter": False, "init_checkpoint": "x"},
     ["frozen_modules", "full_parameter is false"]),
    ({"frozen_modules": "embeddings,attention,shared,experts,norms"}, ["every module family", "nothing would train"]),
    ({"frozen_layers": "0-1"}, ["frozen_layers", "names none of them"]),
    ({"frozen_modules": "embeddings", "frozen_layers": "0"}, ["frozen_layers", "names none of them"]),
    ({"frozen_modules": "experts", "frozen_layers": "3-1"}, ["frozen_layers", "not a layer index"]),
    ({"frozen_modules": "experts", "frozen_layers": []}, ["frozen_layers names no layer"]),
    ({"frozen_modules": 3}, ["frozen_modules must be a list"]),
], ids=["unknown", "empty", "repeated", "lora", "everything", "layers-alone", "layers-embeddings", "bad-range",
        "no-layer", "not-a-list"])
def test_what_cannot_be_frozen_is_refused_naming_the_parameter(given, words):
    with pytest.raises(ParamError) as caught:
        TrainParams.from_dict(given)
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_the_same_families_and_layers_in_another_order_are_the_same_parameters():
    """A resume compares the parameters' values: written in another order, the same frozen weights are equal."""
    one = TrainParams.from_dict({"frozen_modules": "experts,embeddings", "frozen_layers": [3, "0-1"]})
    other = TrainParams.from_dict({"frozen_modules": ["embeddings", "experts"], "frozen_layers": "0-1,3"})
    assert one.frozen_modules == other.frozen_modules == ("embeddings", "experts")
    assert one.frozen_layers == other.frozen_layers == (0, 1, 3)


@pytest.mark.parametrize("given, words", [
    ({"frozen_layers": "0-2"}, ["frozen_layers names layer 2", "the model has 2 layers"]),
    ({"frozen_layers": "0-1"}, ["freezes every weight", "nothing would train"]),
], ids=["past-the-model", "every-layer"])
def test_what_the_model_cannot_freeze_stops_prepare_before_anything_is_written(tmp_path, given, words):
    families = "embeddings,attention,shared,experts,norms"
    with pytest.raises(ParamError) as caught:
        prepare(TrainParams.from_dict({"device": "cpu", "out_dir": str(tmp_path / "run"), "frozen_modules": families,
                                       **given}))
    assert all(word in str(caught.value) for word in words), str(caught.value)
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_freezes_the_same_weights(tmp_path, shard):
    """The resume builds its model anew from the checkpoint and freezes it as the run did: the embeddings are still
    the starting ones after the resumed steps, and the optimizer state it loads fits the same groups."""
    frozen = run_params(shard, tmp_path / "run", max_steps=6, save_every_steps=2, frozen_modules="embeddings")
    first = train(frozen, progress=False)
    (tmp_path / "run" / "COMPLETE").unlink()  # as if killed after its last resumable checkpoint
    resumed = train({**frozen, "resume": "latest"}, progress=False)
    assert "resumed from" in resumed["model_source"] and resumed["schedule"]["steps_done"] == 6
    assert resumed["params_trainable"] == first["params_trainable"] < first["params_total"]
    start, last = starting_weights(), load_checkpoint(tmp_path / "run" / "checkpoints" / "epoch-3")
    assert torch.equal(last.embed_tokens.weight, start["embed_tokens.weight"])
    assert not torch.equal(last.layers[0].self_attn.q_proj.weight, start["layers.0.self_attn.q_proj.weight"])
