"""Chat JSONL -> shard: templates, supervision, rejections, manifest, tokenizers, failures, round trip."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cflib.data.__main__ import main as data_main
from cflib.data.conversation import Conversation, ConvertError, conversation_digest
from cflib.data.convert import (ConvertParams, ConvertSpec, ConvertWarning, SeenConversations, convert, show_example,
                                spec_from_args, summary)
from cflib.data.marker_template import ChatTemplate
from cflib.data.packing import collate_packed, pack_examples
from cflib.data.preflight import manifest_findings
from cflib.data.rendering import make_renderer
from cflib.data.shards import IGNORE_INDEX, ShardError, collate, open_shard, sha256_file
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer
from cflib.errors import ParamError

convert_module = importlib.import_module("cflib.data.convert")  # the package exports its function by that name

ROOT = Path(__file__).resolve().parents[2]
BYTES = ByteTokenizer()


def chat(*turns: str, **meta) -> dict:
    """Alternating user/assistant turns (a leading 'system:' turn is the system prompt)."""
    messages = []
    for turn in turns:
        if turn.startswith("system:"):
            messages.append({"role": "system", "content": turn[len("system:"):]})
        else:
            messages.append({"role": "user" if len([m for m in messages if m["role"] != "system"]) % 2 == 0
                             else "assistant", "content": turn})
    return {"messages": messages, **meta}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


TRAIN = [chat("12+34=", "46", task="addition", group="no-carry", source="unit"),
         chat("reverse abc", "cba", task="reverse", group="short"),
         chat("system:be brief", "hi", "hello", "reverse dog", "god", task="dialog")]
EVAL = [chat("58+67=", "125", task="addition", group="carry")]


def run_convert(tmp_path: Path, train: list, eval_: list | None = None, name: str = "shard", overwrite: bool = False,
                **spec) -> dict:
    files = {"train": write_jsonl(tmp_path / f"{name}-train.jsonl", train),
             "eval": write_jsonl(tmp_path / f"{name}-eval.jsonl", EVAL if eval_ is None else eval_)}
    return convert(ConvertSpec(train=str(files["train"]), eval=str(files["eval"]), out=str(tmp_path / name),
                               **{"max_seq_len": 64, **spec}), overwrite=overwrite)


def test_default_template_with_bytes_is_the_embedded_encoding(tmp_path):
    run_convert(tmp_path, TRAIN)
    shard = open_shard(tmp_path / "shard", "train")
    ids, labels = shard[0]
    want_ids, want_labels = BYTES.encode_chat("12+34=", "46")
    assert ids.tolist() == want_ids and labels.tolist() == want_labels
    assert shard.rows[0]["task"] == "addition" and shard.rows[0]["group"] == "no-carry"
    assert shard.rows[0]["source"] == "unit" and shard.rows[0]["example_id"] == "train-00000001"


def supervised_text(ids: torch.Tensor, labels: torch.Tensor) -> str:
    """The supervised tokens, as the model must produce them (labels are already shifted)."""
    return BYTES.decode([int(t) for t in labels if t != IGNORE_INDEX])


@pytest.mark.parametrize("supervise, answers", [("final_turn", "god"), ("all_assistant_turns", "hellogod")])
def test_supervision_covers_the_final_or_every_assistant_turn(tmp_path, supervise, answers):
    run_convert(tmp_path, TRAIN, supervise=supervise)
    ids, labels = open_shard(tmp_path / "shard", "train")[2]
    assert ids.tolist() == ([BYTES.system_token_id] + BYTES.encode("be brief") + [BYTES.user_token_id]
                            + BYTES.encode("hi") + [BYTES.assistant_token_id] + BYTES.encode("hello") + [0]
                            + [BYTES.user_token_id] + BYTES.encode("reverse dog") + [BYTES.assistant_token_id]
                            + BYTES.encode("god") + [0])
    assert supervised_text(ids, labels) == answers
    assert int((labels == 0).sum()) == (2 if supervise == "all_assistant_turns" else 1)  # supervised EOS


def test_rejections_are_counted_and_the_manifest_records_everything(tmp_path):
    long_chat = chat("x" * 70, "too long")
    train = TRAIN + [TRAIN[0], chat("say nothing", "   "), long_chat, chat("hello?", "")]
    eval_ = EVAL + [TRAIN[1], EVAL[0]]
    indexes = run_convert(tmp_path, train, eval_)
    stats = indexes["train"]["conversion"]["stats"]
    assert stats["rows_read"] == 7 and indexes["train"]["examples"] == 3
    assert stats["rejected"] == {"too_long": 1, "duplicate": 1, "duplicate_of_train": 0, "empty_answer": 2}
    assert stats["truncated_examples"] == 0
    assert stats["examples_per_task"] == {"addition": 1, "dialog": 1, "reverse": 1}
    assert indexes["eval"]["conversion"]["stats"]["rejected"] == {
        "too_long": 0, "duplicate": 1, "duplicate_of_train": 1, "empty_answer": 0}
    for partition, index in indexes.items():
        folder = tmp_path / "shard" / partition
        shard = open_shard(tmp_path / "shard", partition, verify_hashes=True)
        assert index["supervised_tokens"] == shard.supervised_tokens()
        assert (index["vocab_size"], index["eos_token_id"], index["max_seq_len"]) == (BYTES.vocab_size, 0, 64)
        assert index["sha256"] == {name: sha256_file(folder / name)
                                   for name in ("input_ids.bin", "labels.bin", "examples.jsonl", "loss_metadata.jsonl")}
        source = tmp_path / f"shard-{partition}.jsonl"
        assert index["conversion"]["stats"]["sources"] == [
            {"name": f"shard-{partition}", "spec": str(source), "format": "auto", "columns": {},
             "rows_read": 7 if partition == "train" else 3,
             "files": [{"path": str(source), "sha256": sha256_file(source)}]}]
        assert index["conversion"]["template"] == {"kind": "markers", **vars(ChatTemplate())}
    assert indexes["train"]["conversion"]["stats"]["examples_per_source"] == {"shard-train": 2, "unit": 1}


def rendered_length(row: dict) -> int:
    """The tokens a chat row renders to through the byte tokenizer and the default markers."""
    renderer = make_renderer("byte", ChatTemplate(), "all_assistant_turns")
    return len(renderer.render(Conversation(row["messages"]))[0])


THREE = chat("system:be brief", "hi", "hello", "reverse dog", "god", "and abc?", "cba", task="dialog")
TWO = chat("system:be brief", "hi", "hello", "reverse dog", "god", task="dialog")  # THREE without its last exchange


def test_a_default_conversion_writes_the_tokens_it_wrote_before_overflow_existed(tmp_path):
    """overflow: reject is the default: the same ids and labels, byte for byte, as the converter wrote before the
    option (hashes taken with that code), with no truncation declared."""
    rows = TRAIN + [chat("x" * 70, "too long"), THREE]
    indexes = run_convert(tmp_path, rows, max_seq_len=40)
    assert sha256_file(tmp_path / "shard" / "train" / "input_ids.bin") == \
        "6cf617275edcc9b285a02995d1aaf0fd966636481c8d4213aee80e10b83d4c55"
    assert sha256_file(tmp_path / "shard" / "train" / "labels.bin") == \
        "e7ab7994b00a95d13cc6fe69d5ba8918275d7b4a81feb2963d81c27aebe9473d"
    conversion = indexes["train"]["conversion"]
    assert conversion["overflow"] == "reject" and conversion["stats"]["truncated_examples"] == 0
    assert conversion["stats"]["rejected"]["too_long"] == 2
    explicit = run_convert(tmp_path, rows, name="explicit", max_seq_len=40, overflow="reject")
    for name in ("input_ids.bin", "labels.bin", "loss_metadata.jsonl"):
        assert sha256_file(tmp_path / "explicit" / "train" / name) == sha256_file(tmp_path / "shard" / "train" / name)
    assert "truncated" not in summary(explicit)


@pytest.mark.parametrize("supervise, taught", [("all_assistant_turns", "hello<|eos|>god<|eos|>"),
                                               ("final_turn", "god<|eos|>")])
def test_drop_turns_keeps_the_longest_prefix_that_ends_after_a_whole_assistant_turn(tmp_path, supervise, taught):
    cap = rendered_length(TWO) + 5  # two exchanges fit, the third does not
    assert rendered_length(THREE) > cap
    first_too_long = chat("x" * cap, "y", "again", "z")
    indexes = run_convert(tmp_path, [THREE, first_too_long, TRAIN[0]], max_seq_len=cap, overflow="drop_turns",
                          supervise=supervise)
    run_convert(tmp_path, [TWO, TRAIN[0]], name="reference", max_seq_len=cap, supervise=supervise)
    shard, reference = open_shard(tmp_path / "shard", "train"), open_shard(tmp_path / "reference", "train")
    for row in range(2):
        assert [t.tolist() for t in shard[row]] == [t.tolist() for t in reference[row]]
    ids, labels = shard[0]
    assert BYTES.decode_template(ids.tolist()).endswith("<|user|>reverse dog<|assistant|>god<|eos|>")
    assert BYTES.decode_template([int(t) for t in labels if t != IGNORE_INDEX]) == taught
    assert shard.rows[0]["origin"].endswith("row 1") and shard.rows[0]["task"] == "dialog"
    conversion = indexes["train"]["conversion"]
    assert conversion["overflow"] == "drop_turns"
    assert conversion["stats"]["truncated_examples"] == 1 and conversion["stats"]["rejected"]["too_long"] == 1
    assert "truncated (turns dropped): 1" in summary(indexes).splitlines()[0]
    assert manifest_findings(shard, BYTES.vocab_size) == [
        "sft.idx.json declares 1 truncated examples (conversations kept without their last turns: overflow "
        "drop_turns)"]


@pytest.mark.parametrize("row, fitting", [
    ({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                 {"role": "user", "content": "x" * 40}], "completion": "y"},  # the cut may not fall in the prompt
     {"prompt": "hi", "completion": "hello"}),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": 0},
                   {"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}]},  # none taught
     TRAIN[0]),
    ({"text": "x" * 60}, {"text": "fits"}),  # no turns to drop
])
def test_drop_turns_rejects_what_has_no_whole_taught_answer_that_fits(tmp_path, row, fitting):
    indexes = run_convert(tmp_path, [row, fitting], max_seq_len=32, overflow="drop_turns")
    stats = indexes["train"]["conversion"]["stats"]
    assert stats["rejected"]["too_long"] == 1 and stats["truncated_examples"] == 0
    assert indexes["train"]["examples"] == 1


@pytest.mark.parametrize("supervise", ["all_assistant_turns", "final_turn"])
def test_drop_turns_never_keeps_a_prefix_that_ends_on_a_weight_0_turn(tmp_path, supervise):
    """A kept prefix's last turn is taught: one of weight 0 would cost length and teach nothing, even where an
    earlier turn is taught."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "skip me", "weight": 0},
                {"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y"}]
    cap = rendered_length({"messages": messages[:4]})
    indexes = run_convert(tmp_path, [{"messages": messages}, TRAIN[0]], max_seq_len=cap, overflow="drop_turns",
                          supervise=supervise)
    shard = open_shard(tmp_path / "shard", "train")
    ids, labels = shard[0]
    assert BYTES.decode_template(ids.tolist()).endswith("<|user|>hi<|assistant|>hello<|eos|>")
    assert BYTES.decode_template([int(t) for t in labels if t != IGNORE_INDEX]) == "hello<|eos|>"
    assert indexes["train"]["conversion"]["stats"]["truncated_examples"] == 1


