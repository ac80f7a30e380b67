"""cflib.lab.evaluate: lm-eval (its Python API, real runs) on the Hub bundle of a model that knows the answers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import datasets.config
import pytest
import torch

import cflib.yamlio
from cflib.data import ByteTokenizer
from cflib.data.shards import sha256_file
from cflib.errors import ParamError
from cflib.export import export_hub
from cflib.lab.evaluate import (EVAL_FOLDERS, EvalParams, evaluate, headline, prepare_evaluation, resolve_bundle,
                                run_evaluation, scores_table)
from cflib.train import task_scores
from cflib.train.task_scores import check_tasks, shipped_tasks
from cflib.model import TRMoEModel, load_checkpoint, preset, save_checkpoint

try:
    from test_readers import refused_without_waiting
    from tiny_models import trained_model
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.test_readers import refused_without_waiting
    from tests.tiny_models import trained_model

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ByteTokenizer()


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "examples" / "eval" / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A tiny model trained on the exact-match task's own conversations until it half remembers them: it answers
    some prompts right, not all (a model that knows nothing scores 0, one that knows all 1: neither tests much)."""
    sequences = [TOKENIZER.encode_chat(row["prompt"], row["answer"])[0] for row in rows("exact.jsonl")]
    model = trained_model(sequences, TOKENIZER.vocab_size, steps=60)
    root = tmp_path_factory.mktemp("eval-model")
    return export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)


@pytest.fixture(scope="module")
def evaluated(bundle: Path, tmp_path_factory) -> tuple[dict, Path]:
    """A real lm-eval run, seconds of training and scoring: the tests that read it are in the slow tier. Its out_dir
    holds links in place of two of its files, to a file outside: they are replaced, never written through."""
    out = tmp_path_factory.mktemp("eval") / "out"
    out.mkdir()
    (out.parent / "precious.txt").write_text("keep me")
    for name in ("lm_eval_results.json", "scores.png"):
        (out / name).symlink_to(out.parent / "precious.txt")
    shared_cache = out.parent / "hf-datasets-cache"  # where `datasets` caches what no job names a folder for
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", shared_cache)
        record = evaluate(EvalParams(model=str(bundle), tasks="embedded_choice, embedded_exact", device="cpu",
                                     out_dir=str(out)), progress=False)
    assert not shared_cache.exists()  # the shipped tasks' data cached in the evaluation's folder, then gone
    return record, out


def test_the_shipped_tasks_are_found():
    assert set(shipped_tasks()) == {"embedded_choice", "embedded_exact"}


def test_shipped_tasks_alone_are_checked_without_indexing_lm_evals_registry():
    checked = check_tasks(["embedded_exact", "embedded_choice"])
    assert checked.manager.all_tasks == []  # lm-eval's ~15,000 task files left unread: seconds saved
    assert [d["source"] for d in checked.described.values()] == ["shipped", "shipped"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_task_yaml_past_the_bound_not_a_task_or_a_fifo_is_refused_naming_it(tmp_path, monkeypatch):
    """examples/eval/ is anyone's to add a task to: its YAMLs are read as every YAML cflib reads, bounded, a FIFO
    named *.yaml refused at once rather than waited on by every run that checks its tasks."""
    monkeypatch.setattr(task_scores, "SHIPPED_TASKS", str(tmp_path))
    task = tmp_path / "big.yaml"
    task.write_text("task: big\n" + "#" * cflib.yamlio.MAX_BYTES + "\n")
    with pytest.raises(ParamError, match=f"{task}: larger than the {cflib.yamlio.MAX_BYTES:,} bytes cflib reads in a "
                                         "task YAML"):
        check_tasks(["big"])
    task.write_text("- big\n")
    with pytest.raises(ParamError, match=f"{task}: an lm-eval task YAML is a mapping whose `task` names the task"):
        check_tasks(["big"])
    task.unlink()
    fifo = tmp_path / "piped.yaml"
    os.mkfifo(fifo)
    assert str(refused_without_waiting(lambda: check_tasks(["piped"]), fifo)).startswith(
        f"{fifo}: not a regular file (a FIFO)")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_task_without_data_files_or_whose_data_is_a_fifo_is_refused_naming_it(tmp_path, monkeypatch):
    """A shipped task names its data as dataset_kwargs.data_files beside its YAML: a YAML without them is named
    with the key, a data file that is a FIFO is named as one (not as missing), one that is missing as missing."""
    monkeypatch.setattr(task_scores, "SHIPPED_TASKS", str(tmp_path))
    task = tmp_path / "mine.yaml"
    task.write_text("task: mine\ndataset_path: json\n")
    with pytest.raises(ParamError, match=f"{task}: missing key dataset_kwargs.data_files"):
        check_tasks(["mine"])
    task.write_text("task: mine\ndataset_kwargs:\n  data_files: mine.jsonl\n")
    with pytest.raises(ParamError, match=f"{task}: dataset_kwargs.data_files must map each split to its JSONL file"):
        check_tasks(["mine"])
    task.write_text("task: mine\ndataset_kwargs:\n  data_files:\n    test: mine.jsonl\n")
    with pytest.raises(ParamError, match=f"{tmp_path / 'mine.jsonl'}: no such test data file of task mine"):
        check_tasks(["mine"])
    os.mkfifo(tmp_path / "mine.jsonl")
    assert str(refused_without_waiting(lambda: check_tasks(["mine"]), tmp_path / "mine.jsonl")).startswith(
        f"{tmp_path / 'mine.jsonl'}: not a regular file (a FIFO); cflib reads a test data file of task mine ({task})")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_the_record_reads_the_bundle_s_config_as_every_json_cflib_reads(tmp_path, monkeypatch):
    """The record's copy of config.json is read bounded and from a regular file: one swapped for a FIFO while
    lm-eval scored (here, a stand-in that scores nothing) is refused by name, not waited on."""
    import lm_eval
    import lm_eval.models.huggingface

    monkeypatch.setattr(lm_eval.models.huggingface, "HFLM", lambda **kwargs: None)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: {"samples": {}, "results": {}})
    bundle = export_hub(save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "ckpt"), tmp_path / "bundle",
                        echo=None)
    job = prepare_evaluation(EvalParams(model=str(bundle), tasks="embedded_exact", device="cpu",
                                        out_dir=str(tmp_path / "out")))
    config = bundle / "config.json"
    config.unlink()
    os.mkfifo(config)
    assert str(refused_without_waiting(lambda: run_evaluation(job, progress=False), config)).startswith(
        f"{config}: not a regular file (a FIFO); cflib reads a model config (config.json) from a regular file only")


