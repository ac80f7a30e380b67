"""Mixing shard roots (cflib.data.mixture): the sources parsed and refused by name, the partitions read as one and
checked against each other, each epoch's draw: its shares, its repetition, its determinism.

The shares of a whole epoch are exact, not sampled: each source draws its share of examples_per_epoch rounded by
largest remainders, so an epoch's share of a source is within 1/examples_per_epoch of its weight (a tighter bound than
the binomial 4-sigma of drawing each example's source at random). What is random is where a source's examples fall in
the epoch (the draws are shuffled together): a stretch of k of the epoch's N examples holds a hypergeometric count of
the source's K, checked against its mean within 5 standard deviations (a chance of about 6e-7 each of failing by luck,
so about 1e-5 for the twelve stretches checked; at 4 standard deviations one of them, 4.2 off, would fail: such
stretches do occur. The seeds are fixed, so a pass is reproducible, and the bound says the seeds were not chosen to
pass).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from mixture_helpers import task_root, task_roots

from cflib.data.marker_template import ChatTemplate
from cflib.data.mixture import (
    MixedPartition,
    check_agreement,
    data_sources,
    plan_mixture,
    source_names,
)
from cflib.data.shards import open_shard
from cflib.data.tasks import TASKS, ensure_embedded_shard, generate
from cflib.errors import ParamError

EMBEDDED = [count for _, count in TASKS.values()]  # addition 14,000, uppercase 8,000 train examples


def plan(weights=(0.8, 0.2), available=EMBEDDED, examples_per_epoch=None, seed=0):
    names = [f"s{i}" for i in range(len(weights))]
    return plan_mixture(names, [f"/data/{name}" for name in names], weights, available, examples_per_epoch, seed)


@pytest.mark.parametrize("weights, per_epoch", [((0.8, 0.2), 1000), ((0.7, 0.3), 999), ((1, 1, 1), 100),
                                                ((5, 3, 2), 7), ((0.5, 0.25, 0.25), 22_000)])
def test_each_source_draws_its_share_of_the_epoch_rounded_to_add_up(weights, per_epoch):
    drawn = plan(weights, [50] * len(weights), per_epoch).per_epoch
    assert drawn.sum() == per_epoch
    exact = per_epoch * np.asarray(weights) / sum(weights)
    assert (np.abs(drawn - exact) < 1).all()


def test_an_epoch_of_the_embedded_tasks_at_0_8_0_2_has_the_weights_as_its_shares():
    mixture = plan()  # 22,000 an epoch: addition 17,600 of its 14,000 (repeated), uppercase 4,400 of 8,000
    record = mixture.record()["sources"]
    assert [s["per_epoch"] for s in record] == [17_600, 4_400]
    assert [s["with_repetition"] for s in record] == [True, False]
    for epoch in (1, 2, 7):
        order = mixture.epoch(epoch)
        source = (order >= EMBEDDED[0]).astype(int)
        assert len(order) == 22_000 and abs(1 - source.mean() - 0.8) <= 1 / len(order)
        # Any stretch of the epoch: hypergeometric around its expected count, within 5 sigma.
        population, successes = len(order), int((source == 0).sum())
        for start, k in ((0, 64), (1000, 512), (0, 11_000), (20_000, 2_000)):
            count = int((source[start:start + k] == 0).sum())
            p = successes / population
            sigma = math.sqrt(k * p * (1 - p) * (population - k) / (population - 1))
            assert abs(count - k * p) <= 5 * sigma, (epoch, start, k, count, k * p, sigma)


def test_every_example_of_a_source_is_seen_once_before_any_is_seen_again():
    mixture = plan((0.3, 0.7), [10, 1000], examples_per_epoch=10)  # source 0 draws 3 of its 10 an epoch
    stream = np.concatenate([mixture.draw(0, epoch) for epoch in range(1, 21)])  # 60 draws: six passes
    for cycle in range(6):
        assert sorted(stream[cycle * 10:(cycle + 1) * 10]) == list(range(10))
    assert len({tuple(stream[c * 10:(c + 1) * 10]) for c in range(6)}) == 6  # each pass its own shuffle


def test_a_source_smaller_than_its_share_is_drawn_with_repetition():
    mixture = plan((0.5, 0.5), [7, 100], examples_per_epoch=60)  # source 0: 30 of 7 an epoch
    record = mixture.record()["sources"][0]
    assert record["with_repetition"] and record["passes_per_epoch"] == pytest.approx(30 / 7)
    counts = np.bincount(mixture.draw(0, 1), minlength=7)
    assert set(counts) <= {4, 5} and counts.sum() == 30  # whole passes, then part of one
    epoch = mixture.epoch(1)
    assert (epoch < 7).sum() == 30 and len(np.unique(epoch[epoch >= 7])) == 30  # the larger one never repeats


def test_the_draw_is_a_function_of_the_seed_and_the_epoch():
    first = plan(seed=3).epoch(2)
    assert np.array_equal(first, plan(seed=3).epoch(2))
    assert not np.array_equal(first, plan(seed=4).epoch(2))
    assert not np.array_equal(first, plan(seed=3).epoch(3))


def test_an_empty_source_or_one_that_draws_nothing_is_named():
    with pytest.raises(ParamError, match=r"source 's1' \(/data/s1\) has no train example"):
        plan(available=[100, 0])
    with pytest.raises(ParamError, match=r"source 's1' \(/data/s1\) at weight 0.01 draws no example of the 10"):
        plan((0.99, 0.01), [100, 100], examples_per_epoch=10)


@pytest.mark.parametrize("value, message", [
    ([{"path": "a", "weight": 0}, {"path": "b", "weight": 0}], r"data: every source has weight 0"),
    ([{"path": "a", "weight": float("nan")}], r"data\[0\].weight \(a\) must be a finite number >= 0 .*, got nan"),
    ([{"path": "a", "weight": float("inf")}], r"data\[0\].weight \(a\) must be a finite number >= 0 .*, got inf"),
    ([{"path": "a", "weight": -1}], r"data\[0\].weight \(a\) must be a finite number >= 0"),
    ([{"path": "a", "weight": True}], r"data\[0\].weight \(a\) must be a finite number >= 0 .*, got True"),
    ([{"path": "a", "weight": "0.5"}], r"data\[0\].weight \(a\) must be a finite number >= 0 .*, got '0.5'"),
    ([{"path": "a"}], r"data\[0\].weight \(a\) must be a finite number >= 0 .*, got None"),
    ([{"path": "a", "weight": 1, "wieght": 2}], r"data\[0\]: unknown key 'wieght'"),
    ([{"weight": 1}], r"data\[0\].path must name a shard root: train/ and eval/, or eval/ alone for a source of "
                      r"weight 0 \(evaluated, never trained on\), got None"),
    ([{"path": "x/a", "weight": 1}, {"path": "x/./a/", "weight": 2}], r"data\[1\]: x/./a/ is data\[0\] too"),
    ([{"path": "x/a", "weight": 1}, {"path": "y/b", "weight": 2, "name": "a"}],
     r"data\[1\] \(y/b\) and data\[0\] \(x/a\) are both named 'a'"),
    ([], r"data must be \"embedded\", a shard root, or a non-empty list"),
    (["a", "b"], r"data\[0\] must be a mapping"),
    ([{"path": f"r{index}", "weight": 1} for index in range(1025)], r"data: 1,025 sources, more than the 1,024"),
    ("[" + "[" * 200 + "]" * 200 + "]", r"data: .*nest"),  # papermill's text, bounded before it is read
    ("- &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"- &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, "
                                                  f"*{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(12)),
     r"data: .*alias"),
])
def test_bad_sources_are_refused_naming_the_entry(value, message):
    with pytest.raises(ParamError, match=message):
        data_sources("data", value)


def test_sources_read_from_papermill_text_and_named_by_folder_or_path():
    sources = data_sources("data", "[{path: x/addition, weight: 0.7}, {path: y/addition, weight: 0.3}, "
                                   "{path: z/up, weight: 1, name: upper}]")
    assert [s["weight"] for s in sources] == [0.7, 0.3, 1.0]
    assert source_names(sources) == ["x/addition", "y/addition", "upper"]  # one folder name twice: the paths
    two = data_sources("data", [{"path": "x/a", "weight": 1}, {"path": "x/b", "weight": 1}])
    assert source_names(two) == ["a", "b"]
    assert data_sources("data", "outputs/data/my-shard") == "outputs/data/my-shard"


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    return task_roots(tmp_path_factory.mktemp("roots"), {"addition": 30, "uppercase": 12}, held_out=6)


def test_a_mixed_partition_keys_examples_by_source_and_index(roots):
    parts = [open_shard(roots[task], "train") for task in ("addition", "uppercase")]
    ids = [row["example_id"] for part in parts for row in part.rows]
    assert len(set(ids)) < len(ids)  # both conversions number their rows train-00000000, ...: ids collide
    mixed = MixedPartition(parts, ["addition", "uppercase"])
    assert len(mixed) == 42 and list(mixed.starts) == [0, 30, 42]
    assert mixed[31][0].tolist() == parts[1][1][0].tolist() and mixed[2][0].tolist() == parts[0][2][0].tolist()
    assert mixed.supervised_tokens() == sum(part.supervised_tokens() for part in parts)
    kept = mixed.only_tasks(["uppercase"])
    assert [len(part) for part in kept.parts] == [0, 12] and kept[0][0].tolist() == parts[1][0][0].tolist()


def disagreeing(root: Path, folder: Path, **manifest) -> Path:
    """A copy of `root` whose manifests say otherwise for these keys."""
    copy = shutil.copytree(root, folder)
    for partition in ("train", "eval"):
        index = copy / partition / "sft.idx.json"
        index.write_text(json.dumps({**json.loads(index.read_text()), **manifest}))
    return copy


def test_sources_that_disagree_on_what_a_token_means_are_refused_naming_key_and_roots(roots, tmp_path):
    base = open_shard(roots["addition"], "train")
    cases = {"vocab_size": disagreeing(roots["uppercase"], tmp_path / "vocab", vocab_size=300),
             "eos_token_id": disagreeing(roots["uppercase"], tmp_path / "eos", eos_token_id=3),
             "chat template sha256": task_root(tmp_path, "uppercase", 12, 6, template=ChatTemplate(turn_end="\n"))}
    for key, other in cases.items():
        with pytest.raises(ParamError, match=rf"source 'other' \({other}\) has {key} .*, source 'addition' "
                                             rf"\({roots['addition']}\) has"):
            check_agreement(["addition", "other"], [roots["addition"], other], [base, open_shard(other, "train")])
    check_agreement(["addition", "uppercase"], [roots["addition"], roots["uppercase"]],
                    [base, open_shard(roots["uppercase"], "train")])  # one tokenizer, one template: they agree


def test_the_embedded_tasks_mix_with_data_the_byte_tokenizer_converted(roots, tmp_path):
    """The embedded shard records the conversion its tokens are: a converted example is the same tokens."""
    embedded = ensure_embedded_shard(tmp_path)
    converted = open_shard(roots["addition"], "train")
    check_agreement(["embedded", "addition"], [embedded, roots["addition"]], [open_shard(embedded, "train"), converted])
    example = next(e for e in generate(seed=3)[0] if e.meta["task"] == "addition")  # task_root's first
    assert [t.tolist() for t in converted[0]] == [list(example.input_ids), list(example.labels)]


def test_a_source_of_weight_0_is_held_out_only():
    """It draws no example (none needed), the others share the epoch, and the record says so."""
    held = plan((0.75, 0.25, 0.0), [30, 10, 0], examples_per_epoch=None)
    assert held.per_epoch.tolist() == [30, 10, 0] and held.examples_per_epoch == 40
    assert all(held.epoch(epoch).max() < 40 for epoch in (1, 2))  # never an index of the third source
    source = held.record()["sources"][2]
    assert (source["held_out_only"], source["passes_per_epoch"], source["share"]) == (True, 0.0, 0.0)
    assert held.multiplicity().tolist() == [1.0] * 40
    with pytest.raises(ParamError, match="source 's1' .* has no train example .* give it weight 0 to evaluate"):
        plan((0.75, 0.25), [30, 0])