@pytest.mark.parametrize("order, truncated", [((TWO, THREE), 0), ((THREE, TWO), 1)])
def test_the_turns_drop_turns_keeps_are_checked_for_duplicates(tmp_path, order, truncated):
    indexes = run_convert(tmp_path, list(order), max_seq_len=rendered_length(TWO), overflow="drop_turns")
    stats = indexes["train"]["conversion"]["stats"]
    assert indexes["train"]["examples"] == 1 and stats["rejected"]["duplicate"] == 1
    assert stats["truncated_examples"] == truncated


def sums(count: int) -> list[dict]:
    return [chat(f"{i}+{i}=", str(2 * i)) for i in range(count)]


def test_more_than_one_percent_rejected_as_too_long_warns_naming_the_partition_and_the_option(tmp_path):
    long_rows = [chat("x" * 70, f"long {i}") for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvertWarning)
        run_convert(tmp_path, sums(99) + long_rows[:1], name="one")  # 1 of 100: not more than 1%
    with pytest.warns(ConvertWarning) as caught:
        run_convert(tmp_path, sums(98) + long_rows, name="two")
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, ConvertWarning)]
    assert warning == ("train: 2 of 100 conversations (2.0%) are longer than max_seq_len 64 and were rejected "
                       "(too_long); raise max_seq_len (--max-seq-len), or keep their leading whole assistant turns "
                       "with overflow: drop_turns (--overflow drop_turns)")
    assert caught[0].filename == __file__  # attributed to the caller of convert
    with pytest.warns(ConvertWarning, match="^eval: 1 of 2 conversations .*with overflow: drop_turns, not even their "
                                            "first answer fits: raise max_seq_len"):
        run_convert(tmp_path, TRAIN, [EVAL[0], long_rows[0]], name="held", overflow="drop_turns")


