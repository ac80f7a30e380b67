"""Semantic loss metadata (loss_metadata.jsonl) and the example filters that read it."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from sft_shard_helpers import VOCAB, chat_examples, read_jsonl, write_shard
from test_convert import EVAL, chat, run_convert

from cflib.data.filters import parse_filters, select
from cflib.data.preflight import preflight
from cflib.data.shards import ShardError, open_shard
from cflib.data.tasks import difficulty, ensure_embedded_shard
from cflib.errors import ParamError


def test_the_converter_writes_the_semantic_fields_beside_the_index_and_the_reader_merges_them(tmp_path):
    train = [chat("12+34=", "46", task="addition", domain="math", difficulty="easy", mode="direct"),
             chat("reverse abc", "cba", task="reverse", difficulty="hard")]
    run_convert(tmp_path, train)
    folder = tmp_path / "shard" / "train"
    sidecar = read_jsonl(folder / "loss_metadata.jsonl")
    index = read_jsonl(folder / "examples.jsonl")
    assert [row["example_id"] for row in sidecar] == [row["example_id"] for row in index]
    assert sidecar[0] == {"example_id": index[0]["example_id"], "domain": "math", "difficulty": "easy",
                          "mode": "direct"}
    assert not {"domain", "difficulty", "mode"} & set(index[0])  # the index holds offsets, the sidecar semantics
    shard, report = preflight(tmp_path / "shard", "train", vocab_size=VOCAB, seq_len=64)
    assert [row.get("difficulty") for row in shard.rows] == ["easy", "hard"]
    assert shard.rows[0]["domain"] == "math" and report["loss_metadata"] == ["difficulty", "domain", "mode"]
    assert "loss_metadata.jsonl" in report["sha256_verified"]


def test_a_chat_row_with_a_non_string_difficulty_is_refused(tmp_path):
    with pytest.raises(Exception, match="'difficulty' must be a string"):
        run_convert(tmp_path, [chat("12+34=", "46", task="addition", difficulty=3)], EVAL)


def write_sidecar(folder: Path, rows: list[dict]) -> None:
    (folder / "loss_metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows[:-1], r"1 example\(s\) of examples.jsonl have no row \(first 'addition-004'\)"),
    (lambda rows: rows + [{"example_id": "stray", "difficulty": "easy"}], r"1 row\(s\) name no example .*'stray'"),
    (lambda rows: rows + rows[:1], "appears twice"),
    (lambda rows: [{**rows[0], "offset": 3}, *rows[1:]], "sets 'offset', which only examples.jsonl holds"),
    (lambda rows: [{**rows[0], "task": "other"}, *rows[1:]], "says task 'other', examples.jsonl says 'addition'"),
])
def test_a_sidecar_whose_ids_differ_from_the_index_fails_the_preflight(tmp_path, change, message):
    root = write_shard(tmp_path / "s", chat_examples())
    rows = [{"example_id": row["example_id"], "difficulty": "easy"} for row in read_jsonl(root / "train" /
                                                                                            "examples.jsonl")]
    write_sidecar(root / "train", change(rows))
    with pytest.raises(ShardError, match=message):
        preflight(root, "train", vocab_size=VOCAB, seq_len=64)


def test_the_embedded_data_grades_its_examples_by_carries():
    assert [difficulty("addition", p) for p in ("012+034=", "019+001=", "099+001=", "999+999=")] == [
        "easy", "medium", "hard", "hard"]
    assert difficulty("uppercase", "upper abcdef") == "easy"


def test_the_embedded_shard_carries_a_difficulty_sidecar(tmp_path):
    shard = open_shard(ensure_embedded_shard(tmp_path), "train", verify_hashes=True)
    counts = Counter((row["task"], row["difficulty"]) for row in shard.rows)
    assert counts == {("uppercase", "easy"): 8000, ("addition", "hard"): 6593, ("addition", "medium"): 5112,
                      ("addition", "easy"): 2295}


ROWS = [{"task": "a", "difficulty": "easy", "group": "g1"}, {"task": "a", "difficulty": "hard", "domain": "d2"},
        {"task": "b", "difficulty": "easy", "group": "g1"}, {"task": "b", "difficulty": "medium", "group": "g2"},
        {"task": "a", "difficulty": "medium", "group": "g1"}]
SUPERVISED = np.array([3, 9, 4, 5, 2])


def test_filters_apply_in_order_and_count_what_each_keeps():
    keep, counts = select(ROWS, SUPERVISED, parse_filters(
        {"difficulties": ["easy", "medium"], "domains": ["g1", "g2"], "max_supervised_tokens": 4}, "f"), seed=0)
    assert keep.tolist() == [0, 2, 4]
    assert counts == {"examples": 5, "difficulties": 4, "domains": 4, "max_supervised_tokens": 3, "kept": 3}
    keep, counts = select(ROWS, SUPERVISED, parse_filters({"tasks": "a", "max_examples": "all"}, "f"), seed=0)
    assert keep.tolist() == [0, 1, 4] and counts == {"examples": 5, "tasks": 3, "kept": 3}


def test_max_examples_is_a_seeded_choice_kept_in_order():
    rows, counts = [{"task": "a"}] * 50, np.ones(50, dtype=np.int64)
    first, _ = select(rows, counts, parse_filters({"max_examples": 10}, "f"), seed=3)
    assert first.tolist() == sorted(first.tolist()) and len(set(first.tolist())) == 10
    assert np.array_equal(first, select(rows, counts, parse_filters({"max_examples": 10}, "f"), seed=3)[0])
    assert not np.array_equal(first, select(rows, counts, parse_filters({"max_examples": 10}, "f"), seed=4)[0])


@pytest.mark.parametrize("raw, message", [
    ({"difficulty": ["easy"]}, "unknown filter 'difficulty'"),
    ({"tasks": []}, "tasks must be a non-empty list"),
    ({"max_supervised_tokens": 0}, "max_supervised_tokens must be a positive integer"),
    ({"max_examples": "most"}, "max_examples must be a positive integer"),
    (["easy"], "must be a mapping"),
])
def test_bad_filters_are_named(raw, message):
    with pytest.raises(ParamError, match=message):
        parse_filters(raw, "f")
