"""A run on a mixture of shard roots: its draw, its per-source evaluation (metrics, trackers, record, compare_runs),
its dry run, a curriculum stage with its own mixture, packed (each epoch's draw packed anew), and the refusals,
each naming its entry or key.

The sources are the two embedded tasks, each converted to its own shard root (tests/mixture_helpers.py).
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from mixture_helpers import mixture, task_roots, varied_root

from cflib.data.shards import ShardError, open_shard
from cflib.errors import ParamError
from cflib.lab.compare import CompareParams, compare, comparison_table
from cflib.lab.report import export_run, show_answers, summary
from cflib.model.checkpoint import load_checkpoint
from cflib.ops.loss import chunked_cross_entropy_sum
from cflib.train import prepare, train
from cflib.train.held_out import eval_loss
from cflib.train.params import TrainParams
from cflib.train.records import read_metrics
from cflib.train.run import plan_units, schedule_steps
from cflib.train.trainer import Trainer

# 0.8/0.2 of 40 examples an epoch: addition draws 32 of its 30 (a pass and then some), uppercase 8 of its 12.
WEIGHTS = {"addition": 0.8, "uppercase": 0.2}


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    return task_roots(tmp_path_factory.mktemp("roots"), {"addition": 30, "uppercase": 12}, held_out=6)


def params(roots: dict[str, Path], out_dir: Path, **overrides) -> dict:
    # 40 examples an epoch, 8 a step: 5 steps an epoch, no fill-in; 2 epochs.
    return {"model": "smoke", "data": mixture(roots, WEIGHTS), "examples_per_epoch": 40, "out_dir": str(out_dir),
            "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 8, "epochs": 2, "max_steps": None,
            "lr": 3e-3, "exact_match_limit": 8, "device": "cpu", **overrides}


@pytest.fixture(scope="module")
def trained(roots, tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("run") / "mixed"
    return out_dir, train(params(roots, out_dir, report_to="tensorboard"), progress=False)


def test_the_record_holds_the_plan_and_the_shares_the_steps_trained(trained):
    _, record = trained
    plan = record["data"]["mixture"]
    assert [(s["name"], s["per_epoch"], s["with_repetition"]) for s in plan["sources"]] == [
        ("addition", 32, True), ("uppercase", 8, False)]
    assert plan["examples_per_epoch"] == 40 and record["schedule"]["steps_done"] == 10
    # Two whole epochs: the shares of examples are the weights exactly, the tokens follow the examples' lengths.
    assert [s["examples"] for s in plan["trained"]] == [64, 16]
    assert [s["example_share"] for s in plan["trained"]] == [0.8, 0.2]
    assert sum(s["supervised_tokens"] for s in plan["trained"]) == sum(
        row["supervised_tokens"] for row in read_metrics(Path(record["out_dir"]) / "metrics.jsonl")
        if row["event"] == "train")


def test_held_out_loss_per_source_is_each_source_s_own_loss(trained, roots):
    out_dir, record = trained
    final = record["eval"]["final"]
    model = load_checkpoint(out_dir / "checkpoints" / "epoch-2")  # the final evaluation's weights
    for name, root in roots.items():
        alone = eval_loss(model, open_shard(root, "eval"), micro_batch=4, device="cpu")
        assert final["loss_by_source"][name] == pytest.approx(alone["loss"], rel=1e-6)
    assert final["examples"] == 12 and set(final["exact_match_by_source"]) == set(roots)
    # exact_match_limit 8 takes the sources' prompts in turn: four of each.
    assert [sample["task"] for sample in final["exact_match_samples"]].count("uppercase") == 4
    evals = [row for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "eval"]
    assert all(set(row["loss_by_source"]) == set(roots) for row in evals)


def test_trackers_compare_runs_and_the_report_show_each_source(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out_dir, record = trained
    final = record["eval"]["final"]
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    for name in ("addition", "uppercase"):
        assert events.Scalars(f"eval/source/{name}/loss")[-1].value == pytest.approx(final["loss_by_source"][name])
        assert events.Scalars(f"eval/source/{name}/exact_match")[-1].value == pytest.approx(
            final["exact_match_by_source"][name])
    comparison = compare(CompareParams.from_dict({"runs": [str(out_dir)], "metric": "source_loss/uppercase",
                                                   "out_dir": str(out_dir.parent / "comparison")}))
    (row,) = comparison.rows
    assert row["source_loss/uppercase"] == final["loss_by_source"]["uppercase"]
    assert row["source_exact_match/addition"] == final["exact_match_by_source"]["addition"]
    header = [cell.strip() for cell in comparison_table(comparison).splitlines()[0].split("|")]
    assert header.count("source_loss/addition") == 1 and header.count("source_exact_match/uppercase") == 1
    assert f"uppercase: loss {final['loss_by_source']['uppercase']:.4f}" in summary(record)


def test_the_dry_run_shows_each_source_s_share_beside_the_loss_shares(roots, tmp_path):
    groups = {"arithmetic": {"target_share": 0.5, "tasks": ["addition"], "task_target_shares": {"addition": 1.0}},
              "text": {"target_share": 0.5, "tasks": ["uppercase"], "task_target_shares": {"uppercase": 1.0}}}
    record = train(params(roots, tmp_path / "dry", dry_run=True, loss_groups=groups), progress=False)
    (row,) = record["stages"]
    first = {source["name"]: source for source in row["mixture"]["first_epoch"]}
    assert first["addition"]["example_share"] == 0.8 and first["uppercase"]["examples"] == 8
    assert first["addition"]["supervised_token_share"] + first["uppercase"]["supervised_token_share"] == \
        pytest.approx(1.0)
    # The loss weighting counts each example as often as an epoch draws it: its raw shares are the draw's.
    raw = {cell["cell"]: cell["raw_share"] for cell in row["loss_weighting"]}
    assert raw["addition"] == pytest.approx(first["addition"]["supervised_token_share"], abs=0.02)
    assert row["shares_match_targets"] and sorted(p.name for p in (tmp_path / "dry").iterdir()) == ["dry_run.json"]


def test_examples_per_epoch_with_one_root_draws_that_many_from_it(roots, tmp_path):
    record = train(params(roots, tmp_path / "dry", data=str(roots["uppercase"]), examples_per_epoch=30, dry_run=True),
                   progress=False)
    (source,) = record["stages"][0]["mixture"]["sources"]
    assert (source["name"], source["per_epoch"], source["with_repetition"]) == ("uppercase", 30, True)
    assert record["stages"][0]["steps_per_epoch"] == 4  # 30 examples, 8 a step


def test_a_curriculum_stage_trains_on_its_own_mixture(roots, tmp_path):
    stages = [{"name": "addition", "data": str(roots["addition"]), "examples_per_epoch": None, "max_steps": 2},
              {"name": "mixed", "data": mixture(roots, {"addition": 0.5, "uppercase": 0.5}),
               "examples_per_epoch": 16, "max_steps": 2}]
    curriculum = tmp_path / "c.yaml"
    curriculum.write_text(yaml.safe_dump({"version": 1, "stages": stages}, sort_keys=False))
    # The run's own data is a mixture, 40 an epoch: the first stage's single root takes neither.
    train(params(roots, tmp_path / "run", curriculum=str(curriculum), exact_match_limit=0), progress=False)
    first, second = (json.loads((tmp_path / "run" / "stages" / name / "record.json").read_text())
                     for name in ("addition", "mixed"))
    assert "mixture" not in first["data"] and first["data"]["train_examples"] == 30
    assert [s["per_epoch"] for s in second["data"]["mixture"]["sources"]] == [8, 8]
    assert set(second["eval"]["final"]["loss_by_source"]) == {"addition", "uppercase"}


def retokenized(root: Path, folder: Path) -> Path:
    """A copy of `root` whose manifests say it was converted with another tokenizer."""
    copy = shutil.copytree(root, folder)
    for partition in ("train", "eval"):
        index = copy / partition / "sft.idx.json"
        manifest = json.loads(index.read_text())
        manifest["conversion"]["tokenizer"] = {"kind": "pretrained", "path": "elsewhere", "sha256": "ab" * 32}
        index.write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("case, error, message", [
    ("missing", ShardError, r"data\[1\] \(source 'nowhere'\): .*nowhere: no such shard root"),
    ("negative", ParamError, r"data\[1\]\.weight \(.*uppercase\) must be a finite number >= 0 .*, got -0.2"),
    ("nan", ParamError, r"data\[0\]\.weight \(.*addition\) must be a finite number >= 0 .*, got nan"),
    ("tokenizer", ParamError, r"source 'other' \(.*other\) has tokenizer .*pretrained.*, source 'addition'"),
])
def test_a_bad_mixture_stops_before_anything_is_written_naming_the_entry(roots, tmp_path, case, error, message):
    data = mixture(roots, WEIGHTS)
    if case == "missing":
        data[1]["path"] = str(tmp_path / "nowhere")
    elif case == "negative":
        data[1]["weight"] = -0.2
    elif case == "nan":
        data[0]["weight"] = float("nan")
    else:
        data[1] = {"path": str(retokenized(roots["uppercase"], tmp_path / "other")), "weight": 0.2}
    with pytest.raises(error, match=message):
        train(params(roots, tmp_path / "run", data=data), progress=False)
    assert not (tmp_path / "run").exists()


def test_a_source_of_weight_0_is_evaluated_and_never_trained_on(roots, tmp_path):
    """Held out only: every step's examples come from the trained source, and each evaluation scores both."""
    data = [{"path": str(roots["addition"]), "weight": 1.0}, {"path": str(roots["uppercase"]), "weight": 0}]
    record = train(params(roots, tmp_path / "run", data=data, examples_per_epoch=None, epochs=1), progress=False)
    plan = record["data"]["mixture"]
    assert [(s["per_epoch"], s["held_out_only"]) for s in plan["sources"]] == [(30, False), (0, True)]
    assert plan["trained"][1]["examples"] == 0 and plan["trained"][0]["examples"] >= 30  # an epoch: 30, filled in
    assert set(record["eval"]["final"]["loss_by_source"]) == {"addition", "uppercase"}
    # Its train examples are the run's in no count, and none is held to seq_len: a longer one stops nothing.
    assert record["data"]["train_examples"] == 30 and plan["sources"][1]["train_examples"] == 0
    longer = tmp_path / "longer"  # held-out rows as long as the trained source's, train rows longer
    shutil.copytree(roots["addition"] / "eval", longer / "eval")
    shutil.copytree(roots["uppercase"] / "train", longer / "train")
    fits = int(max(max(open_shard(roots["addition"], partition).lengths) for partition in ("train", "eval")))
    assert max(open_shard(longer, "train").lengths) > fits
    data[1]["path"] = str(longer)
    train(params(roots, tmp_path / "short", data=data, examples_per_epoch=None, epochs=1, max_steps=1,
                 seq_len=fits), progress=False)