def test_overflow_is_checked_and_read_from_a_spec_file_and_the_flag(tmp_path):
    with pytest.raises(ConvertError, match="overflow must be one of \\('reject', 'drop_turns'\\), got 'truncate'"):
        run_convert(tmp_path, TRAIN, overflow="truncate")
    assert not (tmp_path / "shard").exists()
    spec_file = tmp_path / "convert.yaml"
    spec_file.write_text(f"train: a.jsonl\neval: b.jsonl\nout: {tmp_path / 'x'}\noverflow: drop_turns\n")
    assert spec_from_args(["--spec", str(spec_file)])[0].overflow == "drop_turns"
    assert spec_from_args(["--spec", str(spec_file), "--overflow", "reject"])[0].overflow == "reject"
    assert ConvertParams.from_dict({"overflow": "drop_turns"}).spec().overflow == "drop_turns"


def test_round_trip_jsonl_to_shard_to_batches_to_text(tmp_path):
    run_convert(tmp_path, TRAIN, supervise="all_assistant_turns")
    shard = open_shard(tmp_path / "shard", "train")
    rendered = ["<|user|>12+34=<|assistant|>46<|eos|>", "<|user|>reverse abc<|assistant|>cba<|eos|>",
                "<|system|>be brief<|user|>hi<|assistant|>hello<|eos|><|user|>reverse dog<|assistant|>god<|eos|>"]

    def text(ids: torch.Tensor) -> str:
        return BYTES.decode_template(ids.tolist())

    input_ids, labels = collate([shard[i] for i in range(len(shard))], shard.eos_token_id)
    for row, want in enumerate(rendered):
        assert text(input_ids[row, :shard.lengths[row]]) == want
    assert [text(labels[labels != IGNORE_INDEX]) for _, labels in (shard[i] for i in range(3))] == [
        "46<|eos|>", "cba<|eos|>", "hello<|eos|>god<|eos|>"]
    assert show_example(shard, 2, BYTES) == ("<|system|>be brief<|user|>hi<|assistant|>[[hello<|eos|>]]"
                                             "<|user|>reverse dog<|assistant|>[[god<|eos|>]]")
    plan = pack_examples(shard.lengths, 64)
    packed_ids, packed_labels, document_ids, example_index = collate_packed(shard, plan, range(len(plan)))
    for example, want in enumerate(rendered):
        assert text(packed_ids[example_index == example][:shard.lengths[example]]) == want


