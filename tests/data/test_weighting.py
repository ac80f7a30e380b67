"""Full-shard 2-D loss weighting: the rules, the coefficients, and training that reaches the targets."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sft_shard_helpers import task_shard

from cflib.data.weighting import audit_table, derive_loss_weights, parse_loss_groups
from cflib.train import train
from cflib.train.params import ParamError, TrainParams, load_params_file
from cflib.train.records import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ISSUE_EXAMPLE = {
    "natural_conversation": {"target_share": 0.20, "tasks": ["casual_social", "conversation_empathy"],
                             "task_target_shares": {"casual_social": 0.70, "conversation_empathy": 0.30}},
    "instruction": {"target_share": 0.80, "tasks": ["grounded_qa"], "task_target_shares": {"grounded_qa": 1.0}},
}
ROWS = [{"task": "casual_social"}] * 6 + [{"task": "conversation_empathy"}] * 2 + [{"task": "grounded_qa"}] * 2
VISIBLE = np.array([10] * 6 + [10] * 2 + [20] * 2)  # 60, 20 and 40 of 120 visible supervised tokens


def test_coefficients_are_group_target_times_cell_target_over_raw_share():
    weights = derive_loss_weights(ISSUE_EXAMPLE, ROWS, VISIBLE, 30.0)
    raw = np.array([60, 20, 40]) / 120
    targets = np.array([0.2 * 0.7, 0.2 * 0.3, 0.8 * 1.0])
    np.testing.assert_allclose(weights.coefficients, targets / raw)
    np.testing.assert_array_equal(weights.example_weights(), (targets / raw)[[0] * 6 + [1] * 2 + [2] * 2])
    audit = weights.audit()
    assert [row["cell"] for row in audit] == ["casual_social", "conversation_empathy", "grounded_qa"]
    np.testing.assert_allclose([row["raw_share"] for row in audit], raw)
    np.testing.assert_allclose([row["achieved_share"] for row in audit], targets)
    assert [row["examples"] for row in audit] == [6, 2, 2]
    row = "| natural_conversation | casual_social | 6 | 0.5000 | 0.200 | 0.700 | 0.1400 | 0.280 | 0.1400 |"
    assert row in audit_table(audit)


def test_a_cell_may_be_task_by_domain_and_domain_falls_back_to_group():
    groups = {"g": {"target_share": 1.0, "tasks": ["qa x science", "qa x history"],
                    "task_target_shares": {"qa x science": 0.5, "qa x history": 0.5}}}
    rows = [{"task": "qa", "domain": "science"}, {"task": "qa", "group": "history"},
            {"task": "qa", "domain": "history"}]
    weights = derive_loss_weights(groups, rows, np.array([10, 5, 5]), 30.0)
    assert weights.example_cell.tolist() == [0, 1, 1]
    np.testing.assert_allclose(weights.coefficients, [1.0, 1.0])


@pytest.mark.parametrize("change, message", [
    (lambda g: g["instruction"].update(target_share=0.7), "target_share values sum to 0.9, not 1"),
    (lambda g: g["natural_conversation"]["task_target_shares"].update(casual_social=0.6),
     "'natural_conversation': task_target_shares sum to 0.9, not 1"),
    (lambda g: g["natural_conversation"]["task_target_shares"].pop("conversation_empathy"),
     "missing \\['conversation_empathy'\\]"),
    (lambda g: g["instruction"]["task_target_shares"].update(poetry=0.0), "not in tasks \\['poetry'\\]"),
    (lambda g: g["instruction"]["tasks"].append("grounded_qa"), "'grounded_qa' appears twice in its tasks"),
    (lambda g: g["instruction"]["tasks"].append("casual_social"),
     "'casual_social' appears in groups 'natural_conversation' and 'instruction'"),
    (lambda g: g["instruction"].update(weight=2), "unknown key\\(s\\) \\['weight'\\]"),
    (lambda g: g["instruction"].update(target_share="most"), "target_share must be a number"),
    (lambda g: g["instruction"].update(tasks=[]), "non-empty list of task names"),
])
def test_malformed_loss_groups_are_refused_naming_the_fault(change, message):
    groups = json.loads(json.dumps(ISSUE_EXAMPLE))
    change(groups)
    with pytest.raises(ParamError, match=message):
        parse_loss_groups(groups)


def test_a_task_is_weighted_whole_or_by_domain_not_both():
    groups = {"g": {"target_share": 1.0, "tasks": ["qa", "qa x science"],
                    "task_target_shares": {"qa": 0.5, "qa x science": 0.5}}}
    with pytest.raises(ParamError, match="'qa x science' overlaps cell 'qa'"):
        parse_loss_groups(groups)


def test_the_cap_stops_a_coefficient_above_it_and_admits_one_at_it():
    weights = derive_loss_weights(ISSUE_EXAMPLE, ROWS, VISIBLE, 30.0)
    top = float(weights.coefficients.max())  # grounded_qa: 0.8 / (40/120) = 2.4
    assert derive_loss_weights(ISSUE_EXAMPLE, ROWS, VISIBLE, top + 1e-9).coefficients.max() == top
    with pytest.raises(ParamError, match="'grounded_qa' \\(group 'instruction'\\) would get loss coefficient 2.40"):
        derive_loss_weights(ISSUE_EXAMPLE, ROWS, VISIBLE, 2.0)


def test_loss_groups_arrive_from_yaml_a_papermill_string_and_a_notebook_dict():
    from_yaml = TrainParams.from_dict(load_params_file(ROOT / "params" / "smoke_weighted.yaml"))
    assert from_yaml.loss_groups["text"]["tasks"] == ["uppercase"] and from_yaml.pack_sequences
    as_string = TrainParams.from_dict({"loss_groups": json.dumps(ISSUE_EXAMPLE)})
    assert as_string.loss_groups == ISSUE_EXAMPLE
    namespace = {"loss_groups": ISSUE_EXAMPLE, "max_task_loss_weight": 10, "record": {"a": 1}, "lr": 0.01}
    params = TrainParams.from_namespace(namespace)  # a later cell's record dict is not a parameter
    assert params.loss_groups == ISSUE_EXAMPLE and params.max_task_loss_weight == 10.0
    with pytest.raises(ParamError, match="loss_groups must be a mapping"):
        TrainParams.from_dict({"loss_groups": "[1, 2]"})
    with pytest.raises(ParamError, match="max_task_loss_weight must be positive"):
        TrainParams.from_dict({"max_task_loss_weight": 0})


FAST = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 0, "device": "cpu", "eval_at_start": False, "save_checkpoints": False}


@pytest.fixture(scope="module")
def shard48(tmp_path_factory) -> Path:
    """48 train examples: three whole global batches of 16, so an epoch has no fill-in."""
    return task_shard(tmp_path_factory.mktemp("weighted"), 48, 8)


GROUPS = {"arithmetic": {"target_share": 0.3, "tasks": ["addition x carry", "addition x no-carry"],
                         "task_target_shares": {"addition x carry": 0.5, "addition x no-carry": 0.5}},
          "text": {"target_share": 0.7, "tasks": ["uppercase"], "task_target_shares": {"uppercase": 1.0}}}


def test_whole_epochs_train_exactly_the_target_shares(tmp_path, shard48):
    record = train({**FAST, "data": str(shard48), "out_dir": str(tmp_path / "run"), "max_steps": None,
                    "epochs": 2, "loss_groups": GROUPS}, progress=False)
    cells = record["loss_weighting"]["cells"]
    assert record["schedule"]["fill_ins_per_epoch"] == [0, 0]
    for cell in cells:  # every example consumed once per epoch: the trained mass is the targeted one
        assert cell["trained_share"] == pytest.approx(cell["target_share"], abs=1e-12)
        assert cell["coefficient"] == pytest.approx(cell["target_share"] / cell["raw_share"])
    assert record["kernel_path"]["loss"] == "torch_chunked_linear_ce_weighted"
    audit = json.loads((tmp_path / "run" / "loss_weighting.json").read_text())  # written before the first step
    assert [c["cell"] for c in audit["cells"]] == [c["cell"] for c in cells]
    assert "trained_share" not in audit["cells"][0]


def test_coefficients_of_one_train_exactly_like_no_weighting(tmp_path, shard48):
    from cflib.data.shards import open_shard

    shard = open_shard(shard48, "train")
    tasks = np.array([row["task"] for row in shard.rows])
    raw = {task: shard.supervised_counts[tasks == task].sum() / shard.supervised_tokens() for task in set(tasks)}
    groups = {task: {"target_share": float(share), "tasks": [task], "task_target_shares": {task: 1.0}}
              for task, share in raw.items()}
    plain = train({**FAST, "data": str(shard48), "out_dir": str(tmp_path / "plain"), "max_steps": 4}, progress=False)
    weighted = train({**FAST, "data": str(shard48), "out_dir": str(tmp_path / "weighted"), "max_steps": 4,
                      "loss_groups": groups}, progress=False)
    np.testing.assert_allclose([c["coefficient"] for c in weighted["loss_weighting"]["cells"]], 1.0, rtol=1e-12)
    losses = [[r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["event"] == "train"]
              for name in ("plain", "weighted")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert plain["eval"]["final"]["loss"] == pytest.approx(weighted["eval"]["final"]["loss"], rel=1e-5)