def test_a_source_of_weight_0_needs_its_eval_partition_alone(roots, tmp_path):
    """A held-out set shipped as eval/ alone is a source of weight 0; a source that trains still needs train/,
    and a missing partition is named with its folder."""
    held_out = tmp_path / "held_out"
    shutil.copytree(roots["uppercase"] / "eval", held_out / "eval")
    data = [{"path": str(roots["addition"]), "weight": 1.0}, {"path": str(held_out), "weight": 0}]
    record = train(params(roots, tmp_path / "run", data=data, examples_per_epoch=None, epochs=1, max_steps=1),
                   progress=False)
    assert [s["held_out_only"] for s in record["data"]["mixture"]["sources"]] == [False, True]
    assert set(record["eval"]["final"]["loss_by_source"]) == {"addition", "held_out"}
    assert set(record["data"]["preflight"]) == {"train (addition)", "eval (addition)", "eval (held_out)"}
    data[1]["weight"] = 0.5
    with pytest.raises(ShardError, match=r"data\[1\] \(source 'held_out'\): .*held_out/train/sft\.idx\.json: "
                                         r"missing \(is .*held_out a shard root with a train/ partition\?\)"):
        train(params(roots, tmp_path / "trains", data=data, examples_per_epoch=None), progress=False)
    shutil.rmtree(held_out / "eval")
    shutil.copytree(roots["uppercase"] / "train", held_out / "train")
    data[1]["weight"] = 0
    with pytest.raises(ShardError, match=r"data\[1\] \(source 'held_out', held out only: its eval/ is read, never "
                                         r"its train/\): .*held_out/eval/sft\.idx\.json: missing"):
        train(params(roots, tmp_path / "no_eval", data=data, examples_per_epoch=None), progress=False)