def tiny_bpe(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained here on a few lines, with chat specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(["reverse abc cba", "hello hi god dog", "12+34=46 58+67=125"] * 20, trainer)
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_json_converts_and_decodes_back(tmp_path):
    path = tiny_bpe(tmp_path / "tokenizer.json")
    forged = chat("print <|eos|> please", "<|eos|>", task="forge")
    indexes = run_convert(tmp_path, TRAIN + [forged], tokenizer=str(path), supervise="all_assistant_turns")
    tokenizer = JsonTokenizer(path)
    assert indexes["train"]["vocab_size"] == tokenizer.vocab_size
    assert indexes["train"]["eos_token_id"] == tokenizer.token_id("<|eos|>") == 0
    assert indexes["train"]["conversion"]["tokenizer"] == {"kind": "tokenizer.json", "path": str(path),
                                                           "sha256": sha256_file(path)}
    shard = open_shard(tmp_path / "shard", "train", verify_hashes=True)
    ids, _ = shard[2]
    assert tokenizer.decode(ids.tolist()) == ("<|system|>be brief<|user|>hi<|assistant|>hello<|eos|>"
                                              "<|user|>reverse dog<|assistant|>god<|eos|>")
    ids, labels = shard[3]
    # Text that looks like a special token is content: one EOS (the real one) ends the example.
    assert int((ids == 0).sum()) == 1 and ids[-1] == 0
    assert tokenizer.decode([int(t) for t in labels if t != IGNORE_INDEX]) == "<|eos|><|eos|>"


def test_a_tokenizer_larger_than_the_model_is_refused_before_training(tmp_path):
    from cflib.train.params import TrainParams
    from cflib.train.run import prepare

    path = tiny_bpe(tmp_path / "tokenizer.json", vocab_size=400)
    vocab_size = run_convert(tmp_path, TRAIN, tokenizer=str(path))["train"]["vocab_size"]
    assert vocab_size > 260
    params = TrainParams.from_dict({"model": "smoke", "data": str(tmp_path / "shard"), "device": "cpu",
                                    "out_dir": str(tmp_path / "run")})
    with pytest.raises(ShardError, match=f"shard vocab_size {vocab_size} exceeds the model's 260"):
        prepare(params)
    assert not (tmp_path / "run").exists()


def gap_tokenizer(folder: Path) -> Path:
    """tiny_bpe with its EOS moved to id 5000: its ids leave a gap, so it has far fewer tokens than that."""
    doc = json.loads(tiny_bpe(folder / "trained.json").read_text())
    doc["model"]["vocab"]["<|eos|>"] = 5000
    next(token for token in doc["added_tokens"] if token["content"] == "<|eos|>")["id"] = 5000
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("given", ["tokenizer.json", "folder"])
def test_a_tokenizer_whose_ids_leave_a_gap_declares_a_vocabulary_past_its_largest_id(tmp_path, given):
    path = gap_tokenizer(tmp_path)
    if given == "folder":
        transformers = pytest.importorskip("transformers", reason="the data extra (pip install cflib[data])")
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|eos|>").save_pretrained(
            str(tmp_path / "folder"))
        path = tmp_path / "folder"
    indexes = run_convert(tmp_path, TRAIN, tokenizer=str(path))
    assert (indexes["train"]["eos_token_id"], indexes["train"]["vocab_size"]) == (5000, 5001)
    for partition in ("train", "eval"):
        shard = open_shard(tmp_path / "shard", partition)
        assert int(shard[0][0][-1]) == 5000  # each example ends with the EOS, inside the declared vocabulary


