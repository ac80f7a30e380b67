"""The parameters form (cflib.lab.form) driven from Python; tests/test_lab_browser.py drives it in Chromium."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import cflib.lab.form as form_module
from cflib.data.shards import ShardError, write_partition
from cflib.data.tasks import generate
from cflib.lab.form import ParameterForm, frontend_attached, parameter_form, read_value, show_value, train_form
from cflib.train import batch_arithmetic, describe_arithmetic, prepare
from cflib.train.params import ParamError, TrainParams, load_params_file
from cflib.train.records import count_parameters

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def attached(monkeypatch):
    """As if a person's JupyterLab ran the cell (frontend_attached is tested on its own below)."""
    monkeypatch.setattr(form_module, "frontend_attached", lambda: True)


def defaults() -> dict:
    return dataclasses.asdict(TrainParams())


def test_no_form_without_a_frontend():
    namespace = defaults()
    assert not frontend_attached()  # pytest: no kernel at all
    assert train_form(namespace) is None and namespace == defaults()


@pytest.mark.parametrize("session, allow_stdin, expected", [
    ("notebooks/train_sft.ipynb", True, True),   # JupyterLab
    ("notebooks/train_sft.ipynb", False, False),  # papermill run from a JupyterLab cell: nbclient refuses stdin
    (None, True, False),                          # nbval: its own kernel, no server session
    (None, False, False),                         # papermill
])
def test_frontend_attached_needs_a_server_session_and_stdin(monkeypatch, session, allow_stdin, expected):
    kernel = SimpleNamespace(get_parent=lambda: {"content": {"allow_stdin": allow_stdin}})
    monkeypatch.setattr("IPython.get_ipython", lambda: SimpleNamespace(kernel=kernel))
    if session is None:
        monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    else:
        monkeypatch.setenv("JPY_SESSION_NAME", session)
    assert frontend_attached() is expected


@pytest.mark.parametrize("text, value", [("None", None), ("1e-3", 0.001), ("64", 64), ("smoke", "smoke"),
                                         ("'a b'", "a b"), (" /tmp/run ", "/tmp/run"), ("True", True)])
def test_typed_text_reads_as_python_values(text, value):
    assert read_value(text) == value and type(read_value(text)) is type(value)
    assert read_value(show_value(value)) == value


def test_arithmetic_follows_the_fields(attached):
    namespace = defaults()
    form = train_form(namespace)
    assert "accumulation     2 = global 32 / (micro 16 x world 1)" in form.arithmetic.value
    assert "steps per epoch  688 (22,000 train examples / global 32)" in form.arithmetic.value
    form.fields["micro_batch_per_rank"].value = "8"
    assert "accumulation     4 = global 32 / (micro 8 x world 1)" in form.arithmetic.value
    form.fields["global_batch"].value = "36"
    assert "global_batch 36 is not a multiple of micro_batch_per_rank 8" in form.arithmetic.value
    assert form.apply_button.disabled
    form.apply()
    assert namespace == defaults()  # a failing set changes nothing


def test_params_file_fills_the_fields_and_apply_sets_the_namespace(attached):
    namespace = defaults()
    form = train_form(namespace)
    form.picker.value = str(ROOT / "params" / "quickstart.yaml")
    assert form.fields["model"].value == "quickstart" and form.fields["max_steps"].value == "None"
    assert "optimizer steps  1,032 (3 epochs), 52 of warm-up" in form.arithmetic.value
    form.fields["lr"].value = "2e-3"
    form.apply()
    expected = TrainParams.from_dict({**load_params_file(ROOT / "params" / "quickstart.yaml"), "lr": 2e-3})
    assert TrainParams.from_namespace(namespace) == expected  # eval_every_steps (not a field) included
    assert "Applied from params/quickstart.yaml" in form.status.value and "lr=0.002" in form.status.value
    form.picker.value = ""  # back to the notebook's own values
    assert form.fields["model"].value == "smoke" and form.fields["lr"].value == "0.001"


@pytest.mark.parametrize("train_tasks", [None, ("addition",)])
def test_arithmetic_agrees_with_prepare(train_tasks):
    params = TrainParams(micro_batch_per_rank=8, max_steps=None, epochs=2, device="cpu", train_tasks=train_tasks)
    figures, run = batch_arithmetic(params), prepare(params)
    assert (figures["steps_per_epoch"], figures["total_steps"], figures["warmup_steps"], figures["grad_accum"]) == \
           (run.steps_per_epoch, run.total_steps, run.warmup_steps, run.params.grad_accum)
    assert figures["memory_estimate"] == run.memory_estimate
    assert figures["params_total"] == count_parameters(run.model)["params_total"]
    assert figures["train_examples"] == len(run.train_data)


