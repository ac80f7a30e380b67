"""best_metric chooses best/ (and what early stopping watches); register_metric adds a metric over generated
answers; eval_tasks_every scores lm-eval tasks on every epoch's (or every N steps') checkpoint, a LoRA run's merged
into its base first; log_samples writes prompts and answers at each evaluation. Tiny runs on CPU."""
from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_shard_helpers import write_shard

from cflib.data.tasks import generate
from cflib.model.checkpoint import load_checkpoint, save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.train import task_scores, train
from cflib.train.adapters import resumed_model
from cflib.train.best_metric import (ANSWER_METRICS, BestMetric, contains_metric, evaluations_without_improvement,
                                     regex_metric, register_metric)
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics
from cflib.train.run_folder import RUN_ENTRIES

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed (the eval extra)")

FAST = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 24, "device": "cpu", "epochs": 3, "max_steps": None}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    """40 train / 24 eval embedded examples (12 addition, 12 uppercase): three steps an epoch."""
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:40], eval_examples[:12] + eval_examples[-12:],
                       max_seq_len=64)


def run(tmp_path: Path, shard: Path, **overrides) -> dict:
    return train({**FAST, "data": str(shard), "out_dir": str(tmp_path / "run"), **overrides}, progress=False)


def weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint, "cpu").state_dict()