def test_rows_sharing_an_id_keep_it_as_row_id_beside_a_unique_example_id(tmp_path):
    """Rows repeating an id, one whose id is the id the converter gives another row, and an integer id: the shard
    opens, each example_id once (loss_metadata.jsonl joins on it), each row's own id kept as it was."""
    rows = [chat(f"{i}+{i}=", str(2 * i), id="same", domain="math") for i in range(3)]
    rows += [chat("reverse abc", "cba", id="train-00000002"), chat("reverse dog", "god", id=7), chat("hi", "hello")]
    run_convert(tmp_path, rows)
    shard = open_shard(tmp_path / "shard", "train", verify_hashes=True)
    assert [row["example_id"] for row in shard.rows] == [f"train-{n:08d}" for n in range(1, 7)]
    assert [row.get("row_id") for row in shard.rows] == ["same", "same", "same", "train-00000002", 7, None]
    assert [row.get("domain") for row in shard.rows] == ["math"] * 3 + [None] * 3  # loss_metadata.jsonl merged


def test_an_eval_fraction_that_holds_out_nothing_says_how_many_were_read_and_what_to_change(tmp_path):
    rows = [chat(f"{i}+{i}=", str(2 * i)) for i in range(40)]
    source = str(write_jsonl(tmp_path / "sums.jsonl", rows))
    with pytest.raises(ConvertError) as caught:
        convert(ConvertSpec(train=source, eval_fraction=0.001, out=str(tmp_path / "shard")))
    message = str(caught.value)
    assert message.startswith(f"eval: eval_fraction 0.001 sent none of the 40 conversations read from {source} to "
                              "eval (about 0.04 expected)"), message
    assert "raise eval_fraction (--eval-fraction), or give held-out sources (--eval" in message
    assert not (tmp_path / "shard").exists()


