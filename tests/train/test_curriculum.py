"""Curricula: stages in one run folder, each from the previous best, kill and resume, DDP, the audit, bad files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cflib.data.shards import write_partition
from cflib.data.tasks import generate
from cflib.data.tokenizer import ByteTokenizer
from cflib.model import TRMoEModel, preset, save_checkpoint
from cflib.model.checkpoint import load_checkpoint
from cflib.train import train
from cflib.train.params import ParamError
from cflib.train.records import read_metrics
from cflib.train.trainer import evaluations_without_improvement

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ByteTokenizer()
STAGES = [
    {"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 3},
    {"name": "medium", "filters": {"difficulties": ["easy", "medium"]}, "max_steps": 6, "lr": 2e-3,
     "loss_task_targets": {"addition": 0.7, "uppercase": 0.3}},
    {"name": "all", "batch_size": 8, "max_steps": 3},
]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    """60 train and 8 eval examples of the embedded tasks, with their difficulty sidecar."""
    train_examples, eval_examples = generate(seed=2)
    root = tmp_path_factory.mktemp("shard")
    for partition, examples in (("train", train_examples[:60]), ("eval", eval_examples[:8])):
        write_partition(root / partition, examples, vocab_size=TOKENIZER.vocab_size,
                        eos_token_id=TOKENIZER.eos_token_id, max_seq_len=64, sidecar_fields=("difficulty",))
    return root


def write_curriculum(path: Path, stages: list[dict], **top) -> Path:
    path.write_text(yaml.safe_dump({"version": 1, **top, "stages": stages}, sort_keys=False))
    return path


def params(shard: Path, out_dir: Path, curriculum: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "curriculum": str(curriculum),
            "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 16, "lr": 3e-3, "exact_match_limit": 0,
            "device": "cpu", "eval_at_start": True, "save_every_steps": 2, **overrides}


def stage_weights(out_dir: Path, stage: str, checkpoint: str = "last") -> dict[str, torch.Tensor]:
    return load_checkpoint(out_dir / "stages" / stage / "checkpoints" / checkpoint).state_dict()


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


def test_stages_run_in_order_each_from_the_previous_best_with_a_fresh_schedule(tmp_path, shard):
    curriculum = write_curriculum(tmp_path / "c.yaml", STAGES)
    record = train(params(shard, tmp_path / "run", curriculum), progress=False)
    summary = record["curriculum"]
    assert [stage["name"] for stage in summary["stages"]] == ["easy", "medium", "all"]
    assert all((tmp_path / "run" / "stages" / name / "COMPLETE").is_file() for name in ("easy", "medium", "all"))
    assert (tmp_path / "run" / "COMPLETE").is_file()
    assert json.loads((tmp_path / "run" / "record.json").read_text())["curriculum"] == summary
    rows = [json.loads(line) for line in (shard / "train" / "loss_metadata.jsonl").read_text().splitlines()]
    easy = sum(row["difficulty"] == "easy" for row in rows)
    medium = sum(row["difficulty"] in ("easy", "medium") for row in rows)
    assert summary["stages"][0]["filters"] == {"examples": 60, "difficulties": easy, "kept": easy}
    assert summary["stages"][1]["filters"] == {"examples": 60, "difficulties": medium, "kept": medium}
    assert summary["stages"][2]["filters"] is None and summary["stages"][2]["train_examples"] == 60
    assert set(summary["stages"][1]["loss_coefficients"]) == {"addition", "uppercase"}
    for before, after in zip(summary["stages"], summary["stages"][1:]):
        assert after["started_from"] == before["selected_checkpoint"] == str(
            Path(before["out_dir"]) / "checkpoints" / "best")
        # The next stage's first evaluation is of the weights it started from: the previous stage's best.
        previous = json.loads(Path(before["record"]).read_text())
        best_loss = min(e["loss"] for e in previous["eval"]["history"] if e["step"] > 0)
        start = json.loads(Path(after["record"]).read_text())["eval"]["at_start"]
        assert start["loss"] == pytest.approx(best_loss, abs=1e-6)
    # A fresh optimizer and schedule: every stage warms up from its own first step, at its own lr.
    medium_rows = [r for r in read_metrics(tmp_path / "run" / "stages" / "medium" / "metrics.jsonl")
                   if r["event"] == "train"]
    assert medium_rows[0]["step"] == 1 and medium_rows[0]["lr"] == pytest.approx(2e-3)  # warm-up of one step
    assert [s["steps"] for s in summary["stages"]] == [3, 6, 3]
    assert json.loads((tmp_path / "run" / "stages" / "all" / "params.json").read_text())["global_batch"] == 8
    # The plot's legend tells the weighted stage's train loss (its weighted mean) from the others'.
    from cflib.lab.curricula import plot_stage_curves
    legend = [text.get_text() for text in plot_stage_curves(summary).axes[0].get_legend().get_texts()]
    assert legend == ["easy (train)", "easy (held-out)", "medium (train, weighted)", "medium (held-out)",
                      "all (train)", "all (held-out)"]


def test_through_stage_stops_after_the_named_stage(tmp_path, shard):
    curriculum = write_curriculum(tmp_path / "c.yaml", STAGES)
    record = train(params(shard, tmp_path / "run", curriculum, through_stage="easy"), progress=False)
    assert [s["name"] for s in record["curriculum"]["stages"]] == ["easy"]
    assert record["curriculum"]["skipped"] == ["medium", "all"]
    assert not (tmp_path / "run" / "stages" / "medium").exists()
    # Not complete: the run continues with resume: latest, its first stage kept as it trained.
    assert not (tmp_path / "run" / "COMPLETE").exists()
    easy = (tmp_path / "run" / "stages" / "easy" / "metrics.jsonl").read_bytes()
    record = train(params(shard, tmp_path / "run", curriculum, resume="latest"), progress=False)
    assert [s["name"] for s in record["curriculum"]["stages"]] == ["easy", "medium", "all"]
    assert (tmp_path / "run" / "COMPLETE").is_file()
    assert (tmp_path / "run" / "stages" / "easy" / "metrics.jsonl").read_bytes() == easy


def test_a_stage_that_did_not_start_may_be_corrected_and_the_run_continued(tmp_path, shard, monkeypatch):
    """A stage that failed its checks as it started (a kernel the machine cannot run, say) never trained: the
    corrected curriculum continues the run; a stage that trained may not change."""
    from cflib.train import curriculum_run

    stages = [{"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 2},
              {"name": "all", "max_steps": 2, "lr": 0.5}]
    real_prepare = curriculum_run.prepare

    def refusing(stage_params):  # what a stage's own checks refuse as it starts
        if stage_params.lr == 0.5:
            raise ParamError("lr 0.5: refused as the stage starts")
        return real_prepare(stage_params)

    monkeypatch.setattr(curriculum_run, "prepare", refusing)
    failing = write_curriculum(tmp_path / "failing.yaml", stages)
    with pytest.raises(ParamError, match="refused as the stage starts"):
        train(params(shard, tmp_path / "run", failing), progress=False)
    assert (tmp_path / "run" / "stages" / "easy" / "COMPLETE").is_file()
    assert not (tmp_path / "run" / "stages" / "all").exists()
    corrected = write_curriculum(tmp_path / "corrected.yaml", [stages[0], {"name": "all", "max_steps": 2}])
    record = train(params(shard, tmp_path / "run", corrected, resume="latest"), progress=False)
    assert [s["name"] for s in record["curriculum"]["stages"]] == ["easy", "all"]
    written = json.loads((tmp_path / "run" / "curriculum.json").read_text())
    assert written["stages"][1]["overrides"] == {"max_steps": 2} and "changed_utc" in written
    (tmp_path / "run" / "COMPLETE").unlink()
    edited = write_curriculum(tmp_path / "edited.yaml", [{**stages[0], "max_steps": 3}, {"name": "all", "max_steps": 2}])
    with pytest.raises(ParamError, match="stage 'easy' of .* differs from the stage this run trained"):
        train(params(shard, tmp_path / "run", edited, resume="latest"), progress=False)


def test_a_run_wide_change_reaching_a_stage_that_trained_is_refused_unless_allowed(tmp_path, shard):
    """A stage that sets no lr takes the run's: changing the run's on resume changes what that stage trained with,
    which one run's resume refuses, and so does a curriculum's (the stream and schedule even when allowed)."""
    stages = [{"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 2},
              {"name": "all", "max_steps": 2}]
    curriculum = write_curriculum(tmp_path / "c.yaml", stages)
    train(params(shard, tmp_path / "run", curriculum, through_stage="easy"), progress=False)
    written = json.loads((tmp_path / "run" / "curriculum.json").read_text())
    assert written["stages"][0]["settings"]["lr"] == 3e-3
    with pytest.raises(ParamError, match=r"stage 'easy' trained with lr 0.003, this run gives it 0.001 .*"
                                         "allow_resume_changes: lr"):
        train(params(shard, tmp_path / "run", curriculum, resume="latest", lr=1e-3), progress=False)
    with pytest.raises(ParamError, match="stage 'easy' trained with seed 0, this run gives it 1 .*stream and schedule"):
        train(params(shard, tmp_path / "run", curriculum, resume="latest", seed=1, allow_resume_changes="seed,lr"),
              progress=False)
    assert not (tmp_path / "run" / "stages" / "all").exists()
    record = train(params(shard, tmp_path / "run", curriculum, resume="latest", lr=1e-3, allow_resume_changes="lr"),
                   progress=False)
    assert record["params"]["lr"] == 1e-3  # the stage not started yet trains with the run's new lr
    written = json.loads((tmp_path / "run" / "curriculum.json").read_text())
    assert [stage["settings"]["lr"] for stage in written["stages"]] == [3e-3, 1e-3] and "changed_utc" in written


def test_stages_set_their_own_schedules_which_a_stage_that_trained_keeps(tmp_path, shard):
    """A stage's fresh schedule need not fall to zero: a floor (min_lr_ratio), or a decay over its last steps alone
    (wsd), set like any training parameter, audited, recorded, and held to once the stage trained."""
    stages = [{"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 2, "min_lr_ratio": 0.1},
              {"name": "all", "max_steps": 4, "lr_schedule": "wsd", "lr_decay_ratio": 0.5}]
    curriculum = write_curriculum(tmp_path / "c.yaml", stages)
    dry = train(params(shard, tmp_path / "dry", curriculum, dry_run=True), progress=False)
    assert [(row["lr_schedule"], row["min_lr_ratio"], row["decay_steps"]) for row in dry["stages"]] == [
        ("cosine", 0.1, 1), ("wsd", 0.0, 2)]
    train(params(shard, tmp_path / "run", curriculum, through_stage="easy"), progress=False)
    written = json.loads((tmp_path / "run" / "curriculum.json").read_text())
    assert [(stage["settings"]["lr_schedule"], stage["settings"]["min_lr_ratio"]) for stage in written["stages"]] \
        == [("cosine", 0.1)]
    easy = json.loads((tmp_path / "run" / "stages" / "easy" / "record.json").read_text())
    assert easy["schedule"]["lr_schedule"] == "cosine" and easy["schedule"]["min_lr_ratio"] == 0.1
    with pytest.raises(ParamError, match="stage 'easy' trained with lr_schedule cosine, this run gives it linear "
                                         ".*stream and schedule"):
        train(params(shard, tmp_path / "run", curriculum, resume="latest", lr_schedule="linear"), progress=False)


def test_a_stage_killed_before_its_first_resumable_checkpoint_may_be_corrected(tmp_path, shard):
    """It starts again from scratch (its folder set aside), as a stage never started: a smaller batch after an
    out-of-memory error, say, goes through."""
    stages = [{"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 2}]
    curriculum = write_curriculum(tmp_path / "c.yaml", stages)
    train(params(shard, tmp_path / "run", curriculum, save_every_steps=None), progress=False)
    stage_dir = tmp_path / "run" / "stages" / "easy"
    for name in ("COMPLETE", "record.json"):  # as a kill before its first resumable checkpoint leaves it
        (stage_dir / name).unlink()
    (tmp_path / "run" / "COMPLETE").unlink()
    (tmp_path / "run" / "record.json").unlink()
    record = train(params(shard, tmp_path / "run", curriculum, resume="latest", global_batch=8), progress=False)
    assert record["params"]["global_batch"] == 8 and (tmp_path / "run" / "stages" / "easy.set-aside-1").is_dir()


def start_and_kill(run_params: dict, watched: Path) -> None:
    """Train in a child process and SIGKILL it once `watched` (a checkpoint folder) exists."""
    code = "import json, sys; from cflib.train import train; train(json.loads(sys.argv[1]), progress=False)"
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(run_params)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while not watched.is_dir():
        assert child.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


@pytest.mark.slow
def test_a_curriculum_killed_in_stage_two_resumes_to_the_uninterrupted_weights(tmp_path, shard):
    curriculum = write_curriculum(tmp_path / "c.yaml", STAGES)
    reference = train(params(shard, tmp_path / "whole", curriculum), progress=False)
    killed = tmp_path / "killed"
    start_and_kill(params(shard, killed, curriculum), killed / "stages" / "medium" / "checkpoints" / "step-2")
    assert not (killed / "stages" / "medium" / "COMPLETE").exists(), "killed too late: stage 2 had finished"
    easy_record = (killed / "stages" / "easy" / "record.json").read_text()
    with pytest.raises(ParamError, match="already holds a curriculum run.*resume: latest"):
        train(params(shard, killed, curriculum), progress=False)
    resumed = train(params(shard, killed, curriculum, resume="latest"), progress=False)
    assert (killed / "stages" / "easy" / "record.json").read_text() == easy_record  # finished: not re-run
    medium = json.loads((killed / "stages" / "medium" / "record.json").read_text())
    assert medium["model_source"].startswith("resumed from") and medium["schedule"]["steps_done"] == 6
    for stage, checkpoint in (("medium", "epoch-2"), ("medium", "best"), ("all", "best"), ("all", "last")):
        assert_same_weights(stage_weights(tmp_path / "whole", stage, checkpoint),
                            stage_weights(killed, stage, checkpoint), atol=1e-6)
    assert resumed["eval"]["final"]["loss"] == pytest.approx(reference["eval"]["final"]["loss"], abs=1e-6)
    with pytest.raises(ParamError, match="completed run: nothing to resume"):
        train(params(shard, killed, curriculum, resume="latest"), progress=False)


def train_losses(out_dir: Path, stage: str) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir / "stages" / stage / "metrics.jsonl") if r["event"] == "train"]


@pytest.mark.slow
def test_a_two_process_curriculum_trains_like_one_process(tmp_path, shard):
    """Two stages, each a torchrun launch; the second from the first's best, on another filter, learning rate,
    loss weighting and global batch."""
    stages = [STAGES[0], {**STAGES[1], "max_steps": 3, "batch_size": 8}]
    curriculum = write_curriculum(tmp_path / "c.yaml", stages)
    single = train(params(shard, tmp_path / "one", curriculum), progress=False)
    double = train(params(shard, tmp_path / "two", curriculum, nproc_per_node=2, strategy="ddp"), progress=False)
    assert single["world_size"] == 1 and double["world_size"] == 2
    # The second stage starts from weights that already differ by reduction order (see below): a looser bound.
    for stage, atol in (("easy", 1e-5), ("medium", 1e-4)):
        np.testing.assert_allclose(train_losses(tmp_path / "two", stage), train_losses(tmp_path / "one", stage),
                                   rtol=0, atol=atol)
    assert_same_weights(stage_weights(tmp_path / "one", "easy", "best"),
                        stage_weights(tmp_path / "two", "easy", "best"), atol=1e-5)
    # AdamW's normalised steps carry the difference on: it stays a tiny fraction of how far the stage moves.
    start, one, two = (stage_weights(tmp_path / run, name, "best")
                       for run, name in (("one", "easy"), ("one", "medium"), ("two", "medium")))
    apart = torch.sqrt(sum(((one[k] - two[k]) ** 2).sum() for k in one))
    moved = torch.sqrt(sum(((one[k] - start[k]) ** 2).sum() for k in one))
    assert apart < 1e-2 * moved, (float(apart), float(moved))
    assert [s["started_from"].replace("/two/", "/one/") for s in double["curriculum"]["stages"][1:]] == [
        s["started_from"] for s in single["curriculum"]["stages"][1:]]
    assert [s["name"] for s in double["curriculum"]["stages"]] == ["easy", "medium"]


def test_the_dry_run_of_the_quickstart_curriculum_writes_its_audit_alone(tmp_path, capsys):
    quickstart = yaml.safe_load((ROOT / "params" / "curriculum_quickstart.yaml").read_text())
    out_dir = tmp_path / "dry"
    record = train({**quickstart, "out_dir": str(out_dir), "device": "cpu", "dry_run": True}, progress=False)
    assert sorted(path.name for path in out_dir.iterdir()) == ["dry_run.json"]
    assert json.loads((out_dir / "dry_run.json").read_text()) == record
    rows = {row["stage"]: row for row in record["stages"]}
    assert list(rows) == ["easy", "medium", "all"]
    assert all(row["passed"] and row["weights_within_cap"] and row["overweight_tasks"] == [] for row in rows.values())
    assert rows["easy"]["shares_match_targets"] is None and rows["all"]["shares_match_targets"] is True
    assert rows["easy"]["examples"] == {"examples": 22_000, "difficulties": 10_295, "kept": 10_295}
    assert rows["all"]["total_steps"] == 200 and rows["all"]["grad_accum"] == 1
    coefficients = {cell["cell"]: cell["coefficient"] for cell in rows["all"]["loss_weighting"]}
    raw = {cell["cell"]: cell["raw_share"] for cell in rows["all"]["loss_weighting"]}
    assert coefficients["addition"] == pytest.approx(0.8 / raw["addition"])
    table = capsys.readouterr().out
    assert "| easy | yes | 10,295 of 22,000 |" in table and "stage all: loss weighting" in table


BAD = [
    ({"stages": [{"name": "a", "lrr": 1e-3}]}, r"stage 'a': unknown parameter 'lrr' \(did you mean 'lr'\?\)"),
    ({"stages": [{"name": "a"}, {"name": "a"}]}, "stage 'a': the name is used by an earlier stage"),
    ({"stages": [{"name": "a", "out_dir": "x"}]}, "stage 'a': 'out_dir' is the run's"),
    ({"stages": [{"name": "a", "loss_task_targets": {"addition": 0.5, "uppercase": 0.4}}]},
     "stage 'a': loss_task_targets sum to 0.9, not 1"),
    ({"stages": [{"name": "a", "filters": {"difficulties": ["impossible"]}}]},
     "stage 'a': filters: difficulties keeps no train example"),
    ({"stages": [{"name": "a", "filters": {"difficulty": ["easy"]}}]}, "stage 'a': .*unknown filter 'difficulty'"),
    ({"stages": [{"name": "a"}, {"name": "b", "loss_task_targets": {"addition": 0.01, "uppercase": 0.99},
                                 "max_task_loss_weight": 1.5}]},
     r"stage 'b': loss_groups: cell\(s\) \['uppercase'\] would get a loss coefficient above max_task_loss_weight 1.5"),
    ({"stages": [{"name": "a", "seq_len": 8}]}, "stage 'a': .*exceed seq_len 8"),
    ({"stages": [{"name": "a", "lr": -1}]}, "stage 'a': lr must be positive"),
    ({"version": 2, "stages": [{"name": "a"}]}, "version must be 1"),
    ({"stages": [{"name": "a"}, {"name": "easy\n"}]}, r"stage 2 needs a name .* got 'easy\\n'"),
    ({"stages": [{"name": "a"}, {"name": "x" * 101}]}, "stage 2 needs a name of 1 to 100 letters"),
    ({"stages": [{"name": "a"}], "stagse": []}, r"unknown parameter 'stagse' \(did you mean 'stages'\?\)"),
]


@pytest.mark.parametrize("document, message", BAD, ids=[message.split(":")[0][:30] for _, message in BAD])
def test_a_bad_curriculum_fails_before_anything_is_written_naming_stage_and_key(tmp_path, shard, document,
                                                                               message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"version": 1, **document}))
    with pytest.raises(ParamError, match=message):
        train(params(shard, tmp_path / "run", path), progress=False)
    assert not (tmp_path / "run").exists()


# Nine aliases of nine aliases (9**8 stages once expanded) in a few hundred bytes, a nesting past any stack, a folder.
LAUGHS = "version: 1\nl0: &l0 [{name: a}, {name: a}, {name: a}, {name: a}, {name: a}, {name: a}, {name: a}]\n" + "".join(
    f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 8)) + "stages: *l7\n"


@pytest.mark.parametrize("document, message", [
    (LAUGHS, "stands for more than 100,000 values once its aliases"),
    ("version: 1\nstages: " + "[" * 50_000 + "]" * 50_000 + "\n", "YAML nested deeper than 64 levels"),
    (None, "a folder, not a curriculum file"),
], ids=["billion-laughs", "nested-deep", "a-folder"])
def test_a_hostile_curriculum_file_is_refused_at_once_naming_it(tmp_path, shard, document, message):
    path = tmp_path / "c.yaml"
    path.mkdir() if document is None else path.write_text(document)
    start = time.monotonic()
    with pytest.raises(ParamError) as caught:
        train(params(shard, tmp_path / "run", path), progress=False)
    assert time.monotonic() - start < 10, "the file was expanded or walked"  # a generous bound: no hang
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    assert len(str(caught.value)) < 400 and not (tmp_path / "run").exists()


def test_through_stage_must_name_a_stage(tmp_path, shard):
    curriculum = write_curriculum(tmp_path / "c.yaml", STAGES)
    with pytest.raises(ParamError, match="through_stage 'hard' names no stage .*: easy, medium, all"):
        train(params(shard, tmp_path / "run", curriculum, through_stage="hard"), progress=False)


@pytest.mark.slow
def test_a_sidecar_whose_ids_differ_fails_the_curriculum_naming_the_stage(tmp_path, shard):
    copy = tmp_path / "shard"
    subprocess.run(["cp", "-r", str(shard), str(copy)], check=True)
    sidecar = copy / "train" / "loss_metadata.jsonl"
    sidecar.write_text("\n".join(sidecar.read_text().splitlines()[1:]) + "\n")
    curriculum = write_curriculum(tmp_path / "c.yaml", STAGES)
    with pytest.raises(ParamError, match="stage 'easy': .*loss_metadata.jsonl: its example_id set must equal"):
        train(params(copy, tmp_path / "run", curriculum), progress=False)


def test_early_stopping_counts_evaluations_as_transformers_does():
    evals = [{"step": 0, "loss": 9.0}, {"step": 2, "loss": 5.0}, {"step": 4, "loss": 5.5}, {"step": 6, "loss": 4.0},
             {"step": 8, "loss": 4.0}, {"step": 10, "loss": 4.2}]
    assert [evaluations_without_improvement(evals[:n]) for n in range(1, 7)] == [0, 0, 1, 0, 1, 2]


def test_a_run_stops_after_patience_evaluations_without_improvement(tmp_path, shard):
    record = train({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path / "run"), "device": "cpu",
                    "micro_batch_per_rank": 4, "global_batch": 4, "max_steps": 40, "lr": 0.3, "warmup_ratio": 0.0,
                    "max_grad_norm": None, "eval_every_steps": 1, "exact_match_limit": 0,
                    "early_stopping_patience": 2}, progress=False)
    stopped = record["early_stopping"]["stopped_at_step"]
    assert stopped is not None and stopped < 40 and record["schedule"]["steps_done"] == stopped
    evals = [e for e in record["eval"]["history"] if e["step"] > 0]
    assert evaluations_without_improvement(evals) == 2
    assert all(e["loss"] >= min(x["loss"] for x in evals[:-2]) for e in evals[-2:])


def test_expert_and_lora_multipliers_make_named_groups_in_the_record(tmp_path, shard):
    record = train({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path / "run"), "device": "cpu",
                    "micro_batch_per_rank": 4, "global_batch": 8, "max_steps": 2, "exact_match_limit": 0,
                    "lr": 2e-3, "expert_lr_multiplier": 0.25}, progress=False)
    groups = {group["name"]: group for group in record["optimizer_groups"]}
    assert set(groups) == {"decay", "no_decay", "decay+experts"}
    assert groups["decay+experts"]["lr"] == pytest.approx(5e-4) and groups["decay"]["lr"] == pytest.approx(2e-3)
    assert groups["decay+experts"]["tensors"] == 6  # expert_gate, expert_up, expert_down of two layers
    with pytest.raises(ParamError, match="expert_lr_multiplier must be positive"):
        train({"model": "smoke", "device": "cpu", "expert_lr_multiplier": 0}, progress=False)


def test_the_dry_run_of_one_run_audits_it_as_a_stage(tmp_path, shard):
    record = train({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path / "dry"), "device": "cpu",
                    "dry_run": True, "filters": {"tasks": ["uppercase"]}, "max_steps": None,
                    "micro_batch_per_rank": 4, "global_batch": 8}, progress=False)
    (row,) = record["stages"]
    uppercase = sum(row["task"] == "uppercase" for row in
                    (json.loads(line) for line in (shard / "train" / "examples.jsonl").read_text().splitlines()))
    assert row["stage"] == "run" and row["passed"] and row["examples"]["kept"] == uppercase
    assert row["steps_per_epoch"] == -(-uppercase // 8) and row["grad_accum"] == 2
    assert sorted(path.name for path in (tmp_path / "dry").iterdir()) == ["dry_run.json"]


def test_a_lora_curriculum_trains_one_set_of_adapters_through_its_stages(tmp_path, shard):
    """Stage 2 of a LoRA curriculum starts from stage 1's best adapters on the same frozen base."""
    torch.manual_seed(5)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    curriculum = write_curriculum(tmp_path / "c.yaml", [
        {"name": "easy", "filters": {"difficulties": ["easy"]}, "max_steps": 3},
        {"name": "all", "max_steps": 3}])
    record = train({**params(shard, tmp_path / "run", curriculum), "init_checkpoint": str(base),
                    "full_parameter": False, "lora_rank": 4, "lr": 1e-2}, progress=False)
    first, second = record["curriculum"]["stages"]
    assert second["started_from"] == first["selected_checkpoint"]
    previous = json.loads(Path(first["record"]).read_text())
    best_loss = min(e["loss"] for e in previous["eval"]["history"] if e["step"] > 0)
    start = json.loads(Path(second["record"]).read_text())["eval"]["at_start"]
    assert start["loss"] == pytest.approx(best_loss, abs=1e-6)  # the adapters carried over, not fresh ones
    saved = json.loads((tmp_path / "run" / "stages" / "all" / "checkpoints" / "best" / "adapter_config.json")
                       .read_text())
    assert Path(saved["base_model_name_or_path"]).resolve() == base.resolve()