def test_the_model_card_names_every_source_by_its_folder_alone(trained, roots, tmp_path):
    """A card is published: each source's weight and manifest hashes, and no path of this machine."""
    from cflib.export import export_hub

    out_dir, _ = trained
    card = (export_hub(out_dir, tmp_path / "hub", echo=None) / "README.md").read_text()
    for task, weight in WEIGHTS.items():
        index = json.loads((roots[task] / "train" / "sft.idx.json").read_text())
        assert f"| train data | {index['examples']:,} examples of {task} (weight {weight:g}); manifest SHA-256: " \
               f"input_ids.bin `{index['sha256']['input_ids.bin']}`" in card
        assert str(roots[task]) not in card and f"path: {task}" in card


def test_show_answers_shows_every_source_s_held_out_prompts(trained, roots, capsys):
    """The run's held-out set is every source's eval/: the prompts shown are dealt to the sources in turn."""
    _, record = trained
    show_answers(record, n=4)
    shown = capsys.readouterr().out
    assert "greedy, 4 held-out prompts of 2 sources" in shown
    assert re.findall(r"^(?:hit |miss) \[(\w+)\] ", shown, re.M) == ["addition", "addition", "uppercase", "uppercase"]
    # Each prompt is its source's own: an uppercase prompt expects letters, an addition prompt digits.
    expected = re.findall(r"^(?:hit |miss) \[(\w+)\] .*\n +expected '(.*?)(?:<\|eos\|>)?'", shown, re.M)
    assert [source for source, answer in expected if answer.isdigit()] == ["addition", "addition"]