@pytest.mark.parametrize("row, message", [
    ("{not json", "shard-train.jsonl row 4: not valid JSON"),
    ('["a list"]', "shard-train.jsonl row 4: not a JSON object"),
    ({"messages": []}, "shard-train.jsonl row 4: messages: needs a non-empty list"),
    ({"text": "hi"}, "shard-train.jsonl row 4: no 'messages' field, which the messages format needs"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "message 0 needs a role in"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0 needs a role in"),
    (chat("hi", "hello", "and?"), "the last message is 'user'"),
    (chat("hi", "hello", task=7), "'task' must be a string"),
])
def test_malformed_rows_stop_the_conversion_naming_the_line_and_write_nothing(tmp_path, row, message):
    with pytest.raises(ConvertError, match=message):
        run_convert(tmp_path, TRAIN + [row])
    assert not (tmp_path / "shard").exists()
    assert not list(tmp_path.glob(".shard*"))  # no staging folder left behind


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="supervise must be one of"):
        run_convert(tmp_path, TRAIN, supervise="everything")
    with pytest.raises(ConvertError, match="has no token '<\\|end\\|>'"):
        run_convert(tmp_path, TRAIN, template=ChatTemplate(eos="<|end|>"))
    with pytest.raises(ConvertError, match="no such tokenizer.json"):
        run_convert(tmp_path, TRAIN, tokenizer=str(tmp_path / "missing.json"))
    (tmp_path / "garbage.json").write_text('{"model": "none"}')
    with pytest.raises(ConvertError, match="garbage.json: not a readable tokenizer.json"):
        run_convert(tmp_path, TRAIN, tokenizer=str(tmp_path / "garbage.json"))
    with pytest.raises(ConvertError, match="no conversation was accepted"):
        run_convert(tmp_path, [chat("x" * 80, "y")])
    with pytest.raises(ConvertError, match="unknown template key"):
        ChatTemplate.from_dict({"assistent": "A:"})
    run_convert(tmp_path, TRAIN)
    before = sha256_file(tmp_path / "shard" / "train" / "input_ids.bin")
    with pytest.raises(ConvertError, match="already exists"):
        run_convert(tmp_path, TRAIN[:1])
    with pytest.raises(ConvertError, match="not valid JSON"):  # overwrite allowed, but the input fails
        run_convert(tmp_path, TRAIN[:1] + ["{broken"], overwrite=True)
    assert sha256_file(tmp_path / "shard" / "train" / "input_ids.bin") == before  # the earlier shard is whole
    run_convert(tmp_path, TRAIN[:1], overwrite=True)
    assert open_shard(tmp_path / "shard", "train").index["examples"] == 1


