"""Knowledge distillation (teacher_checkpoint, cflib.train.teacher): real steps on the smoke preset with a teacher
train on (1 - ratio) CE + ratio tau^2 KL and log both terms; ratio 0 trains exactly as plain SFT; a LoRA run's KL to
its base starts at 0; the teacher is held frozen, in BF16 under bf16, counted in the memory estimate, named in the
plan and the record; a resume keeps teacher and ratio; a curriculum distils stage by stage and its dry run checks
each stage's teacher. The loss against float64 full logits: tests/ops/test_distillation.py; bad teachers and
settings refused before anything is written: tests/train/test_bad_inputs.py; two processes:
tests/train/test_distributed.py."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from sft_shard_helpers import task_shard
from tiny_models import KERNEL_DEVICE

from cflib.model.checkpoint import save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.train import ParamError, TrainParams, batch_arithmetic, describe_arithmetic, prepare, train
from cflib.train.records import read_metrics
from cflib.train.teacher import teacher_bytes
from cflib.train.trackers import scalars


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 8, 2)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """Another smoke model than the one a run starts from (prepare draws the student with seed 0)."""
    torch.manual_seed(3)
    return save_checkpoint(TRMoEModel(preset("smoke")), tmp_path_factory.mktemp("teacher") / "teacher")


def run_params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 32, "micro_batch_per_rank": 2,
            "global_batch": 4, "max_steps": 2, "lr": 1e-2, "eval_at_start": True, "exact_match_limit": 0,
            "eval_micro_batch": 2, "device": "cpu", **overrides}


def train_rows(out_dir: Path) -> list[dict]:
    return [row for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train"]


def last_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "checkpoints" / "epoch-1" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(shard, teacher, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The same two steps without a teacher, with one at ratio 0, and with one at ratio 0.5 and temperature 2."""
    root = tmp_path_factory.mktemp("runs")
    found = {}
    for name, extra in (("plain", {}), ("ratio-0", {"teacher_checkpoint": str(teacher), "distill_ratio": 0.0}),
                        ("distilled", {"teacher_checkpoint": str(teacher), "distill_temperature": 2.0})):
        found[name] = root / name, train(run_params(shard, root / name, **extra), progress=False)
    return found


def test_a_run_with_a_teacher_trains_on_both_terms_and_logs_each(runs, teacher):
    (plain_dir, plain), (out_dir, record) = runs["plain"], runs["distilled"]
    rows, plain_rows = train_rows(out_dir), train_rows(plain_dir)
    for row in rows:  # loss = (1 - 0.5) CE + 0.5 x 2^2 x KL, each a token mean of the step
        assert row["loss"] == pytest.approx(0.5 * row["ce_loss"] + 0.5 * 4 * row["kl_loss"], rel=1e-6)  # fp32 sums
        assert row["kl_loss"] > 0
        assert {"train/ce_loss", "train/kl_loss"} <= set(scalars(row))  # every tracker gets both
    # Step 1 starts from the same weights: the same cross-entropy, and a loss that is not CE alone
    assert rows[0]["ce_loss"] == plain_rows[0]["loss"] and rows[0]["loss"] != plain_rows[0]["loss"]
    assert rows[1]["ce_loss"] != plain_rows[1]["loss"]  # the KL term moved the weights otherwise
    # Held-out loss stays the student's cross-entropy: at step 0 the plain run's exactly
    assert record["eval"]["at_start"]["loss"] == plain["eval"]["at_start"]["loss"]
    assert "ce_loss" not in scalars({**record["eval"]["final"], "event": "eval"})
    plan = record["execution_plan"]["distill"]
    assert (plan["teacher"]["checkpoint"], plan["ratio"], plan["temperature"]) == (str(teacher), 0.5, 2.0)
    assert plan["teacher"]["matrices_dtype"] == "float32" and plan["teacher"]["params"] == plain["params_total"]
    assert record["kernel_path"]["loss"] == "torch_chunked_linear_ce_kl" and "teacher" in record["kernel_path"]
    assert record["params_total"] == plain["params_total"]  # the teacher trains nothing
    memory = record["memory_estimate"]
    assert memory["teacher_bytes"] == 4 * plain["params_total"]
    assert memory["total_bytes"] == plain["memory_estimate"]["total_bytes"] + memory["teacher_bytes"]
    assert record["execution_plan"]["reasons"].get("teacher_checkpoint") is None  # no fused loss runs on a CPU


