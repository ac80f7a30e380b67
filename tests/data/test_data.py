"""cflib.data: writing, opening, validating and batching SFT token shards."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cflib.data.shards import SHARD_FORMAT, Example, ShardError, collate, open_shard, sha256_file, write_partition

try:
    import sft_shard_helpers as h
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h

FILES = ("input_ids.bin", "labels.bin", "examples.jsonl")


def shard_error(root: Path, partition: str = "train", **kwargs) -> str:
    with pytest.raises(ShardError) as excinfo:
        open_shard(root, partition, **kwargs)
    return str(excinfo.value)


def assert_names(message: str, file: str, row: int | None = None, example_id: str | None = None) -> None:
    assert file in message, message
    if row is not None:
        assert re.search(rf"\brow {row}\b", message), message
    if example_id is not None:
        assert example_id in message, message


# --- round trip -----------------------------------------------------------------------------------

def test_round_trip_items_rows_and_index(tmp_path):
    examples = h.chat_examples() + [h.two_turn_example()]
    h.write_shard(tmp_path, examples)
    shard = open_shard(tmp_path, "train", vocab_size=h.VOCAB, seq_len=h.MAX_SEQ_LEN, verify_hashes=True)

    assert len(shard) == len(examples)
    for (ids, labels), example in zip((shard[i] for i in range(len(shard))), examples):
        assert ids.dtype == labels.dtype == torch.int64
        assert ids.tolist() == list(example.input_ids)
        assert labels.tolist() == list(example.labels)

    part = tmp_path / "train"
    rows = h.read_jsonl(part / "examples.jsonl")
    offset = 0
    for row, example in zip(rows, examples):
        assert row["offset"] == offset
        assert row["num_tokens"] == len(example.input_ids)
        assert row["supervised_tokens"] == h.supervised_count(example)
        for key, value in example.meta.items():
            assert row[key] == value
        offset += len(example.input_ids)

    index = json.loads((part / "sft.idx.json").read_text())
    assert index["format"] == SHARD_FORMAT == "complexity-sft-token-shard-v2"
    assert index["vocab_size"] == h.VOCAB
    assert index["eos_token_id"] == h.EOS
    assert index["max_seq_len"] == h.MAX_SEQ_LEN
    assert index["examples"] == len(examples)
    assert index["num_tokens"] == offset
    assert index["sha256"] == {name: sha256_file(part / name) for name in FILES}
    # The binary layout is the public one: uint32 ids and int32 labels, little-endian.
    flat_ids = [t for example in examples for t in example.input_ids]
    flat_labels = [t for example in examples for t in example.labels]
    assert np.fromfile(part / "input_ids.bin", dtype="<u4").tolist() == flat_ids
    assert np.fromfile(part / "labels.bin", dtype="<i4").tolist() == flat_labels


def test_write_partition_generates_example_ids_when_meta_has_none(tmp_path):
    plain = [Example(e.input_ids, e.labels, {"task": e.meta["task"]}) for e in h.chat_examples()[:2]]
    write_partition(tmp_path / "train", plain, vocab_size=h.VOCAB, eos_token_id=h.EOS, max_seq_len=h.MAX_SEQ_LEN)
    ids = [row["example_id"] for row in h.read_jsonl(tmp_path / "train" / "examples.jsonl")]
    assert len(set(ids)) == 2 and all(isinstance(i, str) and i for i in ids)


def _failing_examples():
    examples = h.chat_examples()
    yield examples[0]
    yield examples[1]
    raise RuntimeError("tokenizer crashed")


def test_write_partition_is_atomic(tmp_path):
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        write_partition(tmp_path / "train", _failing_examples(), vocab_size=h.VOCAB, eos_token_id=h.EOS,
                        max_seq_len=h.MAX_SEQ_LEN)
    assert list(tmp_path.iterdir()) == []  # no partition, no staging directory


def test_failed_rewrite_keeps_the_previous_partition(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    before = {name: sha256_file(tmp_path / "train" / name) for name in FILES}
    with pytest.raises(RuntimeError):
        write_partition(tmp_path / "train", _failing_examples(), vocab_size=h.VOCAB, eos_token_id=h.EOS,
                        max_seq_len=h.MAX_SEQ_LEN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "train"]
    assert {name: sha256_file(tmp_path / "train" / name) for name in FILES} == before
    assert len(open_shard(tmp_path, "train")) == len(h.CHATS)


def test_write_partition_rejects_length_mismatch(tmp_path):
    bad = Example([5, 6, 7], [6, 7], {})
    with pytest.raises(ShardError, match="example 0"):
        write_partition(tmp_path / "train", [bad], vocab_size=h.VOCAB, eos_token_id=h.EOS, max_seq_len=8)
    assert list(tmp_path.iterdir()) == []


# --- bad shards: each fails on open, naming the file and the row --------------------------------

def _with_example(index: int, example: Example) -> list[Example]:
    """The good examples with the one at `index` replaced (its example_id kept)."""
    examples = h.chat_examples()
    example.meta.setdefault("example_id", examples[index].meta["example_id"])
    examples[index] = example
    return examples


def _unshifted(example: Example) -> Example:
    """labels[j] = input_ids[j] on the answer positions: the classic off-by-one."""
    ids = list(example.input_ids)
    first = next(j for j, label in enumerate(example.labels) if label != -100) + 1
    labels = [-100] * first + ids[first:]
    return Example(ids, labels, dict(example.meta))


def test_truncated_input_ids(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    path = tmp_path / "train" / "input_ids.bin"
    path.write_bytes(path.read_bytes()[:-4])
    assert_names(shard_error(tmp_path), "input_ids.bin")


def test_labels_not_causally_aligned(tmp_path):
    example = h.chat_examples()[1]
    h.write_shard(tmp_path, _with_example(1, _unshifted(example)))
    assert_names(shard_error(tmp_path), "labels.bin", row=1, example_id="reverse-001")


def _with_token(token: int) -> list[Example]:
    example = h.chat_examples()[2]
    ids = list(example.input_ids)
    ids[1] = token  # a prompt position: its label is -100, the previous label is -100 too
    return _with_example(2, Example(ids, list(example.labels), dict(example.meta)))


@pytest.mark.parametrize("model_vocab", [None, h.VOCAB])
def test_token_id_outside_the_vocabulary(tmp_path, model_vocab):
    h.write_shard(tmp_path, _with_token(h.VOCAB))
    message = shard_error(tmp_path, vocab_size=model_vocab)
    assert_names(message, "input_ids.bin", row=2, example_id="addition-002")
    assert str(h.VOCAB) in message


def test_shard_vocab_larger_than_the_model_vocab(tmp_path):
    """Model vocab 200 < shard vocab 260: the shard may hold ids the model cannot embed."""
    h.write_shard(tmp_path, h.chat_examples())
    message = shard_error(tmp_path, vocab_size=200)
    assert_names(message, "sft.idx.json")
    assert "200" in message and "260" in message


def test_token_id_outside_the_shards_own_vocab_even_if_the_model_is_larger(tmp_path):
    """The shard declares vocab_size 260 yet holds id 270: it contradicts its own index.

    A bigger model vocabulary (300) must not make such a shard pass.
    """
    h.write_shard(tmp_path, _with_token(270))
    message = shard_error(tmp_path, vocab_size=300)
    assert_names(message, "input_ids.bin", row=2, example_id="addition-002")


def test_example_without_supervised_tokens(tmp_path):
    example = h.chat_examples()[3]
    silent = Example(list(example.input_ids), [-100] * len(example.labels), dict(example.meta))
    h.write_shard(tmp_path, _with_example(3, silent))
    message = shard_error(tmp_path)
    assert_names(message, "labels.bin", row=3, example_id="reverse-003")


@pytest.mark.parametrize("bad_label", [-5, -1, h.VOCAB, h.VOCAB + 1000])
def test_label_value_out_of_range(tmp_path, bad_label):
    example = h.chat_examples()[4]
    labels = list(example.labels)
    labels[-1] = bad_label  # the last position (target of nothing): only the range check can catch it
    h.write_shard(tmp_path, _with_example(4, Example(list(example.input_ids), labels, dict(example.meta))))
    message = shard_error(tmp_path)
    assert_names(message, "labels.bin", row=4, example_id="addition-004")
    assert str(bad_label) in message


def _long_example() -> Example:
    return h.chat_example(1, "reverse", "long", "reverse abcdefghijklmnopqrstuvwx", "xwvutsrqponmlkjihgfedcba")


def test_example_longer_than_the_shard_cap(tmp_path):
    examples = _with_example(1, _long_example())
    assert len(examples[1].input_ids) > 40 > max(len(e.input_ids) for i, e in enumerate(examples) if i != 1)
    h.write_shard(tmp_path, examples, max_seq_len=40)
    message = shard_error(tmp_path)
    assert_names(message, "examples.jsonl", row=1, example_id="reverse-001")
    assert "40" in message


def test_example_longer_than_seq_len(tmp_path):
    examples = _with_example(1, _long_example())
    h.write_shard(tmp_path, examples, max_seq_len=64)
    assert len(open_shard(tmp_path, "train", seq_len=64)) == len(examples)  # fits the shard's cap
    message = shard_error(tmp_path, seq_len=40)
    assert_names(message, "examples.jsonl", row=1, example_id="reverse-001")
    assert "seq_len" in message


def test_examples_longer_than_seq_len_are_counted_and_the_longest_named_where_its_data_has_it(tmp_path):
    """The longest of them, by its shard row, its example_id and where the converter read it (rows from 1)."""
    examples = _with_example(1, _long_example())
    longest = h.chat_example(3, "reverse", "long", "reverse " + "abcdefghijklmnopqrstuvwxyz" * 2, "z" * 52)
    examples[3] = Example(longest.input_ids, longest.labels, {**longest.meta, "origin": "chats.jsonl row 4"})
    h.write_shard(tmp_path, examples, max_seq_len=200)
    message = shard_error(tmp_path, seq_len=40)
    assert (f"examples.jsonl: 2 example(s) exceed seq_len 40, the longest row 3 (example_id 'reverse-003', read "
            f"from chats.jsonl row 4) with {len(longest.input_ids)} tokens") in message
    assert f"raise seq_len to {len(longest.input_ids)}" in message


def _edit_jsonl(root: Path, edit) -> None:
    path = root / "train" / "examples.jsonl"
    path.write_text("".join(line + "\n" for line in edit(path.read_text().splitlines())))


def test_examples_jsonl_row_count_differs_from_the_index(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    _edit_jsonl(tmp_path, lambda lines: lines[:-1])
    message = shard_error(tmp_path)
    assert_names(message, "examples.jsonl")
    assert str(len(h.CHATS) - 1) in message and str(len(h.CHATS)) in message


def test_non_json_line_in_examples_jsonl(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    _edit_jsonl(tmp_path, lambda lines: lines[:2] + ['{"offset": 3, oops'] + lines[3:])
    assert_names(shard_error(tmp_path), "examples.jsonl", row=2)


def test_json_line_that_is_not_an_object(tmp_path):
    """Valid JSON that is not an object is a bad row too: ShardError, not an AttributeError."""
    h.write_shard(tmp_path, h.chat_examples())
    _edit_jsonl(tmp_path, lambda lines: lines[:2] + ["[1, 2, 3]"] + lines[3:])
    assert_names(shard_error(tmp_path), "examples.jsonl", row=2)


def test_wrong_format(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    path = tmp_path / "train" / "sft.idx.json"
    index = json.loads(path.read_text())
    index["format"] = "complexity-sft-token-shard-v1"
    path.write_text(json.dumps(index))
    message = shard_error(tmp_path)
    assert_names(message, "sft.idx.json")
    assert "complexity-sft-token-shard-v1" in message


def test_missing_index(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    (tmp_path / "train" / "sft.idx.json").unlink()
    assert_names(shard_error(tmp_path), "sft.idx.json")


def test_missing_partition(tmp_path):
    write_partition(tmp_path / "train", h.chat_examples(), vocab_size=h.VOCAB, eos_token_id=h.EOS, max_seq_len=48)
    assert len(open_shard(tmp_path, "train")) == len(h.CHATS)
    assert_names(shard_error(tmp_path, "eval"), str(tmp_path / "eval"))


def test_missing_root(tmp_path):
    missing = tmp_path / "no-such-root"
    assert_names(shard_error(missing), str(missing))


def test_unknown_partition(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    assert "'validation'" in shard_error(tmp_path, "validation")


# --- hashes -------------------------------------------------------------------------------------

def test_verify_hashes_detects_a_change_that_is_still_a_valid_shard(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    path = tmp_path / "train" / "input_ids.bin"
    ids = np.fromfile(path, dtype="<u4")
    labels = np.fromfile(tmp_path / "train" / "labels.bin", dtype="<i4")
    assert labels[0] == -100  # so no alignment check looks at token 1, a prompt token
    ids[1] = ids[1] + 1 if ids[1] + 1 < 260 else ids[1] - 1  # still in the vocabulary
    ids.tofile(path)

    assert len(open_shard(tmp_path, "train")) == len(h.CHATS)  # structurally fine...
    message = shard_error(tmp_path, verify_hashes=True)  # ...but not what was written
    assert_names(message, "input_ids.bin")
    assert "sha256" in message


# --- batching and counting ----------------------------------------------------------------------

def test_collate_right_pads_with_ignored_labels():
    a = (torch.tensor([5, 6, 7]), torch.tensor([-100, 7, 0]))
    b = (torch.tensor([8, 9, 10, 11, 12]), torch.tensor([-100, -100, 11, 12, 0]))
    input_ids, labels = collate([a, b], pad_token_id=3)
    assert input_ids.dtype == labels.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7, 3, 3], [8, 9, 10, 11, 12]]
    assert labels.tolist() == [[-100, 7, 0, -100, -100], [-100, -100, 11, 12, 0]]


def test_supervised_tokens_counts_labels(tmp_path):
    examples = h.chat_examples() + [h.two_turn_example()]
    h.write_shard(tmp_path, examples)
    shard = open_shard(tmp_path, "train")
    counts = [int((shard[i][1] != -100).sum()) for i in range(len(shard))]
    assert counts == [h.supervised_count(e) for e in examples]
    assert shard.supervised_tokens() == sum(counts)
    assert shard.supervised_tokens([1, 5, 1]) == counts[1] + counts[5] + counts[1]


def test_supervised_tokens_without_the_metadata_column(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())

    def drop(lines):
        rows = [json.loads(line) for line in lines]
        return [json.dumps({k: v for k, v in row.items() if k != "supervised_tokens"}) for row in rows]

    _edit_jsonl(tmp_path, drop)
    shard = open_shard(tmp_path, "train")
    assert shard.supervised_tokens() == sum(h.supervised_count(e) for e in h.chat_examples())
    assert shard.supervised_tokens([2]) == h.supervised_count(h.chat_examples()[2])


def test_supervised_tokens_metadata_that_disagrees_with_labels(tmp_path):
    """supervised_tokens is the loss denominator: a shard whose metadata miscounts must
    either be refused on open (naming examples.jsonl) or be counted from labels.bin."""
    h.write_shard(tmp_path, h.chat_examples())

    def miscount(lines):
        rows = [json.loads(line) for line in lines]
        rows[0]["supervised_tokens"] += 1  # e.g. a writer that also counted the assistant marker
        return [json.dumps(row) for row in rows]

    _edit_jsonl(tmp_path, miscount)
    with pytest.warns(UserWarning, match="row 0 says supervised_tokens"):
        shard = open_shard(tmp_path, "train")
    assert shard.supervised_tokens() == sum(h.supervised_count(e) for e in h.chat_examples())


def test_eos_outside_the_vocabulary(tmp_path):
    h.write_shard(tmp_path, h.chat_examples())
    index_path = tmp_path / "train" / "sft.idx.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "eos_token_id": index["vocab_size"]}))
    with pytest.raises(ShardError, match="eos_token_id 260 is not a token id below vocab_size 260"):
        open_shard(tmp_path, "train")
