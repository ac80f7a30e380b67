"""compare_runs: where it may write, what it reads of incomplete, old and curriculum runs, what its sweep plot holds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from cflib.lab.compare import (CompareParams, compare, comparison_table, kernel_letters, plot_sweep,
                               save_comparison)
from cflib.train import train
from cflib.train.params import ParamError
from cflib.train.records import read_metrics

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_SWEEP = ROOT / "outputs" / "records" / "sweep_lr_seeds_cpu"
OLD_RUN = COMMITTED_SWEEP / "runs" / "lr-0.01_seed-0"
# What the cflib of the sweep's first record (commit 30f5221) did not write yet, in its params and its kernel path.
NEWER_PARAMS = ("adam_epsilon", "allow_resume_changes", "best_metric", "curriculum", "distill_ratio",
                "distill_temperature", "dry_run", "early_stopping_patience", "eval_tasks", "eval_tasks_every",
                "eval_tasks_limit", "examples_per_epoch", "expert_lr_multiplier", "filters", "frozen_layers",
                "frozen_modules", "greater_is_better", "kernel_overrides", "log_samples", "lora_lr_multiplier",
                "lora_plus_ratio", "loss_type", "max_position_embeddings", "push_to_hub", "rope_scaling", "rope_theta",
                "teacher_checkpoint", "through_stage")
NEWER_KERNEL_KEYS = ("residual", "last_layer_rows", "optimizer", "gemms")
SMOKE = {"model": "smoke", "data": "embedded", "seq_len": 64, "micro_batch_per_rank": 16, "global_batch": 32,
         "lr": 0.01, "exact_match_limit": 4, "device": "cpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A smoke run of 4 steps and a curriculum of two 2-step stages, trained here."""
    root = tmp_path_factory.mktemp("runs")
    train({**SMOKE, "max_steps": 4, "eval_every_steps": 2, "out_dir": str(root / "run")}, progress=False)
    curriculum = root / "curriculum.yaml"
    curriculum.write_text("version: 1\nstages:\n  - name: first\n    max_steps: 2\n"
                          "  - name: second\n    max_steps: 2\n")
    train({**SMOKE, "curriculum": str(curriculum), "out_dir": str(root / "curriculum")}, progress=False)
    return {"run": root / "run", "curriculum": root / "curriculum"}


def _killed_copy(run: Path, folder: Path) -> Path:
    """What a run killed before its first evaluation after step 0 leaves: params.json, metrics.jsonl up to there."""
    folder.mkdir()
    shutil.copy(run / "params.json", folder / "params.json")
    rows = read_metrics(run / "metrics.jsonl")
    cut = next(i for i, row in enumerate(rows) if row["event"] == "eval" and row["step"] > 0)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:cut]))
    return folder


def test_a_run_folder_is_never_a_comparisons_out_dir_and_an_earlier_comparison_is_replaced(tmp_path, runs):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    (run / "loss_curves.png").write_bytes(b"the run's own plot")
    with pytest.raises(ParamError, match=rf"out_dir {run} holds COMPLETE and \d+ more, which no comparison wrote"):
        compare(CompareParams.from_dict({"runs": str(OLD_RUN), "out_dir": str(run)}))
    assert (run / "loss_curves.png").read_bytes() == b"the run's own plot" and not (run / "comparison.json").exists()

    plot_only = tmp_path / "plots"
    plot_only.mkdir()
    (plot_only / "loss_curves.png").write_bytes(b"someone's plot")
    with pytest.raises(ParamError, match="holds loss_curves.png but no comparison.json of a comparison"):
        compare(CompareParams.from_dict({"runs": str(OLD_RUN), "out_dir": str(plot_only)}))

    out_dir = tmp_path / "comparison"
    first = save_comparison(compare(CompareParams.from_dict({"runs": str(OLD_RUN), "out_dir": str(out_dir)})))
    again = save_comparison(compare(CompareParams.from_dict({"runs": [str(OLD_RUN), str(runs["run"])],
                                                             "out_dir": str(out_dir)})))
    assert {p.name for p in first} <= {p.name for p in again}
    assert len(json.loads((out_dir / "comparison.json").read_text())["rows"]) == 2
    (out_dir / "sweep.png").write_bytes(b"an earlier comparison's sweep plot")  # this one has no sweep
    last = save_comparison(compare(CompareParams.from_dict({"runs": str(runs["run"]), "out_dir": str(out_dir)})))
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(p.name for p in last)  # nothing stale beside it


def test_a_link_in_a_comparisons_out_dir_is_refused_never_written_through(tmp_path):
    out_dir, victim = tmp_path / "comparison", tmp_path / "precious.csv"
    victim.write_text("keep me")
    save_comparison(compare(CompareParams.from_dict({"runs": str(OLD_RUN), "out_dir": str(out_dir)})))
    (out_dir / "comparison.csv").unlink()
    (out_dir / "comparison.csv").symlink_to(victim)
    with pytest.raises(ParamError, match=r"comparison.csv is a symbolic link \(to .*precious.csv"):
        compare(CompareParams.from_dict({"runs": str(OLD_RUN), "out_dir": str(out_dir)}))
    assert victim.read_text() == "keep me"