def test_ratio_0_trains_exactly_as_plain_sft_and_still_measures_the_kl(runs):
    (plain_dir, plain), (out_dir, record) = runs["plain"], runs["ratio-0"]
    rows = train_rows(out_dir)
    assert [row["loss"] for row in rows] == [row["loss"] for row in train_rows(plain_dir)]
    assert [row["ce_loss"] for row in rows] == [row["loss"] for row in rows] and all(row["kl_loss"] > 0 for row in rows)
    assert record["eval"]["final"]["loss"] == plain["eval"]["final"]["loss"]
    plain_weights, weights = last_weights(plain_dir), last_weights(out_dir)
    assert all(torch.equal(weights[name], tensor) for name, tensor in plain_weights.items())


def test_a_lora_run_keeps_close_to_its_base_with_init(shard, tmp_path):
    """teacher_checkpoint: init is the base the adapters train on: the KL starts at 0 (B = 0), then grows."""
    torch.manual_seed(5)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    record = train(run_params(shard, tmp_path / "run", init_checkpoint=str(base), full_parameter=False, lora_rank=4,
                              teacher_checkpoint="init", distill_ratio=0.3, eval_at_start=False, max_steps=3),
                   progress=False)
    rows = train_rows(tmp_path / "run")
    assert rows[0]["kl_loss"] == 0.0 and rows[0]["loss"] == pytest.approx(0.7 * rows[0]["ce_loss"], rel=1e-6)
    assert rows[-1]["kl_loss"] > 0
    assert record["execution_plan"]["distill"]["teacher"]["checkpoint"] == str(base)
    assert record["params_trainable"] == record["lora"]["adapter_parameters"]


def test_a_lora_run_from_adapters_distils_from_their_base_with_init(shard, tmp_path):
    """init is the base the adapters train on, never the adapted model: adapters that trained start away from it."""
    torch.manual_seed(5)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    lora = {"full_parameter": False, "lora_rank": 4, "eval_at_start": False}
    train(run_params(shard, tmp_path / "first", init_checkpoint=str(base), max_steps=2, **lora), progress=False)
    adapters = tmp_path / "first" / "checkpoints" / "epoch-1"
    record = train(run_params(shard, tmp_path / "second", init_checkpoint=str(adapters), teacher_checkpoint="init",
                              distill_ratio=0.3, max_steps=1, **lora), progress=False)
    assert record["execution_plan"]["distill"]["teacher"]["checkpoint"] == str(base.resolve())
    assert record["params"]["teacher_checkpoint"] == "init" and record["lora"]["base"]["path"] == str(base.resolve())
    (row,) = train_rows(tmp_path / "second")
    assert row["kl_loss"] > 0  # the adapters' B left 0 in the first run: the adapted model is not its base
    stages = [{"name": "close", "max_steps": 1, "teacher_checkpoint": "init", "distill_ratio": 0.3}]
    record = train(run_params(shard, tmp_path / "curriculum", init_checkpoint=str(adapters), **lora,
                              curriculum=str(write_curriculum(tmp_path / "c.yaml", stages))), progress=False)
    (stage,) = (json.loads(Path(stage["record"]).read_text()) for stage in record["curriculum"]["stages"])
    assert stage["execution_plan"]["distill"]["teacher"]["checkpoint"] == str(base.resolve())


def test_a_bf16_run_holds_its_teacher_s_matrices_in_bf16_and_counts_them(shard, teacher, tmp_path):
    params = TrainParams.from_dict(run_params(shard, tmp_path / "run", teacher_checkpoint=str(teacher), bf16=True))
    run = prepare(params)
    layers = {param.dtype for param in run.teacher.model.layers.parameters() if param.dim() >= 2}
    assert layers == {torch.bfloat16} and run.teacher.model.embed_tokens.weight.dtype == torch.float32
    assert not any(param.requires_grad for param in run.teacher.model.parameters()) and not run.teacher.model.training
    config = preset("smoke")
    assert run.memory_estimate["teacher_bytes"] == teacher_bytes(config, bf16=True) < 4 * config.num_parameters()
    assert run.plan.distill["teacher"]["matrices_dtype"] == "bfloat16" and "teacher " in run.describe()
    figures = batch_arithmetic(params)  # the notebook's figures, read from the teacher's config alone
    assert figures["memory_estimate"]["teacher_bytes"] == run.memory_estimate["teacher_bytes"]
    assert "teacher" in describe_arithmetic(figures, params)