def test_a_mixture_s_bundle_takes_the_tokenizer_a_source_names_on_this_machine(trained, roots, tmp_path,
                                                                                monkeypatch, capsys):
    """Every source was converted with one tokenizer (the same SHA-256), each manifest naming it where its source
    was converted: the first source's path gone, the second's stands for both."""
    import cflib.lab.report

    _, record = trained
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    exported = {}
    monkeypatch.setattr(cflib.lab.report, "export_hub", lambda source, out, **kwargs: exported.update(kwargs) or out)
    indexes = {task: roots[task] / "eval" / "sft.idx.json" for task in WEIGHTS}
    originals = {task: index.read_text() for task, index in indexes.items()}
    try:
        for task, path in (("addition", tmp_path / "gone" / "tokenizer.json"), ("uppercase", tokenizer)):
            manifest = json.loads(originals[task])
            manifest["conversion"]["tokenizer"] = {"kind": "tokenizer.json", "path": str(path), "sha256": "ab" * 32}
            indexes[task].write_text(json.dumps(manifest))
        assert export_run(record, tmp_path / "hub") == tmp_path / "hub"
    finally:
        for task, index in indexes.items():
            index.write_text(originals[task])
    assert exported["tokenizer"] == str(tokenizer), capsys.readouterr().out


def test_a_resume_with_a_source_renamed_is_refused_naming_the_mixture(roots, tmp_path):
    out_dir = tmp_path / "run"
    train(params(roots, out_dir, save_every_steps=2), progress=False)
    for name in ("COMPLETE", "record.json"):
        (out_dir / name).unlink()
    renamed = [{**source, "name": f"source-{index}"} for index, source in enumerate(mixture(roots, WEIGHTS))]
    with pytest.raises(ParamError, match="a source of the mixture was added, removed or renamed"):
        train(params(roots, out_dir, data=renamed, resume="latest"), progress=False)