def test_seen_conversations_are_remembered_per_partition(tmp_path):
    seen = SeenConversations(tmp_path)
    digests = [conversation_digest(Conversation([{"role": "user", "content": str(i)}])) for i in range(200)]
    assert all(seen.add("train", d) for d in digests) and not any(seen.add("train", d) for d in digests)
    assert seen.has("train", digests[7]) and not seen.has("eval", digests[7]) and seen.add("eval", digests[7])
    assert len(set(digests)) == 200 and all(-2**63 <= d < 2**63 for d in digests)
    seen.close()


@pytest.mark.slow
def test_command_line_with_a_spec_file(tmp_path):
    spec = tmp_path / "convert.yaml"
    spec.write_text(f"train: {ROOT / 'examples/chat/train.jsonl'}\neval: {ROOT / 'examples/chat/eval.jsonl'}\n"
                    f"out: {tmp_path / 'cli'}\nmax_seq_len: 128\nsupervise: final_turn\n")
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--spec", str(spec),
                           "--max-seq-len", "256"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "train 8 examples of 11 rows" in done.stdout and "too_long 1, duplicate 1" in done.stdout
    assert done.stderr == ("convert: warning: train: 1 of 11 conversations (9.1%) are longer than max_seq_len 256 "
                           "and were rejected (too_long); raise max_seq_len (--max-seq-len), or keep their leading "
                           "whole assistant turns with overflow: drop_turns (--overflow drop_turns)\n")
    index = json.loads((tmp_path / "cli" / "train" / "sft.idx.json").read_text())
    assert index["max_seq_len"] == 256 and index["conversion"]["supervise"] == "final_turn"
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--spec", str(spec)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "already exists" in done.stderr
    spec.write_text(spec.read_text() + "overwrite: true\n")  # as the notebook's parameter of that name
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--spec", str(spec)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--train", "a.jsonl"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "missing eval, out" in done.stderr
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--train", str(ROOT / "examples/chat/train.jsonl"),
                           "--eval", str(ROOT / "examples/chat/eval.jsonl"), "--out", str(tmp_path / "default")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr  # every assistant turn taught by default, as TRL's assistant_only_loss
    assert json.loads((tmp_path / "default" / "train" / "sft.idx.json").read_text())["conversion"]["supervise"] == \
        "all_assistant_turns"


def test_a_format_given_by_flag_is_named_as_such_when_a_row_lacks_its_fields(tmp_path):
    completions = [{"prompt": "12+34=", "completion": "46"}]
    with pytest.raises(ConvertError) as caught:
        run_convert(tmp_path, completions, format="messages")
    message = str(caught.value)
    assert "shard-train.jsonl row 1: no 'messages' field, which the messages format needs" in message
    assert "the format was given by --format messages; this row is prompt_completion" in message
    assert "first row was" not in message  # no first row chose a format that was named


def test_held_out_sources_and_a_held_out_fraction_given_together_are_refused(tmp_path):
    source = str(write_jsonl(tmp_path / "a.jsonl", TRAIN))
    with pytest.raises(ConvertError, match="--eval and --eval-fraction both give held-out data"):
        spec_from_args(["--train", source, "--eval", source, "--eval-fraction", "0.2", "--out", str(tmp_path / "x")])
    spec_file = tmp_path / "split.yaml"
    spec_file.write_text(f"train: {source}\neval_fraction: 0.2\nout: {tmp_path / 'x'}\n")
    spec, _ = spec_from_args(["--spec", str(spec_file), "--eval", source])  # flags win over the spec's keys
    assert (spec.eval, spec.eval_fraction) == ([source], None)
    spec_file.write_text(f"train: {source}\neval: {source}\nout: {tmp_path / 'x'}\n")
    spec, _ = spec_from_args(["--spec", str(spec_file), "--eval-fraction", "0.2"])
    assert (spec.eval, spec.eval_fraction) == (None, 0.2)