def test_on_cflib_s_kernels_the_teacher_runs_them_and_the_plan_says_where_the_loss_runs(shard, teacher, tmp_path):
    """cflib's kernels (interpreted on a CPU), BF16 with the student's weight copies: the teacher's forward runs the
    fused modules on its BF16 matrices; the loss leaves cflib's fused cross-entropy for the chunked path, reading the
    FP32 head (no head copy), and the plan says why."""
    record = train(run_params(shard, tmp_path / "run", teacher_checkpoint=str(teacher), device=KERNEL_DEVICE.type,
                              bf16=True, fp32_loss=False, use_custom_kernels="true", max_steps=1, eval_at_start=False,
                              kernel_overrides={"bf16_weight_copies": "true", "cuda_graphs": "false"}),
                   progress=False)
    plan = record["execution_plan"]
    assert plan["reasons"]["teacher_checkpoint"].startswith("distillation runs on the chunked PyTorch loss")
    assert plan["weight_copies"] and not plan["head_copy"]
    assert plan["distill"]["teacher"]["matrices_dtype"] == "bfloat16"
    assert "moe=triton_fused" in record["kernel_path"]["teacher"] and record["kernel_path"]["moe"] == "triton_fused"
    assert record["kernel_path"]["loss"] == "torch_chunked_linear_ce_kl"
    (row,) = train_rows(tmp_path / "run")
    assert row["kl_loss"] > 0 and row["loss"] == pytest.approx(0.5 * row["ce_loss"] + 0.5 * row["kl_loss"], rel=1e-5)


def test_a_resume_continues_the_distillation_and_refuses_another_teacher_or_ratio(shard, teacher, tmp_path):
    settings = {"teacher_checkpoint": str(teacher), "distill_ratio": 0.7, "max_steps": 3, "save_every_steps": 2,
                "eval_at_start": False}
    train(run_params(shard, tmp_path / "whole", **settings), progress=False)
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "whole", killed)
    for name in ("COMPLETE", "record.json"):
        (killed / name).unlink()  # as if killed after the step-2 checkpoint
    for change, words in (({"distill_ratio": 0.5}, "distill_ratio 0.7, this run has 0.5"),
                          ({"teacher_checkpoint": None, "distill_ratio": 0.5},
                           f"teacher_checkpoint {teacher.resolve()}, this run has None")):
        with pytest.raises(ParamError, match="allow_resume_changes") as caught:
            train(run_params(shard, killed, **{**settings, **change, "resume": "latest"}), progress=False)
        assert words in str(caught.value)
    allowed = tmp_path / "allowed"
    shutil.copytree(killed, allowed)
    record = train(run_params(shard, allowed, **{**settings, "distill_ratio": 0.5, "resume": "latest",
                                                 "allow_resume_changes": "distill_ratio"}), progress=False)
    assert record["execution_plan"]["distill"]["ratio"] == 0.5  # changed on purpose: step 3 at the new ratio
    record = train(run_params(shard, killed, **settings, resume="latest"), progress=False)
    assert "step-2" in record["model_source"]
    terms = [[(row["loss"], row["ce_loss"], row["kl_loss"]) for row in train_rows(folder)]
             for folder in (killed, tmp_path / "whole")]
    assert terms[0] == terms[1]  # the resumed step 3 distils as the uninterrupted one did


def write_curriculum(path: Path, stages: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"version": 1, "stages": stages}, sort_keys=False))
    return path