def test_a_held_out_only_source_s_train_part_is_a_marker_and_older_checkpoints_resume(roots, tmp_path):
    """The train digest of a mixture names a held-out-only source by a fixed marker, never its eval/ manifest; a
    checkpoint written when it hashed the source's train/ manifest resumes as the same data."""
    import hashlib

    out_dir = tmp_path / "run"
    data = [{"path": str(roots["addition"]), "weight": 1.0}, {"path": str(roots["uppercase"]), "weight": 0}]
    run_params = params(roots, out_dir, data=data, examples_per_epoch=None, epochs=1, save_every_steps=2)
    train(run_params, progress=False)
    for name in ("COMPLETE", "record.json"):
        (out_dir / name).unlink()
    state_path = out_dir / "checkpoints" / "step-2" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)

    def digest(task: str, partition: str) -> str:
        recorded = json.loads((roots[task] / partition / "sft.idx.json").read_text())["sha256"]
        return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()

    def mixed(second: str) -> str:
        return hashlib.sha256(json.dumps([["addition", digest("addition", "train")],
                                          ["uppercase", second]]).encode()).hexdigest()

    assert state["data"]["train"] == mixed("held out only")
    for name in ("epoch-1", "best"):  # resume: latest takes step-2
        shutil.rmtree(out_dir / "checkpoints" / name)
    state["data"]["train"] = mixed(digest("uppercase", "eval"))  # other data than the run's: refused
    torch.save(state, state_path)
    with pytest.raises(ParamError, match="was trained on other data"):
        train({**run_params, "resume": "latest"}, progress=False)
    state["data"]["train"] = mixed(digest("uppercase", "train"))  # as checkpoints written before the marker
    torch.save(state, state_path)
    record = train({**run_params, "resume": "latest"}, progress=False)
    assert record["schedule"]["steps_done"] == 4 and record["model_source"].startswith("resumed from")


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> dict[str, Path]:
    """Two sources of unequal lengths, 30 chats of up to 55 characters and 12 of up to 12: each epoch's draw of them
    packs into its own number of windows."""
    folder = tmp_path_factory.mktemp("varied")
    return {"long": varied_root(folder / "long", 30, 1, 55, seed=0),
            "short": varied_root(folder / "short", 12, 1, 12, seed=1)}


def packed_params(varied: dict[str, Path], out_dir: Path, **overrides) -> dict:
    # 0.8/0.2 of 40 examples an epoch (long draws 32 of its 30) in 64-token windows, 4 a step: epochs of 5, 6 and 6
    # steps at seed 3.
    return {"model": "smoke", "data": mixture(varied, {"long": 0.8, "short": 0.2}), "examples_per_epoch": 40,
            "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 2, "global_batch": 4, "epochs": 3,
            "max_steps": None, "lr": 3e-3, "exact_match_limit": 4, "device": "cpu", "pack_sequences": True,
            "seed": 3, "save_every_steps": 5, "save_total_limit": None, **overrides}