@pytest.mark.slow  # lm-eval indexes its registry: seconds
def test_a_registry_task_beside_a_shipped_one_is_looked_up_in_lm_evals_index():
    checked = check_tasks(["embedded_exact", "arc_easy"])
    assert "arc_easy" in checked.manager.all_tasks
    assert checked.described["arc_easy"] == {"source": "lm-eval registry"}
    assert checked.specs(["embedded_exact", "arc_easy"], ROOT)[1] == "arc_easy"


@pytest.mark.slow
def test_lm_eval_scores_the_bundle_and_the_files_are_written(evaluated, bundle: Path):
    record, out = evaluated
    assert sorted(p.name for p in out.iterdir()) == ["lm_eval_results.json", "record.json",
                                                     "samples_embedded_choice.jsonl", "samples_embedded_exact.jsonl",
                                                     "scores.png", "tasks"]
    assert (out.parent / "precious.txt").read_text() == "keep me"
    assert not any(p.is_symlink() for p in out.iterdir())
    results = json.loads((out / "lm_eval_results.json").read_text())
    assert set(results["results"]) == {"embedded_choice", "embedded_exact"}
    scores = {(row["task"], row["metric"]): row for row in record["scores"]}
    assert set(scores) == {("embedded_choice", "acc"), ("embedded_choice", "acc_norm"),
                           ("embedded_exact", "exact_match")}
    exact = scores[("embedded_exact", "exact_match")]
    assert 0.0 < exact["value"] < 1.0 and exact["samples"] == 40
    assert exact["value"] == results["results"]["embedded_exact"]["exact_match,none"]
    assert exact["stderr"] == results["results"]["embedded_exact"]["exact_match_stderr,none"]
    assert record["model"]["sha256"] == sha256_file(bundle / "model.safetensors")
    assert record["framework"]["lm_eval"] == results["lm_eval_version"] and record["framework"]["torch"]
    assert record["device"]["type"] == "cpu" and record["job"] == "evaluate" and record["created_utc"]
    yaml_hash = sha256_file(ROOT / "examples" / "eval" / "embedded_exact.yaml")
    assert record["tasks"]["embedded_exact"]["yaml_sha256"] == yaml_hash
    assert (out / "scores.png").stat().st_size > 5_000
    assert "| embedded_exact | exact_match |" in scores_table(record)
    assert headline(record).endswith("64 log-likelihoods checked against cflib, agreeing to 1e-4")


@pytest.mark.slow
def test_exact_match_is_what_the_answers_say(evaluated):
    """lm-eval's answers are compared with the expected ones here, and the hits counted again."""
    record, out = evaluated
    samples = [json.loads(line) for line in (out / "samples_embedded_exact.jsonl").read_text().splitlines()]
    expected = {row["prompt"]: row["answer"] for row in rows("exact.jsonl")}
    hits = [sample["filtered_resps"][0] == expected[sample["doc"]["prompt"]] for sample in samples]
    value = next(row["value"] for row in record["scores"] if row["metric"] == "exact_match")
    assert len(hits) == 40 and sum(hits) / 40 == value