def test_a_curriculum_distils_stage_by_stage_from_its_own_start(shard, tmp_path):
    """init is the curriculum's start in every stage (not the checkpoint the stage before handed on); a stage
    without a teacher trains on the cross-entropy alone."""
    torch.manual_seed(5)
    start = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "start")
    stages = [{"name": "plain", "max_steps": 2},
              {"name": "close", "max_steps": 2, "teacher_checkpoint": "init", "distill_ratio": 0.8}]
    record = train(run_params(shard, tmp_path / "run", init_checkpoint=str(start), eval_at_start=False,
                              curriculum=str(write_curriculum(tmp_path / "c.yaml", stages))), progress=False)
    first, second = (json.loads(Path(stage["record"]).read_text()) for stage in record["curriculum"]["stages"])
    assert first["execution_plan"]["distill"] is None and "kl_loss" not in train_rows(tmp_path / "run" / "stages" /
                                                                                       "plain")[0]
    assert second["model_source"].startswith("checkpoint") and "plain" in second["model_source"]
    assert second["execution_plan"]["distill"]["teacher"]["checkpoint"] == str(start)
    assert all(row["kl_loss"] > 0 for row in train_rows(tmp_path / "run" / "stages" / "close"))


def test_the_dry_run_checks_each_stage_s_teacher_against_the_model(shard, teacher, tmp_path):
    other = save_checkpoint(TRMoEModel(replace(preset("smoke"), vocab_size=300)), tmp_path / "other")
    stages = [{"name": "good", "teacher_checkpoint": str(teacher)},
              {"name": "other-vocabulary", "teacher_checkpoint": str(other)}]
    record = train(run_params(shard, tmp_path / "dry", dry_run=True,
                              curriculum=str(write_curriculum(tmp_path / "c.yaml", stages))), progress=False)
    good, bad = record["stages"]
    assert good["passed"] and good["memory_estimate"]["teacher_bytes"] == 4 * preset("smoke").num_parameters()
    assert not bad["passed"]
    assert f"{other / 'config.json'} has vocab_size 300, the model trained has 260" in bad["error"]


def test_a_teacher_beside_a_registered_loss_is_refused_by_name(shard, teacher, tmp_path, monkeypatch):
    """The KL term joins the built-in cross-entropy in one pass over the head: another loss cannot take it."""
    from cflib.ops import sft_loss

    monkeypatch.setitem(sft_loss.LOSSES, "mine", lambda kernels: sft_loss.SFTLoss(kernels))
    with pytest.raises(ParamError, match="loss_type is 'mine', a registered loss"):
        TrainParams.from_dict(run_params(shard, tmp_path / "run", loss_type="mine", teacher_checkpoint=str(teacher)))


def test_the_loss_plot_draws_the_train_cross_entropy_beside_the_mixed_loss(runs, tmp_path):
    """The held-out loss is cross-entropy: the plot draws the train cross-entropy to compare it with."""
    import matplotlib.pyplot as plt

    from cflib.lab.report import plot_loss_curves

    out_dir, _ = runs["distilled"]
    figure = plot_loss_curves(out_dir / "metrics.jsonl", tmp_path / "curves.png")
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    assert labels == ["train (per step)", "train cross-entropy (beside the KL to the teacher)", "held-out eval"]
    plain = plot_loss_curves(runs["plain"][0] / "metrics.jsonl")
    assert len(plain.axes[0].get_lines()) == 2
    plt.close(figure)
    plt.close(plain)


def test_the_loss_plot_draws_the_cross_entropy_of_the_rows_that_have_it(tmp_path):
    """A resume may drop the teacher (or add one): the cross-entropy line takes the rows that log it, whichever
    they are."""
    import matplotlib.pyplot as plt

    from cflib.lab.report import plot_loss_curves

    distilled = [{"event": "train", "step": step, "tokens": 8, "loss": 2.0, "ce_loss": 3.0, "kl_loss": 1.0}
                 for step in (1, 2)]
    plain = [{"event": "train", "step": step, "tokens": 8, "loss": 2.5} for step in (3, 4)]
    evals = [{"event": "eval", "step": 4, "tokens": 0, "loss": 2.4}]
    for name, rows in (("dropped", distilled + plain + evals), ("added", plain + [
            {**row, "step": row["step"] + 4} for row in distilled] + evals)):
        metrics = tmp_path / f"{name}.jsonl"
        metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
        figure = plot_loss_curves(metrics)
        lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
        cross_entropy = lines["train cross-entropy (beside the KL to the teacher)"]
        assert list(cross_entropy.get_ydata()) == [3.0, 3.0]
        assert list(cross_entropy.get_xdata()) == ([1, 2] if name == "dropped" else [5, 6])
        plt.close(figure)


