"""cflib.data.tokenizer and cflib.data.tasks: the byte tokenizer and the embedded data set."""
from __future__ import annotations

import json
import re

import pytest

from cflib.data import tasks
from cflib.data.shards import open_shard
from cflib.data.tokenizer import IGNORE_INDEX, ByteTokenizer

TOK = ByteTokenizer()


# --- tokenizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "12+34=", "reverse hello", "héllo wörld", "日本語 ☃ 🙂", "tab\tnewline\n\x00"])
def test_encode_decode_round_trip(text):
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(TOK.num_special <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


def test_decode_skips_special_tokens():
    ids = TOK.encode_prompt("ab") + TOK.encode("c") + [TOK.eos_token_id]
    assert TOK.decode(ids) == "abc"


def test_encode_chat_is_causally_aligned():
    prompt, answer = "reverse héllo", "olléh"
    input_ids, labels = TOK.encode_chat(prompt, answer)
    prompt_ids = TOK.encode_prompt(prompt)
    answer_ids = TOK.encode(answer) + [TOK.eos_token_id]

    assert input_ids == prompt_ids + answer_ids
    assert prompt_ids[0] == TOK.user_token_id and prompt_ids[-1] == TOK.assistant_token_id
    assert len(labels) == len(input_ids)
    supervised = [j for j, label in enumerate(labels) if label != IGNORE_INDEX]
    # The position of the assistant marker predicts the first answer token; EOS is the last target.
    assert supervised == list(range(len(prompt_ids) - 1, len(input_ids) - 1))
    assert all(labels[j] == input_ids[j + 1] for j in supervised)
    assert [labels[j] for j in supervised] == answer_ids
    assert labels[-1] == IGNORE_INDEX
    assert TOK.decode([labels[j] for j in supervised]) == answer


# --- the embedded data set ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated():
    return tasks.generate()


def test_generate_is_deterministic(generated):
    again = tasks.generate()
    for first, second in zip(generated, again):
        assert len(first) == len(second)
        assert all(a.input_ids == b.input_ids and a.labels == b.labels and a.meta == b.meta
                   for a, b in zip(first, second))


def test_generate_sizes_tasks_and_groups(generated):
    train, held_out = generated
    expected_groups = {"addition": {"carry", "no-carry"}, "uppercase": {"repeats", "distinct"}}
    assert set(tasks.TASKS) == set(expected_groups)
    for task, groups in expected_groups.items():
        for split, count in ((train, tasks.TASKS[task][1]), (held_out, tasks.EVAL_PER_TASK)):
            rows = [e.meta for e in split if e.meta["task"] == task]
            assert len(rows) == count
            assert {row["group"] for row in rows} == groups
    for split in (train, held_out):
        assert len({e.meta["example_id"] for e in split}) == len(split)


def test_eval_prompts_never_occur_in_train(generated):
    train, held_out = generated
    train_prompts = {e.meta["prompt"] for e in train}
    assert not train_prompts & {e.meta["prompt"] for e in held_out}
    # Nor does the same token sequence sneak in under another prompt string.
    train_ids = {tuple(e.input_ids) for e in train}
    assert not any(tuple(e.input_ids) in train_ids for e in held_out)


def _digit_sum(n: int) -> int:
    return sum(int(d) for d in str(n))


def test_answers_groups_and_tokens_are_right(generated):
    for example in generated[0] + generated[1]:
        meta = example.meta
        prompt, answer = meta["prompt"], meta["answer"]
        if meta["task"] == "addition":
            a, b = map(int, re.fullmatch(r"(\d{3})\+(\d{3})=", prompt).groups())
            assert answer == f"{a + b:04d}"  # zero-padded to four digits
            # Each carry loses 9 from the digit sum: a carry happened iff the sums differ.
            carried = _digit_sum(a) + _digit_sum(b) != _digit_sum(a + b)
            assert meta["group"] == ("carry" if carried else "no-carry")
        else:
            word = re.fullmatch(r"upper ([a-z]{6})", prompt).group(1)
            assert answer == word.upper()
            assert meta["group"] == ("repeats" if len(set(word)) < len(word) else "distinct")
        # The tokens say what the metadata says.
        assert (list(example.input_ids), list(example.labels)) == TOK.encode_chat(prompt, answer)


def test_every_example_fits_the_sequence_cap(generated):
    assert max(len(e.input_ids) for e in generated[0] + generated[1]) <= tasks.MAX_SEQ_LEN


# --- the embedded shard on disk -----------------------------------------------------------------

def _stamps(root):
    return {p.relative_to(root): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_ensure_embedded_shard_writes_once_and_repairs(tmp_path):
    root = tasks.ensure_embedded_shard(tmp_path)
    assert root == tmp_path / tasks.EMBEDDED_VERSION
    train = open_shard(root, "train", vocab_size=TOK.vocab_size, seq_len=tasks.MAX_SEQ_LEN, verify_hashes=True)
    held_out = open_shard(root, "eval", vocab_size=TOK.vocab_size, seq_len=tasks.MAX_SEQ_LEN, verify_hashes=True)
    assert len(train) == sum(count for _, count in tasks.TASKS.values())
    assert len(held_out) == len(tasks.TASKS) * tasks.EVAL_PER_TASK
    assert train.max_seq_len == tasks.MAX_SEQ_LEN and train.eos_token_id == TOK.eos_token_id
    first_eval = tasks.generate()[1][0]
    assert held_out[0][0].tolist() == list(first_eval.input_ids)
    assert held_out.rows[0]["task"] == first_eval.meta["task"]

    stamps = _stamps(root)
    assert tasks.ensure_embedded_shard(tmp_path) == root
    assert _stamps(root) == stamps  # reused: nothing rewritten

    labels = root / "eval" / "labels.bin"
    good = labels.read_bytes()
    labels.write_bytes(good[:-8] + b"\xff" * 8)  # damaged, same size
    assert tasks.ensure_embedded_shard(tmp_path) == root
    assert labels.read_bytes() == good  # rewritten
    open_shard(root, "eval", verify_hashes=True)
    for damaged, text in (("sft.idx.json", "{not json"), ("examples.jsonl", "")):  # an index, the rows
        (root / "train" / damaged).write_text(text)
        assert tasks.ensure_embedded_shard(tmp_path) == root
        assert len(open_shard(root, "train", verify_hashes=True)) == len(train)  # rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == [tasks.EMBEDDED_VERSION]
    assert sorted(p.name for p in root.iterdir()) == ["eval", "train"]  # no staging leftovers


def test_a_shard_written_before_its_index_recorded_the_conversion_gains_it_and_keeps_its_data(tmp_path):
    """Runs on it resume (the data's hashes are its files'), and it mixes with data the byte tokenizer converted."""
    root = tasks.ensure_embedded_shard(tmp_path)
    for partition in ("train", "eval"):
        index = root / partition / "sft.idx.json"
        written = json.loads(index.read_text())
        index.write_text(json.dumps({key: value for key, value in written.items() if key != "conversion"}))
    data = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != "sft.idx.json"}
    assert tasks.ensure_embedded_shard(tmp_path) == root
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != "sft.idx.json"} == data
    for partition in ("train", "eval"):
        assert json.loads((root / partition / "sft.idx.json").read_text())["conversion"] == tasks.conversion()