@pytest.fixture(scope="module")
def packed(varied, tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("packed") / "run"
    return out_dir, train(packed_params(varied, out_dir), progress=False)


def test_a_packed_mixture_trains_each_epoch_s_draw_in_windows_of_several_sources(packed, varied, tmp_path):
    out_dir, record = packed
    run = prepare(TrainParams.from_dict(packed_params(varied, tmp_path / "again")))  # the same plan
    windows, plan = run.packed, run.mixture
    assert len(windows.epochs) == 3  # every epoch planned before step 1: the schedule counts their windows
    steps = [math.ceil(len(windows.of_epoch(epoch)) / 4) for epoch in (1, 2, 3)]
    schedule = record["schedule"]
    assert schedule["steps_by_epoch"] == steps and len(set(steps)) > 1  # the case to check: epochs of their own
    assert schedule["total_steps"] == schedule["steps_done"] == sum(steps)
    source_of = run.train_data.source_of
    assert any(len(set(source_of[windows.window(w)])) == 2 for w in range(len(windows)))
    # Per source: each epoch's draw (32 and 8) once, and the examples of the windows that fill in its last step.
    fill_ins = np.concatenate([windows.examples_of(run.epoch_order(epoch)[0][-fill:]) if fill else []
                               for epoch, fill in zip((1, 2, 3), schedule["fill_ins_per_epoch"])]).astype(np.int64)
    expected = 3 * plan.per_epoch + np.bincount(source_of[fill_ins], minlength=2)
    trained = record["data"]["mixture"]["trained"]
    assert [s["examples"] for s in trained] == expected.tolist()
    assert sum(s["supervised_tokens"] for s in trained) == sum(
        row["supervised_tokens"] for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train")
    assert (record["packing"]["epochs"], record["packing"]["examples"]) == (3, 120)
    # The held-out set is evaluated unpacked, as one shard's is: each source's loss is its own.
    model = load_checkpoint(out_dir / "checkpoints" / "epoch-3")
    for name, root in varied.items():
        alone = eval_loss(model, open_shard(root, "eval"), micro_batch=4, device="cpu")
        assert record["eval"]["final"]["loss_by_source"][name] == pytest.approx(alone["loss"], rel=1e-6)


def test_a_packed_mixture_trains_the_same_twice(packed, varied, tmp_path):
    out_dir, record = packed
    again = train(packed_params(varied, tmp_path / "again"), progress=False)
    assert train_losses(tmp_path / "again") == train_losses(out_dir)
    assert again["data"]["mixture"] == record["data"]["mixture"] and again["packing"] == record["packing"]


def test_a_packed_mixture_resumed_in_an_epoch_of_its_own_length_ends_as_the_whole_run(packed, varied, tmp_path):
    """Resumed at step 10, the fifth step of epoch 2, which takes 6 steps where epoch 1 took 5: the windows are
    planned again from (seed, epoch), the epoch goes on where it stopped and the run ends with the same weights."""
    out_dir, record = packed
    assert record["schedule"]["steps_by_epoch"] == [5, 6, 6]
    copy = shutil.copytree(out_dir, tmp_path / "copy")
    for name in ("COMPLETE", "record.json"):
        (copy / name).unlink()
    resumed = train(packed_params(varied, copy, resume=str(copy / "checkpoints" / "step-10")), progress=False)
    assert resumed["model_source"].startswith("resumed from") and train_losses(copy) == train_losses(out_dir)
    weights = lambda d: load_checkpoint(d / "checkpoints" / "epoch-3").state_dict()  # noqa: E731
    for name, tensor in weights(out_dir).items():
        torch.testing.assert_close(weights(copy)[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert resumed["data"]["mixture"] == record["data"]["mixture"]


def train_losses(out_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train"]


def test_a_packed_mixture_s_lr_schedule_spans_every_epoch_s_windows(varied, tmp_path):
    """The run's steps are the sum of its epochs' (5, 6 and 6): a warm-up and wsd's decay are sized on them."""
    run = prepare(TrainParams.from_dict(packed_params(varied, tmp_path / "run", lr_schedule="wsd", warmup_steps=3,
                                                      lr_decay_ratio=0.3)))
    assert run.epoch_steps() == [5, 6, 6]
    assert (run.total_steps, run.warmup_steps, run.schedule.decay_steps) == (17, 3, math.ceil(0.3 * 17))
    by_ratio = prepare(TrainParams.from_dict(packed_params(varied, tmp_path / "ratio", warmup_ratio=0.1)))
    assert by_ratio.schedule.record() == {"lr_schedule": "cosine", "warmup_steps": 2, "warmup_from": "warmup_ratio",
                                          "warmup_ratio": 0.1, "decay_steps": 15, "min_lr_ratio": 0.0,
                                          "lr_decay_ratio": None}


def test_a_packed_step_of_a_mixture_gives_each_example_its_loss_alone(varied, tmp_path):
    """A step's windows hold both sources' examples side by side; its loss is their supervised tokens' mean loss,
    each example run on its own: no example attends to another, and positions restart in each."""
    run = prepare(TrainParams.from_dict(packed_params(varied, tmp_path / "run")))
    trainer = Trainer(run, progress=False)
    sources = lambda window: len(set(run.train_data.source_of[run.packed.window(window)]))  # noqa: E731
    windows = np.array(sorted(range(len(run.packed.of_epoch(1))), key=sources, reverse=True)[:4])
    assert sources(windows[0]) == 2
    examples = run.examples_of(windows)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids, labels = run.train_data[int(example)]
            loss, supervised = chunked_cross_entropy_sum(run.model(ids[None]), run.model.head_weight, labels[None], 64)
            total, count = total + float(loss), count + int(supervised)
    row = trainer.train_step(windows)
    assert row["supervised_tokens"] == count and row["loss"] == pytest.approx(total / count, rel=1e-5)


def test_examples_per_epoch_with_one_root_packs_each_epoch_s_draw(roots, tmp_path):
    """30 of uppercase's 12 examples an epoch, packed; max_steps runs into an epoch the start planned none of."""
    one = {"pack_sequences": True, "global_batch": 4, "micro_batch_per_rank": 2, "data": str(roots["uppercase"]),
           "examples_per_epoch": 30}
    run = prepare(TrainParams.from_dict(params(roots, tmp_path / "prepared", **one)))
    dry = train(params(roots, tmp_path / "dry", **one, dry_run=True), progress=False)
    assert dry["stages"][0]["steps_per_epoch"] == run.steps_per_epoch == math.ceil(len(run.packed.of_epoch(1)) / 4)
    steps = run.steps_per_epoch + 2  # into the second epoch
    record = train(params(roots, tmp_path / "run", **one, max_steps=steps), progress=False)
    assert record["schedule"]["steps_done"] == steps and len(record["schedule"]["steps_by_epoch"]) == 2
    (source,) = record["data"]["mixture"]["trained"]
    assert source["examples"] >= 30 and record["packing"]["epochs"] == 2
    with pytest.raises(ParamError, match="global_batch 16 is more than the .* seq_len windows an epoch's draw packs"):
        train(params(roots, tmp_path / "big", **{**one, "global_batch": 16}), progress=False)


def test_overlong_examples_drop_leaves_each_source_s_longer_examples_out_of_its_draw_windows_and_held_out_set(
        varied, roots, tmp_path):
    """seq_len 40 holds 17 of the long source's 30 train examples and 2 of its 4 held out, and every short one: the
    draw, the windows and the held-out set see those alone, each source's drop counted (the run's description, its
    record's data, the dry run's row); a source none of whose train examples fits is named before anything is
    written."""
    drop = {"seq_len": 40, "overlong_examples": "drop"}
    run = prepare(TrainParams.from_dict(packed_params(varied, tmp_path / "run", **drop)))
    assert run.overlong == {"seq_len": 40, "partitions": {
        "train (long)": {"examples": 30, "dropped": 13, "kept": 17, "longest": 59},
        "eval (long)": {"examples": 4, "dropped": 2, "kept": 2, "longest": 52},
        "train (short)": {"examples": 12, "dropped": 0, "kept": 12, "longest": 17},
        "eval (short)": {"examples": 4, "dropped": 0, "kept": 4, "longest": 17}}}
    assert run.mixture.available.tolist() == [17, 12] and run.mixture.per_epoch.tolist() == [32, 8]
    assert len(run.eval_data) == 6 and max(run.train_data.lengths) <= 40 and max(run.eval_data.lengths) <= 40
    windows = run.packed
    assert all(run.train_data.lengths[windows.window(w)].sum() <= 40 for w in range(len(windows)))
    assert run.data_record(0)["overlong"] == run.overlong and (
        "overlong     examples longer than seq_len 40 left out: train (long) 13 of 30, eval (long) 2 of 4, train "
        "(short) 0 of 12, eval (short) 0 of 4 (the longest: 59 tokens)") in run.describe()
    dry = train(packed_params(varied, tmp_path / "dry", dry_run=True, **drop), progress=False)
    assert dry["stages"][0]["overlong"] == run.overlong and dry["stages"][0]["examples"] == {"examples": 42, "kept": 29}
    with pytest.raises(ShardError, match=r"data\[1\] \(source 'uppercase'\): .*uppercase/train: overlong_examples: "
                                         r"drop would leave no train example: all 12 are longer than seq_len 16 .*"
                                         "raise seq_len to at least 21"):
        train(params(roots, tmp_path / "none", seq_len=16, overlong_examples="drop"), progress=False)
    assert not (tmp_path / "none").exists()


def test_max_steps_checks_global_batch_against_every_epoch_its_steps_reach():
    """Epoch 1's draw packs into 4 windows, epoch 2's into 2: a global batch of 4 whose max_steps reach epoch 2 is
    refused before step 1; one that ends within epoch 1 counts epoch 1 alone."""
    draws = {1: np.arange(8), 2: np.arange(4)}  # examples of 30 tokens, two to a window of 64
    drawn = SimpleNamespace(epoch=lambda epoch: draws.get(epoch, np.arange(8)))
    data = SimpleNamespace(lengths=np.full(8, 30))
    reaching = SimpleNamespace(pack_sequences=True, seq_len=64, global_batch=4, epochs=1, max_steps=2)
    windows, units = plan_units(reaching, data, drawn)
    assert units == [4, 2] and len(windows.epochs) == 1  # epoch 2 counted, planned as it starts
    with pytest.raises(ParamError, match="global_batch 4 is more than the 2 windows"):
        schedule_steps(units, reaching, "windows")
    assert plan_units(SimpleNamespace(**{**vars(reaching), "max_steps": 1}), data, drawn)[1] == [4]
    assert plan_units(SimpleNamespace(**{**vars(reaching), "max_steps": 5, "global_batch": 2}), data, drawn)[1] == \
        [4, 2, 4]  # 2 + 1 + 2 steps: step 5 ends epoch 3
