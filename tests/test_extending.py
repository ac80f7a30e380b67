"""The doors of docs/architecture.md ("Extending the package"), walked through as the page shows them: a toy
attention backend and a toy loss, registered, named by a run's parameters and trained with; a new parameter,
declared and read from papermill's strings and a notebook's namespace; a registered loss, metric and attention
backend carried to torchrun's workers by import path, or refused before any starts where they cannot import it."""
from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from extending_helpers import (
    SmoothedFactory,
    SmoothedLoss,
    auto_math_backend,
    first_number_right,
    math_backend,
    number_right,
    smoothed_factory,
)
from sft_shard_helpers import write_shard
from tiny_models import random_ids, tiny_model

from cflib.bench.components import components
from cflib.data.tasks import generate
from cflib.ops import attention, sft_loss
from cflib.ops.attention import Backend, Kernel, attend, attention_batch, register_backend
from cflib.ops.sft_loss import register_loss
from cflib.train import best_metric, launch, prepare, train
from cflib.train.best_metric import regex_metric, register_metric
from cflib.train.params import ParamError, TrainParams
from cflib.train.registered import backend_import_path, for_workers, import_path, register_carried


def causal_math(q, k, v, batch):  # q [B, Hq, T, hd], k/v [B, Hkv, T, hd]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture
def registered():
    """The page's two registrations, undone afterwards so no other test sees them."""
    register_backend(Backend("math", "SDPA's math over repeated KV heads",
                             Kernel("math_sdpa", causal_math, component="attention_math"), None,
                             lambda device, head_dim, packed: None))
    register_loss("smoothed", SmoothedLoss)
    yield
    attention.BACKENDS.pop("math")
    sft_loss.LOSSES.pop("smoothed")


def test_a_registered_backend_attends_like_sdpa_and_is_validated(registered):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 9, 8, generator=gen) for heads in (4, 2, 2))
    batch = attention_batch("math", torch.device("cpu"), torch.float32, 8)
    assert batch.kernel == "math_sdpa"
    torch.testing.assert_close(attend(q, k, v, batch),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert "attention_math" in {c.name for c in components()}
    with pytest.raises(Exception, match="math attends dense rows only"):
        attention_batch("math", torch.device("cpu"), torch.float32, 8, attention.pack_documents(
            torch.tensor([[0, 0, 1, 1]])))


def test_the_model_attends_with_it(registered):
    model = tiny_model()
    ids = random_ids(model.config.vocab_size, 2, 10)
    with torch.no_grad():
        expected = model(ids)
        model.attention_backend = "math"
        found = model(ids)
    assert model.kernel_path()["attention"] == "math_sdpa"
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)


def test_a_run_names_both_and_its_record_says_so(registered, tmp_path):
    train_examples, eval_examples = generate(seed=1)
    shard = write_shard(tmp_path / "shard", train_examples[:16], eval_examples[:8], max_seq_len=64)
    record = train({"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 8, "max_steps": 2,
                    "exact_match_limit": 0, "device": "cpu", "data": str(shard), "out_dir": str(tmp_path / "run"),
                    "attention_backend": "math", "loss_type": "smoothed"}, progress=False)
    saved = json.loads(Path(tmp_path / "run" / "record.json").read_text())
    assert saved["kernel_path"]["attention"] == "math_sdpa" and saved["kernel_path"]["loss"] == "smoothed_chunked_ce"
    assert saved["registered"] == {"loss_type": {"smoothed": "extending_helpers:SmoothedLoss"}, "metrics": {},
                                   "attention_backends": {"math": "Backend 'math', bound to no module-level name"}}
    assert record["eval"]["final"]["loss"] > 0


def test_unregistered_names_are_refused_before_any_step():
    with pytest.raises(ParamError, match="loss_type must be one of .*'sft_cross_entropy'.*got 'smoothed'"):
        TrainParams.from_dict({"loss_type": "smoothed"})
    with pytest.raises(ParamError, match="attention_backend must be one of .* got 'math'"):
        TrainParams.from_dict({"attention_backend": "math"})