def test_compare_runs_overlays_a_distilled_run_s_cross_entropy_beside_plain_runs_loss(runs, tmp_path):
    """A distilled run's loss mixes in the KL: the overlay draws its cross-entropy term, which a plain run's loss
    is, and says so."""
    import matplotlib.pyplot as plt

    from cflib.lab.compare import CompareParams, compare, plot_curves

    folders = {name: runs[name][0] for name in ("plain", "distilled")}
    comparison = compare(CompareParams.from_dict({"runs": [str(folder) for folder in folders.values()],
                                                  "out_dir": str(tmp_path / "comparison")}))
    figure = plot_curves(comparison)
    by_step = figure.axes[0]
    plain_line, distilled_line = by_step.get_lines()
    assert list(plain_line.get_ydata()) == [row["loss"] for row in train_rows(folders["plain"])]
    assert list(distilled_line.get_ydata()) == [row["ce_loss"] for row in train_rows(folders["distilled"])]
    assert plain_line.get_label() == "plain" and "cross-entropy" in distilled_line.get_label()
    assert "cross-entropy" in by_step.get_ylabel()
    plt.close(figure)


def held_bytes(parameters) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in parameters)


def test_a_bf16_lora_run_counts_its_base_and_its_teacher_byte_for_byte_as_it_holds_them(shard, tmp_path):
    """The base in BF16 keeps its embeddings and norms in FP32, as the teacher does: both counted as held, the base
    once among the frozen weights and once as the teacher (init: the base itself)."""
    torch.manual_seed(5)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    settings = run_params(shard, tmp_path / "run", init_checkpoint=str(base), full_parameter=False, lora_rank=4,
                          base_dtype="bfloat16", bf16=True, teacher_checkpoint="init")
    run = prepare(TrainParams.from_dict(settings))
    frozen = [parameter for parameter in run.model.parameters() if not parameter.requires_grad]
    trainable = [parameter for parameter in run.model.parameters() if parameter.requires_grad]
    memory = run.memory_estimate
    assert memory["model_and_optimizer_bytes"] == held_bytes(frozen) + 16 * sum(p.numel() for p in trainable)
    assert memory["teacher_bytes"] == held_bytes(run.teacher.model.parameters()) == held_bytes(frozen)
    # FSDP holds and gathers the base as it is held: its embeddings in FP32, a layer's matrices in BF16
    root = held_bytes([run.model.embed_tokens.weight, run.model.norm.weight])
    layer = held_bytes(p for p in run.model.layers[0].parameters() if not p.requires_grad)
    two = batch_arithmetic(TrainParams.from_dict({**settings, "nproc_per_node": 2, "global_batch": 8}))
    fsdp = two["memory_estimate"]["per_strategy"]["fsdp"]
    state = memory["model_and_optimizer_bytes"]
    assert fsdp["state_bytes"] == round(state / 2 + root + 2 * layer) + memory["teacher_bytes"]


def test_prepare_reads_the_teacher_s_config_once_and_a_launcher_plans_from_it_alone(shard, teacher, tmp_path,
                                                                                      monkeypatch):
    """The config.json of the teacher is read and checked once; the launcher of torchrun's workers, which train,
    loads none of its weights: it plans and estimates from the config."""
    import cflib.train.teacher as teacher_module

    reads = []
    read_config = teacher_module.load_config
    monkeypatch.setattr(teacher_module, "load_config", lambda folder: reads.append(folder) or read_config(folder))
    run = prepare(TrainParams.from_dict(run_params(shard, tmp_path / "one", teacher_checkpoint=str(teacher))))
    assert reads == [teacher] and run.teacher.model is not None

    def no_weights(folder):
        raise AssertionError(f"the launcher loaded {folder}")

    monkeypatch.setattr(teacher_module, "load_checkpoint", no_weights)
    launcher = prepare(TrainParams.from_dict(run_params(shard, tmp_path / "two", teacher_checkpoint=str(teacher),
                                                        nproc_per_node=2, bf16=True)))
    assert launcher.launches_workers and launcher.teacher.model is None
    config = preset("smoke")
    assert launcher.memory_estimate["teacher_bytes"] == teacher_bytes(config, bf16=True)
    described = launcher.plan.distill["teacher"]
    assert (described["params"], described["matrices_dtype"]) == (config.num_parameters(), "bfloat16")
    assert f"teacher      {teacher}: {config.num_parameters():,} parameters" in launcher.describe()
