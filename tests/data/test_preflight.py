"""Preflight: the shard against its manifest and the model, chunked token checks, release readiness."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from sft_shard_helpers import CHATS, VOCAB, chat_example, chat_examples, write_shard

import cflib.data.shards
from cflib.data.preflight import preflight
from cflib.data.shards import Example, ShardError, open_shard


def edit_index(partition: Path, change) -> None:
    path = partition / "sft.idx.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_a_clean_shard_is_release_ready(tmp_path):
    root = write_shard(tmp_path / "s", chat_examples())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard, report = preflight(root, "train", vocab_size=VOCAB, seq_len=64, require_release_ready=True)
    assert report["release_ready"] and report["findings"] == []
    assert report["sha256_verified"] == ["examples.jsonl", "input_ids.bin", "labels.bin"]
    assert report["examples"] == len(CHATS) and report["supervised_tokens"] == shard.supervised_tokens()


def test_a_changed_file_is_fatal_even_when_still_a_valid_shard(tmp_path):
    root = write_shard(tmp_path / "s", chat_examples())
    rows = (root / "train" / "examples.jsonl").read_text().replace('"addition"', '"sums"')
    (root / "train" / "examples.jsonl").write_text(rows)
    with pytest.raises(ShardError, match="examples.jsonl: sha256 .* does not match"):
        preflight(root, "train", vocab_size=VOCAB, seq_len=64)


def unended_examples() -> list[Example]:
    """Examples whose final EOS was cut off: what truncation leaves."""
    examples = []
    for example in chat_examples():
        labels = list(example.labels[:-1])
        labels[-1] = -100
        examples.append(Example(example.input_ids[:-1], labels, example.meta))
    return examples


def test_text_after_a_taught_eos_is_whole_not_truncated(tmp_path):
    """ChatML-style templates put a newline after the end of each turn: the example ends in that text, its last
    taught token is EOS, and the shard is release-ready."""
    newline = 10
    trailing = [Example(list(e.input_ids) + [newline], list(e.labels[:-1]) + [-100, -100], e.meta)
                for e in chat_examples()]  # the newline after EOS untaught
    assert all(e.input_ids[-1] == newline and e.labels[-3] == e.input_ids[-2] for e in trailing)
    root = write_shard(tmp_path / "s", trailing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = preflight(root, "train", vocab_size=VOCAB, seq_len=64, require_release_ready=True)
    assert report["release_ready"]


@pytest.mark.parametrize("build, finding", [
    (lambda t: write_shard(t, unended_examples()), "5 examples neither end with EOS 0 nor teach it last (first: row 0"),
    (lambda t: _edited(t, lambda d: {k: v for k, v in d.items() if k != "sha256"}), "records no sha256 for"),
    (lambda t: _edited(t, lambda d: {k: v for k, v in d.items() if k != "max_seq_len"}), "no sequence cap"),
    (lambda t: _edited(t, lambda d: {**d, "supervised_tokens": 1}), "says supervised_tokens 1, labels.bin"),
    (lambda t: _edited(t, lambda d: {**d, "truncated_examples": 3}), "declares 3 truncated examples"),
    (lambda t: write_shard(t, chat_examples(), vocab_size=VOCAB - 1), f"differs from the model's {VOCAB}"),
])
def test_manifest_findings_warn_and_are_fatal_when_release_ready(tmp_path, build, finding):
    root = build(tmp_path / "s")
    with pytest.warns(UserWarning, match=re.escape(finding)):
        _, report = preflight(root, "train", vocab_size=VOCAB, seq_len=64)
    assert not report["release_ready"]
    with pytest.raises(ShardError, match=f"not release-ready .*{re.escape(finding)}"):
        preflight(root, "train", vocab_size=VOCAB, seq_len=64, require_release_ready=True)


def _edited(root: Path, change) -> Path:
    """A shard whose sft.idx.json was edited and its hashes left alone (none cover the index itself)."""
    write_shard(root, chat_examples())
    edit_index(root / "train", change)
    return root


def test_token_checks_run_in_chunks_and_name_the_row_in_a_later_chunk(tmp_path, monkeypatch):
    examples = chat_examples() * 3
    bad = chat_example(99, "addition", "carry", "1+1=", "22")
    bad.labels[-2] = 7  # the EOS target replaced: not the next input token
    root = write_shard(tmp_path / "s", examples + [bad], examples)
    whole = open_shard(root, "eval").supervised_counts
    monkeypatch.setattr(cflib.data.shards, "VALIDATION_CHUNK_TOKENS", 10)  # each chunk about one example
    np.testing.assert_array_equal(open_shard(root, "eval").supervised_counts, whole)
    with pytest.raises(ShardError, match="row 15 \\(example_id 'addition-099'\\): label 7 at position"):
        open_shard(root, "train")
    # A process that only counts (a torchrun worker, after its launcher's preflight) skips the token checks.
    counted = open_shard(root, "train", check_tokens=False)
    assert counted.supervised_counts[15] == sum(1 for label in bad.labels if label != -100)