def test_an_incomplete_run_shows_no_final_or_best_loss_before_its_first_evaluation_after_step_0(tmp_path, runs):
    killed = _killed_copy(runs["run"], tmp_path / "killed")
    row = compare(CompareParams.from_dict({"runs": str(killed), "include_incomplete": True})).rows[0]
    assert row["complete"] is False and row["steps"] == 2
    assert row["final_eval_loss"] is None and row["best_eval_loss"] is None
    assert not any(key.startswith("exact_match/") for key in row)  # the start's decoding is no result either


def test_the_sweep_plot_holds_only_the_sweeps_complete_points_and_names_the_rest(tmp_path, runs):
    sweep = tmp_path / "sweep"
    shutil.copytree(COMMITTED_SWEEP, sweep, ignore=shutil.ignore_patterns("comparison", "*.ipynb"))
    (sweep / "runs" / "lr-0.003_seed-1" / "COMPLETE").unlink()  # killed at its end
    killed = _killed_copy(runs["run"], tmp_path / "killed")
    comparison = compare(CompareParams.from_dict({"runs": [str(sweep), str(killed)], "include_incomplete": True}))
    assert comparison.off_sweep_plot == ["lr-0.003_seed-1 (incomplete)", "killed (not a point of the sweep)"]
    assert "not in the sweep plot: lr-0.003_seed-1 (incomplete), killed (not a point of the sweep)" in (
        comparison.describe())
    figure = plot_sweep(comparison)
    dots = {ax.get_xlabel(): list(ax.lines[0].get_xdata()) for ax in figure.axes}
    plt.close(figure)
    assert sorted(dots["lr"]) == [0.003, 0.01, 0.01] and sorted(dots["seed"]) == [0, 0, 1]


def _older_copy(run: Path, folder: Path) -> Path:
    """The run as an older cflib recorded it: without the parameters and kernel-path keys it did not write yet."""
    shutil.copytree(run, folder)
    record, params = (json.loads((folder / name).read_text()) for name in ("record.json", "params.json"))
    for name in NEWER_PARAMS:
        record["params"].pop(name, None)
        params.pop(name, None)
    for key in NEWER_KERNEL_KEYS:
        record["kernel_path"].pop(key, None)
    (folder / "record.json").write_text(json.dumps(record))
    (folder / "params.json").write_text(json.dumps(params))
    return folder


def test_an_older_record_differs_from_a_new_run_only_where_they_trained_differently(tmp_path, runs):
    older = _older_copy(OLD_RUN, tmp_path / "lr-0.01_seed-0")
    comparison = compare(CompareParams.from_dict({"runs": [str(older), str(runs["run"])]}))
    old, new = (run.params for run in comparison.runs)
    assert "loss_type" not in json.loads((older / "record.json").read_text())["params"]  # the premise
    assert comparison.differing == [name for name in comparison.differing if old.get(name) != new.get(name)]
    assert not {"loss_type", "best_metric", "log_samples", "dry_run", "expert_lr_multiplier",
                "lora_lr_multiplier", "lora_plus_ratio", "adam_epsilon", "frozen_modules",
                "frozen_layers", "teacher_checkpoint", "distill_ratio",
                "distill_temperature"} & set(comparison.differing)
    letters, spelt = kernel_letters(comparison)
    assert letters == ["A", "A"] and list(spelt) == ["A"]  # one kernel path: the newer record names more modules
    assert "residual=" in spelt["A"] and "kernel path B" not in comparison_table(comparison)


def test_a_finished_curriculum_is_compared_as_one_run_its_stages_joined(runs):
    comparison = compare(CompareParams.from_dict({"runs": [str(runs["curriculum"]), str(runs["run"])]}))
    curriculum, single = comparison.rows
    assert curriculum["complete"] is True and curriculum["steps"] == 4
    record = json.loads((runs["curriculum"] / "record.json").read_text())
    assert curriculum["final_eval_loss"] == record["eval"]["final"]["loss"]
    assert comparison.runs[0].stages == ["first", "second"]
    steps = [row["step"] for row in comparison.runs[0].metrics if row["event"] == "train"]
    assert steps == [1, 2, 3, 4]  # the second stage counted on from the first's end
    assert "curriculum" in comparison.differing and single["curriculum"] is None