@dataclass(frozen=True)
class AveragedTrainParams(TrainParams):
    """TrainParams with the page's ema_decay, declared as its Optimisation section would declare it (a subclass
    here, so no other test sees it)."""

    ema_decay: float | None = None  # None: no average; else the share of the average kept at each step

    def validate(self) -> None:
        super().validate()
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ParamError(f"ema_decay must be None or in (0, 1), got {self.ema_decay}")


def test_a_new_parameter_is_read_as_its_type_says_and_reads_flat():
    assert AveragedTrainParams.from_dict({"ema_decay": "0.999"}).ema_decay == 0.999  # -p ema_decay 0.999
    assert AveragedTrainParams.from_dict({"ema_decay": 0.99, "lr": "2e-3"}).ema_decay == 0.99  # a params file
    assert AveragedTrainParams.from_dict({"ema_decay": "None"}).ema_decay is None
    assert {"lr": 1e-3, "ema_decay": None}.items() <= asdict(AveragedTrainParams()).items()  # params.json's names
    with pytest.raises(ParamError, match=r"ema_decay must be None or in \(0, 1\), got 1.5"):
        AveragedTrainParams.from_dict({"ema_decay": 1.5})


def test_a_misspelt_new_parameter_is_refused_with_the_name_meant():
    meant = r"unknown parameter 'ema_decy' \(did you mean 'ema_decay'\?\)"
    with pytest.raises(ParamError, match=meant):
        AveragedTrainParams.from_dict({"ema_decy": 0.9})
    namespace = {"ema_decay": 0.9, "ema_note": "kept", "In": ["", "ema_note = 'kept'"]}  # a later cell's
    assert AveragedTrainParams.from_namespace(namespace).ema_decay == 0.9
    with pytest.raises(ParamError, match=meant):  # -p ema_decy 0.9, as papermill injects it
        AveragedTrainParams.from_namespace({**namespace, "ema_decy": 0.9, "In": ["# Parameters\nema_decy = 0.9\n"]})


@pytest.fixture
def sum_right():
    register_metric("sum_right", first_number_right)
    yield
    best_metric.ANSWER_METRICS.pop("sum_right")


def test_a_registered_metric_chooses_best_and_reads_the_answers_as_text(sum_right, tmp_path):
    assert first_number_right("1090 and more", "1090") == 1.0 and first_number_right("109", "1090") == 0.0
    assert regex_metric(r"-?\d+")("1090.0", "1090") == 1.0  # the ready-made one the page names
    train_examples, eval_examples = generate(seed=1)
    shard = write_shard(tmp_path / "shard", train_examples[:16], eval_examples[:8], max_seq_len=64)
    record = train({"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 8, "max_steps": 4,
                    "eval_every_steps": 2, "device": "cpu", "data": str(shard), "out_dir": str(tmp_path / "run"),
                    "best_metric": "sum_right/addition", "log_samples": 8}, progress=False)
    for evaluation in record["eval"]["history"]:
        answers = [json.loads(line) for line in (tmp_path / "run" / evaluation["samples_file"]).read_text().splitlines()]
        addition = [a for a in answers if a["task"] == "addition"]
        expected = sum(first_number_right(a["answer"], a["reference"]) for a in addition) / len(addition)
        assert evaluation["metrics"]["sum_right/addition"] == pytest.approx(expected)
    assert record["best_metric"]["name"] == "sum_right/addition" and record["best_metric"]["greater_is_better"]


# A run on two CPU processes (gloo), of the page's smallest size.
TWO_PROCESSES = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 8, "max_steps": 2,
                 "exact_match_limit": 8, "device": "cpu", "nproc_per_node": 2}
WORKERS_IMPORT = r"in a module the worker processes can import \(a \.py file in the notebook's folder, or on PYTHONPATH\)"


def in_notebook(source: str) -> dict:
    """What a notebook cell defines: names of module `__main__`, as in a Jupyter kernel."""
    namespace = {"__name__": "__main__"}
    exec(source, namespace)
    return namespace


CELL = in_notebook("""
from extending_helpers import SmoothedFactory, SmoothedLoss, first_number_right, number_right, smoothed_factory

class CellLoss(SmoothedLoss):
    pass

def cell_right(answer, reference):
    return first_number_right(answer, reference)
""")


@pytest.fixture
def shard(tmp_path) -> Path:
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path / "shard", train_examples[:16], eval_examples[:8], max_seq_len=64)