def test_the_command_s_help_goes_to_stdout_and_an_unknown_command_is_named(capsys):
    with pytest.raises(SystemExit) as stopped:
        data_main(["--help"])
    out, err = capsys.readouterr()
    assert stopped.value.code == 0 and err == ""
    assert "convert" in out and "prompt-completion" in out and "chat JSONL" not in out
    with pytest.raises(SystemExit) as stopped:
        data_main(["covnert", "--train", "a.jsonl"])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and out == "" and "invalid choice: 'covnert'" in err
    with pytest.raises(SystemExit) as stopped:
        data_main(["convert", "--help"])
    assert stopped.value.code == 0 and "--max-seq-len" in capsys.readouterr().out


def test_columns_are_read_from_a_spec_file_and_the_flag_and_a_bad_flag_is_named(tmp_path):
    spec_file = tmp_path / "convert.yaml"
    spec_file.write_text(f"train: a.jsonl\neval: b.jsonl\nout: {tmp_path / 'x'}\ncolumns: {{prompt: question}}\n")
    assert spec_from_args(["--spec", str(spec_file)])[0].columns == {"prompt": "question"}
    spec, _ = spec_from_args(["--spec", str(spec_file), "--columns", "prompt=question, completion=answer"])
    assert spec.columns == {"prompt": "question", "completion": "answer"}  # the flag wins
    for text, message in [("prompt", "--columns: FIELD=COLUMN pairs"), ("prompt=", "--columns: FIELD=COLUMN pairs"),
                          ("answer=completion", "--columns: 'answer' is no field a format reads")]:
        with pytest.raises(ConvertError, match=message):
            spec_from_args(["--spec", str(spec_file), "--columns", text])


def test_the_notebook_s_parameters_refuse_an_undeclared_name_and_take_a_list_as_text():
    injected = "# Parameters\nformat = \"messages\"\n"
    with pytest.raises(ParamError, match=r"unknown parameter 'format' \(did you mean 'data_format'\?\)"):
        ConvertParams.from_namespace({"In": [injected], "format": "messages"})
    params = ConvertParams.from_dict({"train_sources": "[a.jsonl, hub:org/chats:train]", "eval_sources": "None",
                                      "eval_fraction": "0.2", "template": "{user: 'U:'}"})
    spec = params.spec()
    assert spec.train == [str(ROOT / "a.jsonl"), "hub:org/chats:train"] and spec.eval is None
    assert spec.eval_fraction == 0.2 and spec.template == ChatTemplate(user="U:")
    assert ConvertParams.from_dict({"train_sources": "b.jsonl"}).spec().train == str(ROOT / "b.jsonl")
    for text in ("prompt=question,completion=answer", "{prompt: question, completion: answer}"):
        assert ConvertParams.from_dict({"columns": text}).spec().columns == {"prompt": "question",
                                                                            "completion": "answer"}
    with pytest.raises(ParamError, match="columns: FIELD=COLUMN pairs"):
        ConvertParams.from_dict({"columns": "prompt=question,completion"})
    with pytest.raises(ParamError, match="columns must be a mapping or None"):
        ConvertParams.from_dict({"columns": "prompt"})
    with pytest.raises(ParamError, match="data_format must be auto or one of"):
        ConvertParams.from_dict({"data_format": "dolly"})


def test_the_notebook_s_parameters_cell_mirrors_its_parameter_class():
    notebook = json.loads((ROOT / "notebooks" / "convert_chat.ipynb").read_text())
    cell = next(c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", []))
    declared = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse("".join(cell["source"])).body
                if isinstance(node, ast.Assign)}
    assert declared == {name: getattr(ConvertParams(), name) for name in ConvertParams.names()}