@pytest.mark.slow
def test_lm_evals_log_likelihoods_are_cflibs(evaluated, bundle: Path):
    """Every choice's log-likelihood lm-eval reports, recomputed here with cflib's decoder from the byte
    tokenizer's ids of the prompt's chat layout and the choice."""
    record, out = evaluated
    model = load_checkpoint(bundle).eval()
    samples = [json.loads(line) for line in (out / "samples_embedded_choice.jsonl").read_text().splitlines()]
    assert len(samples) == 40
    for sample in samples:
        prompt = TOKENIZER.encode_prompt(sample["doc"]["prompt"])
        for choice, response in zip(sample["doc"]["choices"], sample["resps"]):
            ids = prompt + TOKENIZER.encode(choice)
            with torch.no_grad():
                logits = (model(torch.tensor([ids[:-1]])) @ model.head_weight.T).log_softmax(-1)[0]
            ours = sum(float(logits[i - 1, ids[i]]) for i in range(len(prompt), len(ids)))
            assert response[0][0] == pytest.approx(ours, abs=1e-4), (sample["doc"], choice)
    check = record["loglikelihood_check"]
    assert check["tasks"] == ["embedded_choice"] and check["pairs"] == 64 and check["max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_a_run_folder_is_scored_through_its_bundle(bundle: Path, tmp_path: Path):
    """Where prepare_evaluation finds the bundle to score (resolve_bundle; the papermill, nbval and browser runs of
    evaluate.ipynb go through prepare_evaluation): a run's own, or one exported into out_dir from a checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "record.json").write_text(json.dumps({"out_dir": str(run)}))
    checkpoint = load_checkpoint_dir(bundle, tmp_path)
    export_hub(checkpoint, run / "hub", echo=None)
    found, source = resolve_bundle(str(run), tmp_path / "out", "cpu")
    assert found == run / "hub" and source == f"the run's Hub bundle {run / 'hub'}"
    exported, source = resolve_bundle(str(checkpoint), tmp_path / "out2", "cpu")
    assert exported == tmp_path / "out2" / "bundle" and source == f"the Hub bundle of checkpoint {checkpoint}, exported here"
    assert sha256_file(exported / "model.safetensors") == sha256_file(bundle / "model.safetensors")


def load_checkpoint_dir(bundle: Path, root: Path) -> Path:
    """The bundle's weights saved as a plain cflib checkpoint (the bundle is one too)."""
    folder = root / "ckpt"
    if not folder.exists():
        save_checkpoint(load_checkpoint(bundle), folder)
    return folder


# --- bad inputs: a clear error naming the culprit, before any model is scored or trained --------
@pytest.mark.parametrize("raw, message", [
    pytest.param({"tasks": "embedded_choice,no_such_task"}, "tasks: 'no_such_task' is neither a task of this project",
                 marks=pytest.mark.slow),  # lm-eval indexes every task it has to look one up: seconds
    ({"tasks": " , "}, "tasks: one or more task names"),
    ({"limit": 0}, "limit must be None"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ({"tasks_": "piqa"}, "unknown parameter 'tasks_'"),
])
def test_bad_parameters_are_refused_before_anything_runs(tmp_path: Path, raw: dict, message: str):
    out = tmp_path / "out"
    with pytest.raises(ParamError, match=message):
        prepare_evaluation(EvalParams.from_dict({"out_dir": str(out), "device": "cpu", **raw}))
    assert not out.exists()  # nothing written, nothing trained


@pytest.mark.parametrize("folder", EVAL_FOLDERS)
def test_a_folder_of_the_evaluation_linking_outside_is_refused_before_anything_runs(tmp_path: Path, folder: str):
    (tmp_path / "outside").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / folder).symlink_to(tmp_path / "outside")
    with pytest.raises(ParamError, match=rf"out_dir {tmp_path / 'out'}: {folder} is a symbolic link"):
        prepare_evaluation(EvalParams.from_dict({"out_dir": str(tmp_path / "out"), "device": "cpu"}))
    assert list((tmp_path / "outside").iterdir()) == []


def test_a_folder_that_is_no_model_is_refused(tmp_path: Path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "adapter_config.json").write_text("{}")
    with pytest.raises(ParamError, match="holds LoRA adapters: merge them into their base first"):
        resolve_bundle(str(tmp_path / "adapters"), tmp_path / "a", "cpu")  # as prepare_evaluation finds a model
    with pytest.raises(ParamError, match="neither a Hub bundle .* a run folder .* nor a checkpoint"):
        resolve_bundle(str(tmp_path), tmp_path / "b", "cpu")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_an_out_dir_that_holds_an_evaluation_is_refused(evaluated):
    _, out = evaluated
    with pytest.raises(ParamError, match="already holds an evaluation"):
        prepare_evaluation(EvalParams(out_dir=str(out), device="cpu"))


def test_train_params_take_eval_tasks_and_refuse_an_empty_list():
    from cflib.train import TrainParams

    assert TrainParams().eval_tasks is None  # off by default
    assert TrainParams.from_dict({"eval_tasks": "embedded_choice,piqa"}).eval_tasks == "embedded_choice,piqa"
    with pytest.raises(ParamError, match="eval_tasks must name at least one lm-eval task"):
        TrainParams.from_dict({"eval_tasks": " , "})