def test_packed_arithmetic_says_prepare_counts_the_windows():
    params = TrainParams(micro_batch_per_rank=8, max_steps=None, pack_sequences=True, device="cpu")
    figures, run = batch_arithmetic(params), prepare(params)
    assert run.steps_per_epoch < figures["steps_per_epoch"]  # windows hold several examples
    assert "prepare() plans the windows" in describe_arithmetic(figures, params)


def test_a_shard_counts_from_its_index_and_a_missing_one_is_named(tmp_path):
    train, held_out = generate()
    for partition, examples in (("train", train[:50]), ("eval", held_out[:5])):
        write_partition(tmp_path / "shard" / partition, examples, vocab_size=260, eos_token_id=0, max_seq_len=64)
    figures = batch_arithmetic(TrainParams(data=str(tmp_path / "shard"), max_steps=None))
    assert figures["train_examples"] == 50 and figures["steps_per_epoch"] == 2
    uppercase = sum(e.meta["task"] == "uppercase" for e in train[:50])
    only = batch_arithmetic(TrainParams(data=str(tmp_path / "shard"), max_steps=None, train_tasks=("uppercase",),
                                        global_batch=16))
    assert only["train_examples"] == uppercase
    with pytest.raises(ParamError, match=rf"global_batch 32 is more than the {uppercase} train examples"):
        batch_arithmetic(TrainParams(data=str(tmp_path / "shard"), max_steps=None, train_tasks=("uppercase",)))
    with pytest.raises(ShardError, match=r"nowhere/train/sft.idx.json: missing"):
        batch_arithmetic(TrainParams(data=str(tmp_path / "nowhere")))
    index = tmp_path / "shard" / "train" / "sft.idx.json"
    for document, words in (('{"examples": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than 64"),
                            ('{"examples": ' + "9" * 30 + "}", "'examples' must be an integer in [0, 2**48]"),
                            ('{"examples": true}', "'examples' must be an integer")):
        index.write_text(document)
        with pytest.raises(ShardError, match=rf"{index}: .*{re.escape(words)}"):
            batch_arithmetic(TrainParams(data=str(tmp_path / "shard"), max_steps=None))


def test_any_notebook_parameters(attached, tmp_path):
    """Another notebook's parameters: no TrainParams, its own check and arithmetic, its own params folder."""
    (tmp_path / "big.yaml").write_text("budget_gib: 40\n")
    (tmp_path / "foreign.yaml").write_text("budget_gib: 40\nlr: 0.1\n")
    namespace = {"budget_gib": 80.0, "headroom": 0.1, "model": "smoke"}

    def check(values: dict) -> dict:
        if not 0 <= values["headroom"] < 1:
            raise ValueError(f"headroom must be in [0, 1), got {values['headroom']}")
        return values

    form = parameter_form(namespace, ["budget_gib", "headroom", "model"], check=check, params_dir=tmp_path,
                          derived=lambda v: f"usable {v['budget_gib'] * (1 - v['headroom']):.1f} GiB")
    assert "usable 72.0 GiB" in form.arithmetic.value
    form.fields["headroom"].value = "1.5"
    assert "headroom must be in [0, 1), got 1.5" in form.arithmetic.value
    form.picker.value = str(tmp_path / "big.yaml")
    assert "usable 36.0 GiB" in form.arithmetic.value  # the file's budget, the notebook's headroom
    form.apply()
    assert namespace == {"budget_gib": 40, "headroom": 0.1, "model": "smoke"}
    form.picker.value = str(tmp_path / "foreign.yaml")
    assert "foreign.yaml: lr not parameters of this notebook" in form.arithmetic.value
    form.fields["headroom"].value = "0.5"  # typing does not make a foreign file usable
    form.apply()
    assert form.apply_button.disabled and namespace["budget_gib"] == 40 and "lr" not in namespace


def test_a_form_before_the_parameters_cell_names_what_is_missing():
    with pytest.raises(NameError, match="headroom not defined"):
        ParameterForm({"budget_gib": 1.0}, ["budget_gib", "headroom"])