def same_weights(a: str, b: str) -> bool:
    first, second = weights(a), weights(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


class ScheduledScore:
    """A metric whose value is fixed per evaluation (the held-out prompts are scored one evaluation after the
    other): the best evaluation is known before the run, whatever the losses do."""

    def __init__(self, per_evaluation: list[float], prompts: int) -> None:
        self.per_evaluation, self.prompts, self.calls = per_evaluation, prompts, 0

    def __call__(self, answer: str, reference: str) -> float:
        value = self.per_evaluation[self.calls // self.prompts]
        self.calls += 1
        return value


@pytest.fixture
def scheduled():
    score = ScheduledScore([0.0, 0.25, 1.0, 0.5], prompts=24)  # start, epoch-1, epoch-2, epoch-3
    register_metric("scheduled", score)
    yield score
    ANSWER_METRICS.pop("scheduled")


def test_best_follows_a_registered_metric_where_the_lowest_loss_is_elsewhere(tmp_path, shard, scheduled):
    record = run(tmp_path, shard, best_metric="scheduled")
    epochs = {e["tag"]: e for e in record["eval"]["history"]}
    assert [epochs[f"epoch-{n}"]["metrics"]["scheduled"] for n in (1, 2, 3)] == [0.25, 1.0, 0.5]
    lowest_loss = min((e for e in record["eval"]["history"] if e["step"] > 0), key=lambda e: e["loss"])
    assert lowest_loss["tag"] != "epoch-2"  # the two choices differ: the test can tell them apart
    checkpoints = record["checkpoints"]
    assert checkpoints["best_step"] == str(epochs["epoch-2"]["step"])
    assert same_weights(checkpoints["best"], checkpoints["epoch-2"])
    assert not same_weights(checkpoints["best"], checkpoints[lowest_loss["tag"]])
    assert record["best_metric"] == {"name": "scheduled", "greater_is_better": True, "value": 1.0,
                                     "step": epochs["epoch-2"]["step"]}


def test_greater_is_better_can_be_overridden(tmp_path, shard, scheduled):
    record = run(tmp_path, shard, best_metric="scheduled", greater_is_better=False)
    epochs = {e["tag"]: e for e in record["eval"]["history"]}
    assert record["checkpoints"]["best_step"] == str(epochs["epoch-1"]["step"])  # 0.25, the lowest after step 0


def test_best_is_the_checkpoint_with_the_highest_addition_exact_match(tmp_path, shard):
    record = run(tmp_path, shard, best_metric="exact_match/addition", lr=1e-2, log_samples=3,
                 report_to="tensorboard")
    trained = [e for e in record["eval"]["history"] if e["step"] > 0]
    best = max(trained, key=lambda e: e["exact_match"]["addition"])  # the first of equals, as the run keeps it
    assert record["checkpoints"]["best_step"] == str(best["step"])
    assert record["best_metric"]["value"] == best["exact_match"]["addition"]
    out = tmp_path / "run"
    # log_samples: every evaluation's first 3 prompts with their greedy answers, as text
    files = sorted((out / "samples").glob("*.jsonl"))
    assert [f.name for f in files] == [f"step-{e['step']:06d}-{e['tag']}.jsonl" for e in record["eval"]["history"]]
    rows = [json.loads(line) for line in files[-1].read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["prompt"].endswith("=") and rows[0]["task"] == "addition"
    assert all(row["hit"] == (row["answer"] == row["reference"]) for row in rows)
    assert rows[0]["reference"] == json.loads((Path(str(shard)) / "eval" / "examples.jsonl").read_text()
                                              .splitlines()[0])["answer"]
    evals = [row for row in read_metrics(out / "metrics.jsonl") if row["event"] == "eval"]
    assert [row["samples_file"] for row in evals] == [f"samples/{f.name}" for f in files]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("eval/samples/text_summary")
    assert [t.step for t in texts] == [e["step"] for e in record["eval"]["history"]]
    assert rows[0]["prompt"] in texts[-1].tensor_proto.string_val[0].decode()


def test_early_stopping_watches_best_metric():
    evals = [{"step": 0, "loss": 3.0, "exact_match": {"overall": 0.0}},
             {"step": 1, "loss": 2.0, "exact_match": {"overall": 0.5}},
             {"step": 2, "loss": 1.0, "exact_match": {"overall": 0.4}},
             {"step": 3, "loss": 0.5, "exact_match": {"overall": 0.3}},
             {"step": 4, "loss": 0.4}]  # a periodic evaluation without exact match: passed over
    assert evaluations_without_improvement(evals) == 0
    assert evaluations_without_improvement(evals, BestMetric("exact_match", True)) == 2


def test_answer_metrics_read_text():
    assert regex_metric(r"-?\d+")("the sum is 1090.", "1090") == 1.0
    assert regex_metric(r"-?\d+")("the sum is 1091.", "1090") == 0.0
    assert contains_metric("HELLO there", "HELLO") == 1.0 and contains_metric("HELL", "HELLO") == 0.0


@pytest.mark.parametrize("raw, message", [
    ({"best_metric": "accuracy"}, "best_metric 'accuracy': expected eval_loss, exact_match"),
    ({"best_metric": "lm_eval/embedded_exact"}, "lm_eval/<task>/<metric>"),
    ({"best_metric": "lm_eval/piqa/acc", "eval_tasks": "embedded_exact", "eval_tasks_every": "epoch"},
     "task 'piqa' is not among eval_tasks"),
    ({"best_metric": "lm_eval/embedded_exact/exact_match", "eval_tasks": "embedded_exact"},
     "set eval_tasks_every"),
    ({"eval_tasks_every": "epoch"}, "eval_tasks names no task"),
    ({"eval_tasks_every": "0", "eval_tasks": "embedded_exact"}, "eval_tasks_every must be None, epoch or a positive"),
    ({"eval_tasks_every": "epoch", "eval_tasks": "embedded_exact", "save_checkpoints": False}, "save_checkpoints"),
    ({"best_metric": "exact_match", "exact_match_limit": 0}, "exact_match_limit is 0"),
    ({"log_samples": -1}, "log_samples must be >= 0"),
])
def test_bad_choices_are_refused_naming_the_parameter(raw, message):
    with pytest.raises(ParamError, match=message.replace("(", r"\(").replace("[", r"\[")):
        TrainParams.from_dict(raw)


def test_register_metric_refuses_reserved_names():
    with pytest.raises(ValueError, match="eval_loss, exact_match or lm_eval"):
        register_metric("exact_match", contains_metric)


@pytest.mark.parametrize("task, limit", [("nosuchtask", None), ("uppercase", 1)], ids=["no-such-task", "past-the-limit"])
def test_a_best_metric_task_exact_match_never_decodes_stops_the_run_before_step_1(tmp_path, shard, task, limit):
    """Else the run would train to its end with no best/ (and a curriculum hand over its newest checkpoint)."""
    with pytest.raises(ParamError, match=rf"best_metric 'exact_match/{task}': exact match decodes no example"):
        run(tmp_path, shard, best_metric=f"exact_match/{task}", exact_match_limit=limit)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # lm-eval's task registry and scoring
@needs_lm_eval
def test_lm_eval_scores_every_epoch_checkpoint_and_choose_best(tmp_path, shard):
    record = run(tmp_path, shard, epochs=2, eval_tasks="embedded_exact", eval_tasks_every="epoch",
                 eval_tasks_limit=4, best_metric="lm_eval/embedded_exact/exact_match", report_to="tensorboard",
                 log_samples=1)
    out = tmp_path / "run"
    # Every entry the run wrote is one a run checks for a link out of its folder before it starts.
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} <= set(RUN_ENTRIES)
    scored = [e for e in record["eval"]["history"] if "lm_eval" in e]
    assert [e["tag"] for e in scored] == ["epoch-1", "epoch-2"]
    for e in scored:
        assert 0.0 <= e["lm_eval"]["embedded_exact"]["exact_match"] <= 1.0
        results = json.loads((out / "eval_tasks" / e["tag"] / "lm_eval_results.json").read_text())
        assert results["results"]["embedded_exact"]["exact_match,none"] == e["lm_eval"]["embedded_exact"]["exact_match"]
        assert not (out / "eval_tasks" / e["tag"] / "bundle").exists()  # scored, then removed
    best = max(scored, key=lambda e: e["lm_eval"]["embedded_exact"]["exact_match"])
    assert record["checkpoints"]["best_step"] == str(best["step"])
    rows = [row for row in read_metrics(out / "metrics.jsonl") if row["event"] == "eval" and "lm_eval" in row]
    assert [row["step"] for row in rows] == [e["step"] for e in scored]
    # lm-eval's time counts as evaluation, never in the steady state's steps
    assert record["timing"]["eval_s"] >= sum(e["lm_eval_seconds"] for e in scored)
    assert record["throughput"]["timed_steps"] == record["schedule"]["steps_done"] - record["timing_protocol"][
        "warmup_steps_excluded"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [s.step for s in events.Scalars("lm_eval/embedded_exact/exact_match")] == [e["step"] for e in scored]


@pytest.mark.slow  # lm-eval's task registry and scoring
@needs_lm_eval
def test_unknown_eval_tasks_stop_the_run_before_step_1(tmp_path, shard):
    with pytest.raises(ParamError, match="eval_tasks: 'no_such_task'"):
        run(tmp_path, shard, eval_tasks="no_such_task", eval_tasks_every="epoch")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # lm-eval's task registry and scoring
@needs_lm_eval
def test_a_lora_run_scores_its_merged_step_checkpoints_and_chooses_best_by_lm_eval(tmp_path, shard, monkeypatch):
    """eval_tasks_every: 2 on a LoRA run of 4 steps: the step-2 checkpoint and the last one (adapters) are merged
    into their base and scored through the merged model's bundle, which gives the adapted model's logits; best/
    holds the adapters of the evaluation with the highest lm-eval accuracy."""
    torch.manual_seed(3)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    bundles: dict[str, dict] = {}  # checkpoint -> the bundle lm-eval is handed: its files, config and logits on ids
    export_hub = task_scores.export_hub

    def export_and_look(model, target, **kwargs):  # the real export, its bundle looked at before lm-eval loads it
        bundle = export_hub(model, target, **kwargs)
        loaded = load_checkpoint(bundle, "cpu").eval()
        with torch.no_grad():
            logits = loaded(ids) @ loaded.head_weight.t()
        bundles[Path(target).parent.name] = {"files": sorted(p.name for p in bundle.iterdir()), "logits": logits,
                                             "config": json.loads((bundle / "config.json").read_text())}
        return bundle

    monkeypatch.setattr(task_scores, "export_hub", export_and_look)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    params = {**{k: v for k, v in FAST.items() if k != "model"}, "data": str(shard), "out_dir": str(tmp_path / "run"),
              "init_checkpoint": str(base), "full_parameter": False, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2,
              "max_steps": 4, "exact_match_limit": 0, "eval_tasks": "embedded_choice", "eval_tasks_every": 2,
              "eval_tasks_limit": 4, "best_metric": "lm_eval/embedded_choice/acc"}
    record = train(params, progress=False)
    out = tmp_path / "run"

    scored = [e for e in record["eval"]["history"] if "lm_eval" in e]
    assert [(e["tag"], e["step"]) for e in scored] == [("periodic", 2), ("end", 4)]
    names = {2: "step-2", 4: "last"}  # the checkpoint each scored evaluation wrote
    assert sorted(p.name for p in (out / "eval_tasks").iterdir()) == sorted(names.values())
    settings = TrainParams.from_dict(params).lora_settings()
    plain = load_checkpoint(base, "cpu").eval()
    for e in scored:
        name = names[e["step"]]
        folder = out / "eval_tasks" / name
        assert [p.name for p in folder.iterdir()] == ["lm_eval_results.json"]  # merged model and bundle removed
        results = json.loads((folder / "lm_eval_results.json").read_text())
        assert results["results"]["embedded_choice"]["acc,none"] == e["lm_eval"]["embedded_choice"]["acc"]
        assert results["n-samples"]["embedded_choice"]["effective"] == 4
        # what lm-eval scored is a plain model, the adapters merged in: the adapted model's logits
        bundle = bundles[name]
        assert not any("adapter" in f for f in bundle["files"]) and "lora" not in json.dumps(bundle["config"]).lower()
        adapted, _ = resumed_model(out / "checkpoints" / name, settings, str(base))
        with torch.no_grad():
            expected = adapted.eval()(ids) @ adapted.head_weight.t()
            unadapted = plain(ids) @ plain.head_weight.t()
        torch.testing.assert_close(bundle["logits"], expected, rtol=0, atol=1e-5)
        assert (unadapted - expected).abs().max() > 1e-4  # the adapters had changed the model
    best = max(scored, key=lambda e: e["lm_eval"]["embedded_choice"]["acc"])  # the first of equals stays best
    assert record["checkpoints"]["best_step"] == str(best["step"])
    chosen, kept = (load_file(out / "checkpoints" / name / "adapter_model.safetensors")
                    for name in (names[best["step"]], "best"))
    assert chosen.keys() == kept.keys() and all(torch.equal(chosen[k], kept[k]) for k in chosen)
    assert list(temporary.iterdir()) == []  # scoring wrote only inside the run's folder


def test_eval_tasks_without_lm_eval_installed_stop_the_run_saying_so(tmp_path, shard, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)
    with pytest.raises(ParamError, match=r"eval_tasks: lm-eval is not installed .*pip install -e '\.\[eval\]'"):
        run(tmp_path, shard, eval_tasks="embedded_exact", eval_tasks_every="epoch")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