@pytest.fixture
def no_worker_starts(monkeypatch):
    """torchrun's relay replaced: a run these tests expect refused starts no process even if it were not."""
    def started(*args, **kwargs):
        raise AssertionError("a worker process was started")
    monkeypatch.setattr(launch, "relay", started)


@pytest.fixture
def registered_in_notebook():
    register_loss("cell_loss", CELL["CellLoss"])
    register_metric("cell_right", CELL["cell_right"])
    yield
    sft_loss.LOSSES.pop("cell_loss")
    best_metric.ANSWER_METRICS.pop("cell_right")


def test_only_what_importing_gives_back_has_an_import_path():
    assert import_path(SmoothedLoss) == "extending_helpers:SmoothedLoss"
    assert import_path(first_number_right) == "extending_helpers:first_number_right"
    assert CELL["CellLoss"].__module__ == "__main__" and import_path(CELL["CellLoss"]) is None
    assert import_path(regex_metric(r"-?\d+")) is None  # no name of its own: carried by its pattern instead
    assert import_path(smoothed_factory) == "extending_helpers:smoothed_factory"  # an instance its module binds
    assert import_path(number_right) == "extending_helpers:number_right"  # a closure its module binds
    assert import_path(SmoothedFactory()) is None  # an instance no module binds
    assert import_path(lambda answer, reference: 1.0) is None
    copy = type("SmoothedLoss", (SmoothedLoss,), {"__module__": SmoothedLoss.__module__})
    assert import_path(copy) is None  # its name leads to another object: the workers would train with that


def test_an_instance_no_module_binds_is_refused_as_one(shard, no_worker_starts, tmp_path):
    """Its class imports fine: the refusal says it is an instance, and how to make it carriable."""
    register_loss("unbound", SmoothedFactory())
    try:
        with pytest.raises(ParamError, match=r"loss_type 'unbound': its loss an instance of "
                                             r"extending_helpers:SmoothedFactory has no name of its own that the 2 "
                                             r"worker processes can import it by: register a class or function "
                                             r"defined at module level, or bind the object to a name at module level"):
            train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"), "loss_type": "unbound"},
                  progress=False)
    finally:
        sft_loss.LOSSES.pop("unbound")
    assert not (tmp_path / "run").exists()


def test_instances_and_closures_their_module_binds_and_regex_metrics_are_carried(shard, tmp_path):
    register_loss("bound", smoothed_factory)
    register_metric("bound_right", number_right)
    register_metric("digits", regex_metric(r"-?\d+"))
    try:
        params = TrainParams.from_dict({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
                                        "loss_type": "bound", "best_metric": "digits/addition"})
        carried = for_workers(params)
        assert carried == {"losses": {"bound": "extending_helpers:smoothed_factory"},
                           "metrics": {"bound_right": {"path": "extending_helpers:number_right",
                                                       "greater_is_better": True},
                                       "digits": {"path": "cflib.train.best_metric:regex_metric",
                                                  "pattern": r"-?\d+", "greater_is_better": True}},
                           "left_out": [], "attention_backends": {}}
        best_metric.ANSWER_METRICS.pop("digits")
        register_carried(carried)  # as a worker does
        assert best_metric.ANSWER_METRICS["digits"].score("the sum is 1090.", "1090") == 1.0
        assert best_metric.ANSWER_METRICS["digits"].score.pattern == r"-?\d+"
        assert "metric digits (cflib.train.best_metric:regex_metric('-?\\\\d+'))" in prepare(params).describe()
    finally:
        sft_loss.LOSSES.pop("bound")
        for name in ("bound_right", "digits"):
            best_metric.ANSWER_METRICS.pop(name, None)
    assert not (tmp_path / "run").exists()


def test_a_loss_defined_in_the_notebook_is_refused_before_any_worker_starts(registered_in_notebook, shard,
                                                                         no_worker_starts, tmp_path):
    with pytest.raises(ParamError, match=r"loss_type 'cell_loss': its loss __main__:CellLoss cannot be imported by "
                                         r"that name in the 2 worker processes; define it " + WORKERS_IMPORT):
        train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"), "loss_type": "cell_loss"},
              progress=False)
    assert not (tmp_path / "run").exists()