def test_runs_as_a_yaml_list_in_one_string_and_a_failed_points_whole_reason(tmp_path):
    names = [str(COMMITTED_SWEEP / "runs" / name) for name in ("lr-0.01_seed-0", "lr-0.01_seed-1")]
    assert CompareParams.from_dict({"runs": f"[{names[0]}, {names[1]}]"}).runs == tuple(names)
    sweep = tmp_path / "sweep"
    shutil.copytree(COMMITTED_SWEEP, sweep, ignore=shutil.ignore_patterns("comparison", "*.ipynb"))
    state = json.loads((sweep / "sweep.json").read_text())
    reason = "point lr-0.003_seed-1: " + "lr must be positive and below the limit the schedule allows " * 3
    state["points"][1].update(status="failed", error=reason.strip())
    (sweep / "sweep.json").write_text(json.dumps(state))
    skipped = compare(CompareParams.from_dict({"runs": str(sweep)})).skipped
    assert f"lr-0.003_seed-1 (failed: {reason.strip()})" in skipped


def _reversal_shard(root: Path, eval_words: list[str]) -> Path:
    """A shard of word reversals 15 to 59 tokens long: train the four words twice, eval `eval_words`."""
    from sft_shard_helpers import chat_example, write_shard

    chats = lambda words: [chat_example(i, "reverse", "word", f"reverse {w}", w[::-1])  # noqa: E731
                           for i, w in enumerate(words)]
    words = ["ab", "abcdefgh", "abcdefghijklmnop", "abcdefghijklmnopqrstuvwx"]
    return write_shard(root, chats(words * 2), chats(eval_words), max_seq_len=64)


def test_runs_evaluated_on_different_held_out_sets_are_said_to_be(tmp_path):
    """Two seq_lens under overlong_examples: drop leave different eval examples, as another eval shard of as many
    examples does: the comparison says so, naming each run's set; runs on the same set (another lr) get no such
    line."""
    words = ["ab", "abcdefgh", "abcdefghijklmnop", "abcdefghijklmnopqrstuvwx"]  # 15, 27, 43 and 59 tokens
    shard = _reversal_shard(tmp_path / "shard", words * 2)
    other = _reversal_shard(tmp_path / "other", ["ba", *words[1:]] * 2)  # one word changed: as many examples
    common = {**SMOKE, "overlong_examples": "drop", "max_steps": 1, "micro_batch_per_rank": 2, "global_batch": 2,
              "exact_match_limit": 0, "eval_at_start": False}
    for name, data, seq_len, lr in (("long", shard, 64, 0.01), ("short", shard, 32, 0.01),
                                    ("other_lr", shard, 64, 0.001), ("other_data", other, 64, 0.01)):
        train({**common, "data": str(data), "seq_len": seq_len, "lr": lr, "out_dir": str(tmp_path / name)},
              progress=False)

    def compared(*names: str):
        return compare(CompareParams.from_dict({"runs": [str(tmp_path / name) for name in names],
                                                "out_dir": str(tmp_path / "comparisons" / "-".join(names))}))

    same = compared("long", "other_lr")
    assert not same.held_out_differs and "held-out sets differ" not in same.describe()
    assert same.held_out["long"] == same.held_out["other_lr"]

    seq_lens = compared("long", "short")
    line = next(line for line in seq_lens.describe().splitlines() if line.startswith("held-out sets differ"))
    digest = seq_lens.held_out["long"]["shard"]
    assert f"long (8 examples of eval/ {digest})" in line
    assert f"short (4 examples of eval/ {digest}, 4 longer than seq_len 32 left out)" in line
    save_comparison(seq_lens)
    saved = json.loads((seq_lens.out_dir / "comparison.json").read_text())
    assert saved["held_out_differs"] is True and saved["held_out"]["short"]["dropped"] == {"eval": 4}

    shards = compared("long", "other_data")
    assert shards.held_out_differs and shards.held_out["other_data"]["examples"] == 8
    assert shards.held_out["other_data"]["shard"] != digest


def test_equal_counts_of_a_mixture_that_left_out_other_examples_are_other_held_out_sets():
    """A mixture's records name its sources by root alone: two runs of as many eval examples whose drop took them
    from other sources (a source converted again in place between them) evaluated other examples."""
    from types import SimpleNamespace

    from cflib.lab.compare import _same_held_out, held_out_set

    def record(dropped: dict, seq_len: int) -> SimpleNamespace:
        partitions = {name: {"examples": 6, "dropped": count, "kept": 6 - count, "longest": 80}
                      for name, count in dropped.items()}
        data = {"root": "/data/a", "eval_examples": 10, "overlong": {"seq_len": seq_len, "partitions": partitions},
                "mixture": {"sources": [{"root": "/data/a"}, {"root": "/data/b"}]}}
        return SimpleNamespace(record={"data": data}, complete=True)

    first = held_out_set(record({"eval (a)": 2, "train (a)": 1}, 64))
    assert not _same_held_out(first, held_out_set(record({"eval (b)": 2, "train (a)": 1}, 64)))
    # What drop leaves out of one set of examples follows from their lengths: as many left out at another seq_len
    # are the same ones (no example lies between the two), the same held-out set.
    assert _same_held_out(first, held_out_set(record({"eval (a)": 2, "train (a)": 3}, 48)))