def test_a_later_stage_of_a_lora_curriculum_setting_other_adapters_is_refused_before_any_stage_trains(tmp_path, shard):
    """It would start from the adapters the stage before saved, which it could not load: refused at once, not
    after the earlier stages trained."""
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    curriculum = write_curriculum(tmp_path / "c.yaml", [{"name": "easy", "max_steps": 2},
                                                        {"name": "mid", "max_steps": 2, "lora_rank": 16}])
    with pytest.raises(ParamError, match="stage 'mid': lora_rank 16 differs from the first stage's 4"):
        train({**params(shard, tmp_path / "run", curriculum), "init_checkpoint": str(base), "full_parameter": False,
               "lora_rank": 4}, progress=False)
    assert not (tmp_path / "run").exists()


def test_each_stage_freezes_its_own_modules(tmp_path, shard):
    """A stage is a run of its own, with its own optimizer: the first trains all but the experts, the second all but
    the embeddings (and the tied head), from the first's best."""
    stages = [{"name": "no-experts", "max_steps": 2, "frozen_modules": ["experts"]},
              {"name": "no-embeddings", "max_steps": 2, "frozen_modules": "embeddings"}]
    record = train(params(shard, tmp_path / "run", write_curriculum(tmp_path / "c.yaml", stages),
                          eval_at_start=False, save_every_steps=None), progress=False)
    torch.manual_seed(0)
    start = TRMoEModel(preset("smoke")).state_dict()
    first, handed = stage_weights(tmp_path / "run", "no-experts"), stage_weights(tmp_path / "run", "no-experts", "best")
    second = stage_weights(tmp_path / "run", "no-embeddings")
    experts = {name for name in start if ".expert_" in name}
    assert {name for name in experts if torch.equal(first[name], start[name])} == experts
    assert not torch.equal(first["embed_tokens.weight"], start["embed_tokens.weight"])
    assert torch.equal(second["embed_tokens.weight"], handed["embed_tokens.weight"])
    assert not any(torch.equal(second[name], handed[name]) for name in experts)
    frozen = [json.loads(Path(stage["record"]).read_text())["execution_plan"]["frozen"]["modules"]
              for stage in record["curriculum"]["stages"]]
    assert frozen == [["experts"], ["embeddings"]]