def test_a_metric_defined_in_the_notebook_is_refused_where_best_metric_names_it(registered_in_notebook, shard,
                                                                                no_worker_starts, tmp_path):
    with pytest.raises(ParamError, match=r"best_metric 'cell_right/addition': the metric 'cell_right', "
                                         r"__main__:cell_right, cannot be imported .* define it " + WORKERS_IMPORT):
        train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
               "best_metric": "cell_right/addition"}, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_curriculum_refuses_a_later_stages_loss_before_its_first_stage(registered_in_notebook, shard,
                                                                        no_worker_starts, tmp_path):
    (tmp_path / "curriculum.yaml").write_text("version: 1\nstages:\n  - name: first\n  - name: second\n"
                                              "    loss_type: cell_loss\n")
    with pytest.raises(ParamError, match=r"loss_type 'cell_loss': its loss __main__:CellLoss cannot be imported"):
        train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
               "curriculum": str(tmp_path / "curriculum.yaml")}, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_metric_it_does_not_name_is_said_left_out_of_the_workers_evaluations(registered_in_notebook, shard,
                                                                               tmp_path):
    run = prepare(TrainParams.from_dict({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run")}))
    assert run.worker_imports == {"losses": {}, "metrics": {}, "left_out": ["cell_right"], "attention_backends": {}}
    assert "workers      leave out metric cell_right (not importable by name" in run.describe()
    assert not (tmp_path / "run").exists()


def test_a_worker_names_what_it_cannot_import():
    with pytest.raises(ParamError, match=r"loss_type 'gone': this worker cannot import no_such_module:Loss "
                                         r"\(ModuleNotFoundError: .*\); define it " + WORKERS_IMPORT):
        register_carried({"losses": {"gone": "no_such_module:Loss"}, "metrics": {}})
    assert "gone" not in sft_loss.LOSSES


@pytest.mark.slow
def test_two_processes_import_a_registered_loss_and_metric_and_record_where_from(registered, sum_right, shard,
                                                                                tmp_path, monkeypatch):
    # The workers find extending_helpers as a user's would find their module: on PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    record = train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"), "eval_every_steps": 1,
                    "loss_type": "smoothed", "best_metric": "sum_right/addition"}, progress=False)
    assert record["world_size"] == 2 and record["kernel_path"]["loss"] == "smoothed_chunked_ce"
    assert record["registered"] == {"loss_type": {"smoothed": "extending_helpers:SmoothedLoss"},
                                    "metrics": {"sum_right": "extending_helpers:first_number_right"},
                                    "attention_backends": {}}
    assert all("sum_right/addition" in evaluation["metrics"] for evaluation in record["eval"]["history"])
    assert record["best_metric"]["name"] == "sum_right/addition" and record["best_metric"]["step"] is not None



@pytest.fixture
def backends_registered():
    """The page's backend, and one auto tries, from a module of their own (extending_helpers), registered in this
    process as a notebook would."""
    register_backend(math_backend)
    register_backend(auto_math_backend)
    yield
    for name in ("math", "auto_math"):
        attention.BACKENDS.pop(name, None)


@pytest.mark.slow
@pytest.mark.parametrize("requested, kernel", [("math", "math_sdpa"), ("auto", "auto_math_sdpa")])
def test_two_processes_attend_with_a_backend_registered_in_the_notebook(backends_registered, shard, tmp_path,
                                                                        monkeypatch, requested, kernel):
    """Named, or tried by auto, a registered backend reaches torchrun's workers: rank 0's record says they attended
    with it, as one process does. Without it the workers refused 'math' as unknown, and auto quietly attended with
    SDPA (torch_sdpa) where one process took auto_math."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    record = train({**TWO_PROCESSES, "exact_match_limit": 0, "data": str(shard), "out_dir": str(tmp_path / "run"),
                    "attention_backend": requested}, progress=False)
    assert record["world_size"] == 2 and record["kernel_path"]["attention"] == kernel
    carried = {"math": "extending_helpers:math_backend"} if requested == "math" else {
        "auto_math": "extending_helpers:auto_math_backend"}
    assert record["registered"]["attention_backends"] == carried


def test_a_backend_is_carried_by_the_name_its_module_binds_it_to(backends_registered, shard, tmp_path):
    assert backend_import_path(math_backend) == "extending_helpers:math_backend"
    assert backend_import_path(replace(math_backend, name="copy")) is None  # an instance no module binds
    params = TrainParams.from_dict({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
                                    "attention_backend": "math"})
    carried = for_workers(params)
    assert carried["attention_backends"] == {"math": "extending_helpers:math_backend"}  # auto_math: never tried
    assert for_workers(replace(params, attention_backend="auto"))["attention_backends"] == {
        "auto_math": "extending_helpers:auto_math_backend"}
    assert for_workers(replace(params, attention_backend="sdpa_mask"))["attention_backends"] == {}
    assert "workers      import attention_backend math (extending_helpers:math_backend)" in prepare(params).describe()
    for name in ("math", "auto_math"):
        attention.BACKENDS.pop(name)
    register_carried(carried)  # as a worker does, before it reads its parameters
    assert attention.BACKENDS["math"] is math_backend
    assert TrainParams.from_dict(asdict(params)).attention_backend == "math"
    assert not (tmp_path / "run").exists()


WORKERS_BIND = (r"; define it in a module they can import \(a \.py file in the notebook's folder, or on "
                r"PYTHONPATH\), bound to a name at module level there \(`my_backend = Backend\(\.\.\.\)`\), and "
                r"register it from there")


@pytest.mark.parametrize("requested, words", [
    ("cell_math", r"attention_backend 'cell_math': the registered backend is defined as __main__:cell_math, a name "
                  r"the 2 worker processes cannot import it by" + WORKERS_BIND + "$"),
    ("auto", r"attention_backend 'auto' tries the registered backend 'cell_math', which is defined as "
             r"__main__:cell_math, a name the 2 worker processes cannot import it by" + WORKERS_BIND
             + ", or name a built-in attention_backend$"),
])
def test_a_backend_defined_in_the_notebook_is_refused_before_any_worker_starts(shard, no_worker_starts, tmp_path,
                                                                               monkeypatch, requested, words):
    """A Jupyter kernel's cells run in the module `__main__` (sys.modules' own, also filed as `__mp_main__` once
    multiprocessing is imported): a backend made there is bound to a name no worker can import. Named, or tried by auto, it is refused before out_dir is touched."""
    notebook = types.ModuleType("__main__")
    exec("from cflib.ops.attention import Backend\nfrom extending_helpers import math_backend\n"
         "cell_math = Backend('cell_math', 'SDPA math, in a cell', math_backend.dense, None, math_backend.problem, "
         "auto_for=(False,))\n", notebook.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    monkeypatch.setitem(sys.modules, "__mp_main__", notebook)  # as multiprocessing files it in a Jupyter kernel
    register_backend(notebook.cell_math)
    try:
        with pytest.raises(ParamError, match=words):
            train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
                   "attention_backend": requested}, progress=False)
    finally:
        attention.BACKENDS.pop("cell_math")
    assert not (tmp_path / "run").exists()


def test_a_backend_no_module_binds_is_refused_as_one(shard, no_worker_starts, tmp_path):
    register_backend(replace(math_backend, name="unbound"))
    try:
        with pytest.raises(ParamError, match=r"attention_backend 'unbound': the registered backend is bound to no "
                                             r"module-level name the 2 worker processes could import it by"
                                             + WORKERS_BIND):
            train({**TWO_PROCESSES, "data": str(shard), "out_dir": str(tmp_path / "run"),
                   "attention_backend": "unbound"}, progress=False)
    finally:
        attention.BACKENDS.pop("unbound")
    assert not (tmp_path / "run").exists()


def test_a_worker_names_the_backend_it_cannot_import_or_that_is_no_backend():
    with pytest.raises(ParamError, match=r"attention_backend 'gone': this worker cannot import no_such_module:b "
                                         r"\(ModuleNotFoundError: .*\); define it " + WORKERS_IMPORT):
        register_carried({"attention_backends": {"gone": "no_such_module:b"}})
    with pytest.raises(ParamError, match=r"attention_backend 'other': extending_helpers:math_backend is the backend "
                                         r"'math' in this worker"):
        register_carried({"attention_backends": {"other": "extending_helpers:math_backend"}})
    assert "gone" not in attention.BACKENDS and "other" not in attention.BACKENDS
