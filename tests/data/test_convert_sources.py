"""Sources and formats of `python -m cflib.data convert`: Parquet, Arrow, CSV, JSON, folders, saved datasets and
the Hub; OpenAI messages, ShareGPT, prompt-completion and plain text; the eval split; bad rows refused naming
source, row and field with nothing written."""
from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import subprocess
import importlib
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from cflib import jsonio
from cflib.data import sources
from cflib.data.conversation import Conversation, ConvertError
from cflib.data.convert import ConvertSpec, convert
from cflib.data.shards import IGNORE_INDEX, open_shard, sha256_file
from cflib.data.tokenizer import ByteTokenizer

datasets = pytest.importorskip("datasets", reason="the data extra (pip install cflib[data])")
convert_module = importlib.import_module("cflib.data.convert")  # the package exports its function by that name

ROOT = Path(__file__).resolve().parents[2]
BYTES = ByteTokenizer()


def sharegpt(index: int) -> dict:
    turns = [{"from": "human", "value": f"{index}+{index}="}, {"from": "gpt", "value": str(2 * index)}]
    if index % 3 == 0:
        turns = [{"from": "system", "value": "be brief"}] + turns + [{"from": "human", "value": "and twice?"},
                                                                     {"from": "gpt", "value": str(4 * index)}]
    return {"conversations": turns, "task": "double", "id": f"sg-{index}"}


def prompt_completion(index: int, conversational: bool = True) -> dict:
    """A string prompt and completion, or (conversational) each a list of messages."""
    if not conversational:
        return {"prompt": f"upper w{index}", "completion": f"W{index}", "task": "upper"}
    prompt = [{"role": "user", "content": f"upper x{index}"}]
    if index % 4 == 0:
        prompt = [{"role": "system", "content": "answer in capitals"}] + prompt
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": f"X{index}"}], "task": "upper"}


def as_messages(row: dict) -> dict:
    """The same conversation in OpenAI's messages format."""
    if "conversations" in row:
        roles = {"human": "user", "gpt": "assistant", "system": "system"}
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    else:
        side = {"prompt": "user", "completion": "assistant"}
        messages = [m for key in ("prompt", "completion") for m in (
            row[key] if isinstance(row[key], list) else [{"role": side[key], "content": row[key]}])]
    return {"messages": messages, "task": row["task"]}


SHAREGPT = [sharegpt(i) for i in range(10, 22)]
PROMPT_COMPLETION = [prompt_completion(i) for i in range(12)]
STRING_COMPLETIONS = [prompt_completion(i, conversational=False) for i in range(6)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_text(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def to_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def saved(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def run(tmp_path: Path, train, eval_=None, name: str = "shard", **spec) -> dict:
    eval_ = eval_ if eval_ is not None or "eval_fraction" in spec else str(
        write_jsonl(tmp_path / "held.jsonl", [{"messages": [{"role": "user", "content": "9+9="},
                                                            {"role": "assistant", "content": "18"}]}]))
    return convert(ConvertSpec(train=train, eval=eval_, out=str(tmp_path / name), **{"max_seq_len": 64, **spec}))


def examples(root: Path, partition: str = "train") -> list[tuple[list[int], list[int]]]:
    shard = open_shard(root, partition, verify_hashes=True)
    return [(ids.tolist(), labels.tolist()) for ids, labels in (shard[i] for i in range(len(shard)))]


def test_parquet_and_saved_datasets_in_sharegpt_and_prompt_completion_form_equal_the_same_messages(tmp_path):
    """Each format, from a Parquet file and from a saved dataset, gives the tokens its messages form gives."""
    sources = [to_parquet(tmp_path / "sharegpt.parquet", SHAREGPT[:6]), saved(tmp_path / "sharegpt-saved", SHAREGPT[6:]),
               to_parquet(tmp_path / "completions.parquet", PROMPT_COMPLETION[:6]),
               saved(tmp_path / "completions-saved", PROMPT_COMPLETION[6:])]
    indexes = run(tmp_path, [str(source) for source in sources], supervise="all_assistant_turns")
    messages = write_jsonl(tmp_path / "messages.jsonl", [as_messages(r) for r in SHAREGPT + PROMPT_COMPLETION])
    run(tmp_path, str(messages), name="reference", supervise="all_assistant_turns")
    assert examples(tmp_path / "shard") == examples(tmp_path / "reference")
    assert len(examples(tmp_path / "shard")) == 24
    shard = open_shard(tmp_path / "shard", "train")
    names = ["sharegpt", "sharegpt-saved", "completions", "completions-saved"]
    assert [row["source"] for row in shard.rows] == [name for name in names for _ in range(6)]
    assert shard.rows[0]["example_id"] == "train-00000001" and shard.rows[0]["row_id"] == "sg-10"
    assert shard.rows[12]["example_id"] == "train-00000013" and "row_id" not in shard.rows[12]
    assert shard.rows[19]["origin"] == f"{sources[3]} row 2"
    stats = indexes["train"]["conversion"]["stats"]
    assert stats["examples_per_source"] == dict.fromkeys(sorted(names), 6)
    assert sum(stats["supervised_tokens_per_source"].values()) == indexes["train"]["supervised_tokens"]
    recorded = {source["name"]: source for source in stats["sources"]}
    assert recorded["sharegpt"]["files"] == [{"path": str(sources[0]), "sha256": hashlib.sha256(
        sources[0].read_bytes()).hexdigest()}]
    assert {Path(f["path"]).name for f in recorded["completions-saved"]["files"]} >= {"state.json",
                                                                                      "dataset_info.json"}
    # The three-turn ShareGPT rows teach both answers: "24<|eos|>" then "48<|eos|>" (row 12, index 2).
    ids, labels = examples(tmp_path / "shard")[2]
    assert BYTES.decode_template([t for t in labels if t != IGNORE_INDEX]) == "24<|eos|>48<|eos|>"
    # A prompt-completion row teaches its completion only, after its system and user turns.
    ids, labels = examples(tmp_path / "shard")[12]
    assert BYTES.decode_template(ids) == "<|system|>answer in capitals<|user|>upper x0<|assistant|>X0<|eos|>"
    assert BYTES.decode_template([t for t in labels if t != IGNORE_INDEX]) == "X0<|eos|>"


def test_a_conversion_keeps_its_scratch_files_inside_its_out_folder(tmp_path, monkeypatch):
    """`datasets`' cache and the seen digests live in the staging output, not the system's temporary folder."""
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    sources = [to_parquet(tmp_path / "sharegpt.parquet", SHAREGPT), saved(tmp_path / "saved", PROMPT_COMPLETION)]
    seen_scratch = []
    real_reader = convert_module.SourceReader

    def watched(scratch: Path) -> convert_module.SourceReader:
        seen_scratch.append(scratch)
        return real_reader(scratch)

    monkeypatch.setattr(convert_module, "SourceReader", watched)
    run(tmp_path, [str(source) for source in sources])
    assert list(system_tmp.iterdir()) == []
    staging = seen_scratch[0].parent
    assert staging.parent == tmp_path and staging.name.startswith(".shard.staging-") and not staging.exists()
    assert sorted(entry.name for entry in (tmp_path / "shard").iterdir()) == ["eval", "train"]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["held.jsonl", "saved", "shard", "sharegpt.parquet",
                                                                  "system-tmp"]


def test_every_local_kind_of_source_reads_the_same_rows(tmp_path):
    rows = STRING_COMPLETIONS  # string prompts and completions: CSV holds them as they are
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows))
    arrow_folder = saved(tmp_path / "saved", rows)
    shutil.copy(next(arrow_folder.glob("*.arrow")), tmp_path / "rows.arrow")
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "rows.csv"), index=False)
    folder = tmp_path / "folder"
    (folder / "part").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", rows[:3])
    to_parquet(folder / "part" / "b.parquet", rows[3:])
    (folder / "notes.txt").write_text("not data")
    reference = None
    for name, source in [("jsonl", jsonl), ("json", tmp_path / "array.json"), ("arrow", tmp_path / "rows.arrow"),
                         ("csv", tmp_path / "rows.csv"), ("saved", arrow_folder), ("folder", folder)]:
        run(tmp_path, str(source), name=f"from-{name}")
        got = examples(tmp_path / f"from-{name}")
        assert len(got) == len(rows) and got == (reference or got), name
        reference = got


@pytest.mark.parametrize("start", [b"\n  ", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n\t"],
                         ids=["newline", "bom", "bom-newline"])
def test_a_json_array_after_whitespace_or_a_byte_order_mark_is_read_as_an_array(tmp_path, start):
    rows = STRING_COMPLETIONS
    (tmp_path / "array.json").write_bytes(start + json.dumps(rows, indent=2).encode())
    run(tmp_path, str(write_jsonl(tmp_path / "rows.jsonl", rows)), name="from-jsonl")
    run(tmp_path, str(tmp_path / "array.json"), name="from-array")
    assert examples(tmp_path / "from-array") == examples(tmp_path / "from-jsonl")


def test_a_json_array_larger_than_a_document_is_read_a_row_at_a_time(tmp_path, monkeypatch):
    """An array file past the size of one JSON document (64 MiB; 16 KiB here) converts, each row bounded instead;
    read a few bytes at a time, rows cut anywhere (inside a number, an escape, a multi-byte character) come back
    exactly as json.loads gives them."""
    monkeypatch.setattr(jsonio, "MAX_BYTES", 16 * 2**10)
    monkeypatch.setattr(sources, "ARRAY_CHUNK", 5, raising=False)  # before the fix: no chunks, the file read whole
    rows = [{**prompt_completion(i), "id": i, "score": i * 1.25e-7, "note": "héllo 日本語 😀 \"q\" \\"}
            for i in range(120)]
    path = tmp_path / "array.json"
    path.write_bytes(b"\xef\xbb\xbf\n" + json.dumps(rows, indent=1, ensure_ascii=False).encode())
    assert path.stat().st_size > 2 * jsonio.MAX_BYTES
    assert [row for _, row in sources.json_rows(path)] == json.loads(path.read_text(encoding="utf-8-sig"))
    run(tmp_path, str(write_jsonl(tmp_path / "rows.jsonl", rows)), name="from-jsonl")
    run(tmp_path, str(path), name="from-array")
    assert examples(tmp_path / "from-array") == examples(tmp_path / "from-jsonl")


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32", "utf-16-le"])
def test_a_json_array_in_any_encoding_json_detects_is_read_as_an_array(tmp_path, encoding):
    rows = [prompt_completion(i) for i in range(3)]
    path = tmp_path / "array.json"
    path.write_bytes(json.dumps(rows, indent=1, ensure_ascii=False).encode(encoding))
    assert [row for _, row in sources.json_rows(path)] == rows


@pytest.mark.parametrize("chunk", range(1, 40))
def test_infinity_and_nan_read_wherever_a_chunk_cuts_them(tmp_path, monkeypatch, chunk):
    """Python's json writes Infinity, -Infinity and NaN, and reads them back: so does the array reader, whatever
    byte a chunk of the file ends at."""
    monkeypatch.setattr(sources, "ARRAY_CHUNK", chunk)
    rows = [{"score": float("inf")}, {"score": -float("inf")}, {"score": 1.5}]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(rows))
    assert [row for _, row in sources.json_rows(path)] == rows


@pytest.mark.parametrize("text, words", [
    ('[{"prompt": "a", "completion": "b"}, {"prompt": "c" "completion": "d"}]',
     ["array.json row 2: not valid JSON", "Expecting ',' delimiter, character 16 of the row"]),
    ('[{"prompt": "a", "completion": "b"}, {"prompt": "' + "x" * 5000 + '", "completion": "d"}]',
     ["array.json row 2: more than the 4,096 bytes cflib reads in one row"]),
    ('[{"prompt": "a", "completion": "b"}, {"prompt": "' + "x" * 5000,
     ["array.json row 2: more than the 4,096 bytes", "or JSON left open"]),
    ('[{"prompt": "a", "completion": "b"} {"prompt": "c", "completion": "d"}]',
     ["array.json: after row 1, expected ',' and the next row, or ']' ending the array; found '{"]),
    ('[{"prompt": "a", "completion": "b"}] []', ["array.json: text after the array's closing ']'"]),
], ids=["syntax", "long-row", "left-open", "no-comma", "after-end"])
def test_a_json_array_names_the_row_that_cannot_be_read(tmp_path, monkeypatch, text, words):
    monkeypatch.setattr(jsonio, "MAX_BYTES", 4096)
    source = write_text(tmp_path / "array.json", text)
    with pytest.raises(ConvertError) as caught:
        run(tmp_path, source)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert not (tmp_path / "shard").exists()


def test_sources_of_one_name_are_told_apart_by_their_paths(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_jsonl(tmp_path / folder / "train.jsonl", [as_messages(SHAREGPT[0 if folder == "a" else 1])])
    sources = [str(tmp_path / "a" / "train.jsonl"), str(tmp_path / "b" / "train.jsonl")]
    indexes = run(tmp_path, sources)
    assert indexes["train"]["conversion"]["stats"]["examples_per_source"] == {
        str(tmp_path / "a" / "train"): 1, str(tmp_path / "b" / "train"): 1}
    indexes = run(tmp_path, [{"path": source, "name": "both"} for source in sources], name="named")
    assert indexes["train"]["conversion"]["stats"]["examples_per_source"] == {"both": 2}


def test_a_csv_keeps_every_cell_as_the_text_it_was(tmp_path):
    path = tmp_path / "sums.csv"
    path.write_text('prompt,completion\n12+34=,46\nsay NA,NA\n"a, b",007\n')
    run(tmp_path, str(path))
    taught = [BYTES.decode_template([t for t in labels if t != IGNORE_INDEX]) for _, labels in examples(tmp_path / "shard")]
    assert taught == ["46<|eos|>", "NA<|eos|>", "007<|eos|>"]


def test_plain_text_is_taught_whole(tmp_path):
    run(tmp_path, str(write_jsonl(tmp_path / "text.jsonl", [{"text": "hello world"}, {"text": "abc"}])))
    ids, labels = examples(tmp_path / "shard")[0]
    assert ids == BYTES.encode("hello world") + [0]
    assert labels == ids[1:] + [IGNORE_INDEX]


def user_and_answer(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_alpaca_rows_are_the_instruction_then_the_input_a_newline_apart_as_the_user_turn(tmp_path):
    """Detected by instruction + output; a blank or missing input leaves the instruction alone; a `text` column
    (Alpaca dumps carry the whole templated prompt there) does not make the row plain text."""
    rows = [{"instruction": "Give a tip.", "input": "", "output": "Sleep."},
            {"instruction": "Translate to French", "input": "good morning", "output": "bonjour", "system": "Be brief."},
            {"instruction": "Name a color", "output": "Blue.", "input": "  "},
            {"instruction": "Add", "input": "2 and 3", "output": "5",
             "text": "### Instruction:\nAdd\n\n### Input:\n2 and 3\n\n### Response:\n5"}]
    indexes = run(tmp_path, str(write_jsonl(tmp_path / "alpaca.jsonl", rows)))
    reference = [user_and_answer("Give a tip.", "Sleep."),
                 user_and_answer("Translate to French\ngood morning", "bonjour", system="Be brief."),
                 user_and_answer("Name a color", "Blue."), user_and_answer("Add\n2 and 3", "5")]
    run(tmp_path, str(write_jsonl(tmp_path / "reference.jsonl", reference)), name="reference")
    assert examples(tmp_path / "shard") == examples(tmp_path / "reference")
    ids, labels = examples(tmp_path / "shard")[1]
    assert BYTES.decode_template(ids) == ("<|system|>Be brief.<|user|>Translate to French\ngood morning"
                                          "<|assistant|>bonjour<|eos|>")
    assert BYTES.decode_template([t for t in labels if t != IGNORE_INDEX]) == "bonjour<|eos|>"  # the output alone
    assert indexes["train"]["conversion"]["stats"]["sources"][0]["format"] == "auto"


def test_dolly_rows_read_as_alpaca_through_columns_recorded_in_the_manifest(tmp_path):
    rows = [{"instruction": "Who wrote Hamlet?", "context": "Hamlet is a play by Shakespeare.",
             "response": "Shakespeare.", "category": "closed_qa"},
            {"instruction": "Name a color.", "context": "", "response": "Blue.", "category": "open_qa"}]
    held = [{"instruction": "Name a fruit.", "context": "", "response": "Apple.", "category": "open_qa"}]
    columns = {"input": "context", "output": "response", "task": "category"}
    indexes = run(tmp_path, str(write_jsonl(tmp_path / "dolly.jsonl", rows)),
                  str(write_jsonl(tmp_path / "dolly-held.jsonl", held)), columns=columns, max_seq_len=128)
    run(tmp_path, str(write_jsonl(tmp_path / "reference.jsonl", [
        user_and_answer("Who wrote Hamlet?\nHamlet is a play by Shakespeare.", "Shakespeare."),
        user_and_answer("Name a color.", "Blue.")])), name="reference", max_seq_len=128)
    assert examples(tmp_path / "shard") == examples(tmp_path / "reference")
    assert [row["task"] for row in open_shard(tmp_path / "shard", "train").rows] == ["closed_qa", "open_qa"]
    for partition in ("train", "eval"):  # the conversion's columns are every source's
        (source,) = indexes[partition]["conversion"]["stats"]["sources"]
        assert source["columns"] == columns and source["format"] == "auto"


def test_question_answer_rows_read_as_prompt_completion_through_a_source_s_own_columns(tmp_path):
    rows = [{"question": "12+34=", "answer": "46"}, {"question": "upper w", "answer": "W", "prompt": "ignored"}]
    source = {"path": str(write_jsonl(tmp_path / "qa.jsonl", rows)), "columns": {"prompt": "question",
                                                                                "completion": "answer"}}
    held = str(write_jsonl(tmp_path / "held.jsonl", [user_and_answer("9+9=", "18")]))
    indexes = run(tmp_path, [source], held)
    taught = [BYTES.decode_template([t for t in labels if t != IGNORE_INDEX])
              for _, labels in examples(tmp_path / "shard")]
    assert taught == ["46<|eos|>", "W<|eos|>"]  # the mapped column replaces a field of the same name
    assert BYTES.decode_template(examples(tmp_path / "shard")[1][0]) == "<|user|>upper w<|assistant|>W<|eos|>"
    assert indexes["train"]["conversion"]["stats"]["sources"][0]["columns"] == source["columns"]
    assert indexes["eval"]["conversion"]["stats"]["sources"][0]["columns"] == {}


@pytest.mark.parametrize("settings, words", [
    (lambda qa: {"columns": {"promt": "question"}},
     ["columns: 'promt' is no field a format reads", "prompt, completion"]),
    (lambda qa: {"columns": {"prompt": 3}}, ["columns: a mapping of field: column"]),
    (lambda qa: {"columns": ["prompt", "question"]}, ["columns: a mapping of field: column"]),
    (lambda qa: {"train": [{"path": qa, "columns": {"answer": "completion"}}]},
     ["train: {qa}: columns: 'answer' is no field"]),
    (lambda qa: {"columns": {"prompt": "question", "completion": "reply"}},
     ["qa.jsonl row 2: no column 'reply', which columns maps to 'completion'", "['answer', 'question']"]),
])
def test_a_bad_column_mapping_is_refused_naming_the_key_row_and_column_and_writes_nothing(tmp_path, settings, words):
    qa = str(write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "reply": "b"}, {"question": "c", "answer": "d"}]))
    with pytest.raises(ConvertError) as caught:
        run(tmp_path, **{"train": qa, **settings(qa)})
    for word in words:
        assert word.format(qa=qa) in str(caught.value), f"{word!r} not in: {caught.value}"
    assert not (tmp_path / "shard").exists() and not list(tmp_path.glob(".shard*"))


def test_an_alpaca_row_with_earlier_turns_is_refused_rather_than_converted_without_them(tmp_path):
    rows = [{"instruction": "and twice?", "input": "", "output": "8", "history": [["2+2=", "4"]]}]
    with pytest.raises(ConvertError, match="alpaca.jsonl row 1: history: an alpaca row's earlier turns are not read"):
        run(tmp_path, str(write_jsonl(tmp_path / "alpaca.jsonl", rows)))
    assert not (tmp_path / "shard").exists()


def test_tool_turns_need_the_tokenizers_template(tmp_path):
    row = {"messages": [{"role": "user", "content": "weather?"},
                        {"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "sunny"}]}
    with pytest.raises(ConvertError, match="tools.jsonl row 1: the marker template has no place for tools"):
        run(tmp_path, str(write_jsonl(tmp_path / "tools.jsonl", [row])))


@pytest.mark.parametrize("reasoning, taught", [("supervise", "<think>add</think>4<|eos|>"),
                                               ("mask", "4<|eos|>"), ("strip", "4<|eos|>")])
def test_reasoning_is_taught_masked_or_stripped(tmp_path, reasoning, taught):
    rows = [{"messages": [{"role": "user", "content": "2+2="},
                          {"role": "assistant", "content": "<think>add</think>4"}]},
            {"messages": [{"role": "user", "content": "1+3="},
                          {"role": "assistant", "content": "4", "reasoning_content": "add"}]}]
    run(tmp_path, str(write_jsonl(tmp_path / "think.jsonl", rows)), reasoning=reasoning)
    for ids, labels in examples(tmp_path / "shard"):
        assert BYTES.decode_template([t for t in labels if t != IGNORE_INDEX]) == taught
        assert ("<think>add</think>" in BYTES.decode_template(ids)) == (reasoning != "strip")


def test_eval_fraction_splits_by_content_so_no_conversation_is_in_both(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(60)]
    source = str(write_jsonl(tmp_path / "all.jsonl", rows + rows[:20]))  # 20 conversations twice
    first = run(tmp_path, source, eval_fraction=0.25, seed=3, name="a")
    run(tmp_path, source, eval_fraction=0.25, seed=3, name="again")
    run(tmp_path, source, eval_fraction=0.25, seed=4, name="other")
    train, held = examples(tmp_path / "a", "train"), examples(tmp_path / "a", "eval")
    assert not {tuple(ids) for ids, _ in train} & {tuple(ids) for ids, _ in held}
    assert len(train) + len(held) == 60 and 5 <= len(held) <= 30
    stats = {p: first[p]["conversion"]["stats"] for p in ("train", "eval")}
    assert stats["train"]["rows_read"] + stats["eval"]["rows_read"] == 80
    assert stats["train"]["rejected"]["duplicate"] + stats["eval"]["rejected"]["duplicate"] == 20
    assert stats["eval"]["rejected"]["duplicate_of_train"] == 0
    assert first["eval"]["conversion"]["split"] == {"eval_fraction": 0.25, "seed": 3}
    assert examples(tmp_path / "again", "eval") == held and examples(tmp_path / "other", "eval") != held


def split_sources(folder: Path) -> list[str]:
    """Two train sources for eval_fraction, one JSON Lines and one Parquet, with what the split must count alike on
    either side: exact duplicates, a row that is one once its reasoning is stripped, empty answers, conversations
    too long even for drop_turns, and longer ones drop_turns cuts to their first exchange (itself a row of its own:
    a duplicate in train, of train in eval)."""
    chats = []
    for i in range(24):
        answer = f"<think>{i} times 3</think>\n{3 * i}" if i % 5 == 0 else str(3 * i)
        chats.append({"messages": [{"role": "user", "content": f"{i}*3="}, {"role": "assistant", "content": answer}],
                      "task": "triple", "domain": "math" if i % 2 else "arith", "id": i})
    chats += [chats[1], chats[4], chats[7], chats[12]]
    chats.append({"messages": [{"role": "user", "content": "0*3="}, {"role": "assistant", "content": "0"}],
                  "task": "triple"})
    chats += [{"messages": [{"role": "user", "content": f"say nothing {i}"}, {"role": "assistant", "content": " "}]}
              for i in range(4)]
    chats += [{"messages": [{"role": "user", "content": "x" * 90 + str(i)}, {"role": "assistant", "content": "long"}]}
              for i in range(3)]
    for i in range(8):
        first = [{"role": "user", "content": f"{i}-1="}, {"role": "assistant", "content": str(i - 1)}]
        chats.append({"messages": first + [{"role": "user", "content": "and " + "y" * 60},
                                           {"role": "assistant", "content": "z" * 30}], "task": "dialog",
                      "mode": "multi"})
        chats.append({"messages": first, "task": "dialog"})
    squares = []
    for i in range(20):
        turns = [{"from": "human", "value": f"{i}^2="}, {"from": "gpt", "value": str(i * i)}]
        if i % 4 == 0:
            turns += [{"from": "human", "value": "again " + "w" * 70}, {"from": "gpt", "value": "v" * 20}]
        squares.append({"conversations": turns, "task": "square", "id": f"sq-{i}", "difficulty": "easy"})
    squares += [squares[2], squares[3], squares[9]]
    squares += [{"conversations": [{"from": "human", "value": f"empty {i}"}, {"from": "gpt", "value": ""}],
                 "task": "square", "id": None, "difficulty": None} for i in range(3)]
    squares += [{"conversations": [{"from": "human", "value": "q" * 100 + str(i)}, {"from": "gpt", "value": "a"}],
                 "task": "square", "id": None, "difficulty": None} for i in range(2)]
    write_jsonl(folder / "chats.jsonl", chats)
    to_parquet(folder / "squares.parquet", squares)
    return ["chats.jsonl", "squares.parquet"]


def split_conversion(tmp_path: Path, monkeypatch) -> tuple[dict, list[str]]:
    """split_sources converted with eval_fraction, from relative paths (each example's origin and the manifest's
    sources alike in every run); the indexes and the warnings given."""
    monkeypatch.chdir(tmp_path)
    train = split_sources(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", convert_module.ConvertWarning)
        indexes = convert(ConvertSpec(train=train, eval_fraction=0.3, seed=0, out="shard", max_seq_len=48,
                                      overflow="drop_turns", reasoning="strip"))
    return indexes, [str(w.message) for w in caught if issubclass(w.category, convert_module.ConvertWarning)]


# What split_conversion wrote when the eval partition read the train sources again (before each source was read
# once, the conversations held out kept in a scratch file for eval), recorded with that code: reading once must
# write the same examples in the same order under the same example_ids (the files' SHA-256), count the same rows,
# rejections and truncations per partition and source, and warn alike. Each source's entry is checked against its
# file (the Parquet file's SHA-256 depends on the pyarrow that wrote it) with the rows it gave the partition.
PINNED_SPLIT = {
    "train": {"examples": 35, "num_tokens": 329, "supervised_tokens": 103, "sha256": {
        "input_ids.bin": "baa71f18699af912c30ea95769e2726b05f49efe92db51bb86fe7b24cd6f4463",
        "labels.bin": "1fe726479baa5402dfd9ddc875b4f95e99b16041660e11e52abc0bf2872c6037",
        "examples.jsonl": "c8b2598414a123bcf2802d3b0fa31e80a739d7743c62ecf80b67176504b79377",
        "loss_metadata.jsonl": "2d99eb7a9b0d5de75205041292b63b4159117dbc0bc561d18e41943c4fdadec1"},
        "stats": {"rows_read": 50, "rejected": {"too_long": 3, "duplicate": 7, "duplicate_of_train": 0,
                                                "empty_answer": 5},
                  "truncated_examples": 8, "examples_per_task": {"dialog": 7, "square": 13, "triple": 15},
                  "examples_per_source": {"chats": 22, "squares": 13},
                  "supervised_tokens_per_source": {"chats": 59, "squares": 44}, "sources": (31, 19)}},
    "eval": {"examples": 17, "num_tokens": 158, "supervised_tokens": 48, "sha256": {
        "input_ids.bin": "dcc83ba7470bed1ced1d00c6a2f59f25aec64737d1dd3af1541f62d94d6a65df",
        "labels.bin": "aebb718cfb4ab0a3584e4c29707067170ebd51ee19cf8e5f7f1bd700e4623d67",
        "examples.jsonl": "7e79efe1397b7507e4c55678cc5b4e6c36176e11bbcd581f25111d199682f7c0",
        "loss_metadata.jsonl": "be3e5e204931c477b3031706e1d1829ad1c896a18cfb28ff43a95e5261e69cf1"},
        "stats": {"rows_read": 30, "rejected": {"too_long": 2, "duplicate": 5, "duplicate_of_train": 4,
                                                "empty_answer": 2},
                  "truncated_examples": 2, "examples_per_task": {"dialog": 1, "square": 7, "triple": 9},
                  "examples_per_source": {"chats": 10, "squares": 7},
                  "supervised_tokens_per_source": {"chats": 26, "squares": 22}, "sources": (21, 9)}},
    "warnings": [f"{partition}: {count} of {rows} conversations ({share}) are longer than max_seq_len 48 and were "
                 "rejected (too_long); with overflow: drop_turns, not even their first answer fits: raise "
                 "max_seq_len (--max-seq-len)" for partition, count, rows, share in [("train", 3, 50, "6.0%"),
                                                                                  ("eval", 2, 30, "6.7%")]]}


def test_eval_fraction_writes_what_reading_the_sources_for_each_partition_wrote(tmp_path, monkeypatch):
    indexes, warned = split_conversion(tmp_path, monkeypatch)
    assert warned == PINNED_SPLIT["warnings"]
    for partition, index in indexes.items():
        pinned = PINNED_SPLIT[partition]
        assert {key: index[key] for key in ("examples", "num_tokens", "supervised_tokens", "sha256")} == {
            key: pinned[key] for key in ("examples", "num_tokens", "supervised_tokens", "sha256")}, partition
        stats = index["conversion"]["stats"]
        assert stats == {**pinned["stats"], "sources": [
            {"name": Path(path).stem, "spec": path, "format": "auto", "columns": {},
             "files": [{"path": path, "sha256": sha256_file(tmp_path / path)}], "rows_read": rows}
            for path, rows in zip(["chats.jsonl", "squares.parquet"], pinned["stats"]["sources"])]}, partition
        open_shard(tmp_path / "shard", partition, verify_hashes=True)


def test_eval_fraction_reads_each_train_source_once(tmp_path, monkeypatch):
    read = Counter()
    rows = sources.SourceReader.rows

    def counted(self, source):
        read[source.spec] += 1
        return rows(self, source)

    monkeypatch.setattr(sources.SourceReader, "rows", counted)
    indexes, _ = split_conversion(tmp_path, monkeypatch)
    assert read == {"chats.jsonl": 1, "squares.parquet": 1}
    assert indexes["eval"]["examples"] and indexes["train"]["examples"]



def test_a_held_out_conversation_is_read_back_as_the_train_partition_kept_it(tmp_path):
    """Every field of a Conversation as JSON writes and reads it, each source's in turn: key order, tools with
    NaN, infinity, -0.0 and a large integer, context turns, an integer row id, text beyond ASCII, and a lone
    surrogate where meta may hold one (check_metadata takes any string)."""
    kept = [Conversation([{"role": "user", "content": "ü 1", "name": "x"},
                          {"content": "", "role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
                          {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "done"}],
                         tools=[{"type": "function", "z": 2**70, "a": [float("nan"), float("inf"), -0.0]}],
                         context_turns=1, meta={"task": "t\ud800", "row_id": 7}),
            Conversation(text="plain \u00e9", meta={"source": "s"})]
    held = convert_module.HeldOut(tmp_path)
    held.keep(0, "a.jsonl row 2", -5, kept[0])
    held.keep(2, "b.parquet row 1", 9, kept[1])
    held.finish(rows_seen=4)
    back = [list(held.of_source(index)) for index in range(4)]
    held.close()
    assert [[(where, digest) for where, digest, _ in of_source] for of_source in back] == [
        [("a.jsonl row 2", -5)], [], [("b.parquet row 1", 9)], []]
    for (_, _, conversation), original in zip(back[0] + back[2], kept):
        assert type(conversation) is Conversation
        assert repr(vars(conversation)) == repr(vars(original))  # order, types and -0.0 as they were


@pytest.mark.parametrize("seed", [0, 1])
def test_stripped_reasoning_is_stripped_once_on_either_side_of_the_split(tmp_path, seed):
    """Stripping a block can join what is left into another ("<thi<think>x</think>nk>" is "<think>" once
    stripped): the eval partition writes the conversation as stripped once, as the train partition split it."""
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"<thi<think>x</think>nk>y{i}</think>z{i}"}]}
            for i in range(30)]
    run(tmp_path, str(write_jsonl(tmp_path / "nested.jsonl", rows)), eval_fraction=0.3, seed=seed,
        reasoning="strip")
    written = [BYTES.decode_template(ids) for partition in ("train", "eval")
               for ids, _ in examples(tmp_path / "shard", partition)]
    assert sorted(written) == sorted(f"<|user|>q{i}<|assistant|><think>y{i}</think>z{i}<|eos|>" for i in range(30))

def test_a_hub_source_offline_fails_at_once_naming_it(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConvertError, match="hub:someone/chats:default:train@v1: cannot reach it on the Hugging "
                                           "Face Hub .*needs network access"):
        run(tmp_path, "hub:someone/chats:default:train@v1")
    assert not (tmp_path / "shard").exists()
    with pytest.raises(ConvertError, match="a Hub source is hub:NAME"):
        run(tmp_path, "hub:just-a-name")


def test_a_hub_source_is_never_read_from_a_local_folder_of_its_name(tmp_path, monkeypatch):
    import huggingface_hub

    # The Hub answers (mocked: no network here), so only the local folder could be read.
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, *args, **kwargs: SimpleNamespace(
        sha="0" * 40))
    (tmp_path / "someone" / "chats").mkdir(parents=True)
    write_jsonl(tmp_path / "someone" / "chats" / "train.jsonl", [as_messages(row) for row in SHAREGPT])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConvertError, match="hub:someone/chats:train: .*someone/chats exists, and datasets would "
                                           "read it instead of the Hub data set someone/chats; .*local source"):
        run(tmp_path, "hub:someone/chats:train")
    assert not (tmp_path / "shard").exists()


def test_a_hub_source_split_by_eval_fraction_is_read_once_at_one_commit_for_both_partitions(tmp_path, monkeypatch):
    """The Hub is asked for the branch's commit once, the data set streamed once at it, and both partitions record
    it (the branch moving after the first question changes nothing)."""
    import huggingface_hub

    commits = iter(["a" * 40, "b" * 40])
    asked, loaded = [], []

    def dataset_info(self, name, revision=None, timeout=None):
        asked.append(revision)
        return SimpleNamespace(sha=next(commits))

    def load_dataset(name, config=None, split=None, revision=None, streaming=None, cache_dir=None):
        loaded.append(revision)
        rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
                for i in range(40 if revision == "a" * 40 else 80)]  # the new commit has more rows
        return iter(rows)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    written = run(tmp_path, "hub:someone/chats:train@main", eval_fraction=0.25)
    assert asked == ["main"] and loaded == ["a" * 40]
    for partition in ("train", "eval"):
        (source,) = written[partition]["conversion"]["stats"]["sources"]
        assert source["hub"]["commit"] == "a" * 40
    assert sum(written[p]["conversion"]["stats"]["rows_read"] for p in ("train", "eval")) == 40


def bad_parquet(tmp_path: Path) -> str:
    rows = [sharegpt(i) for i in range(6)]
    rows[4]["conversations"][1]["from"] = "robot"
    return str(to_parquet(tmp_path / "bad.parquet", rows))


def bad_saved(tmp_path: Path) -> str:
    return str(saved(tmp_path / "bad-saved", [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": None}]))


@pytest.mark.parametrize("build, words", [
    (bad_parquet, ["bad.parquet row 5", "conversations 1", "'from'"]),
    (bad_saved, ["bad-saved row 2", "no 'completion' field"]),
    (lambda tmp: str(write_jsonl(tmp / "mixed.jsonl", [as_messages(SHAREGPT[0]), SHAREGPT[1]])),
     ["mixed.jsonl row 2", "no 'messages' field", "the source's first row was messages"]),
    (lambda tmp: str(write_jsonl(tmp / "odd.jsonl", [{"question": "a", "answer": "b"}])),
     ["odd.jsonl row 1", "no format's fields", "question", "instruction+output", "--columns prompt=question"]),
    (lambda tmp: str(write_jsonl(tmp / "calls.jsonl", [{"conversations": [
        {"from": "human", "value": "w?"}, {"from": "function_call", "value": "{\"args\": 1}"}]}])),
     ["calls.jsonl row 1", "conversations 1 value", "'name'"]),
    (lambda tmp: str(write_jsonl(tmp / "tools.jsonl", [{**as_messages(SHAREGPT[0]), "tools": "[1, 2]"}])),
     ["tools.jsonl row 1", "tools: a list of JSON schemas"]),
    (lambda tmp: write_text(tmp / "wide.csv", "prompt,completion" + "x" * 200_000 + "\nq,a\n"),
     ["wide.csv header row", "field larger than field limit", "by line 1"]),
    (lambda tmp: write_text(tmp / "open.csv", '"prompt,completion\nq,a\n' + "x" * 200_000 + "\n"),
     ["open.csv header row", "field larger than field limit", "by line 3", "quote left open"]),
    (lambda tmp: str(to_parquet(tmp / "dated.parquet", [{"messages": [
        {"role": "user", "content": "hi", "sent": datetime.datetime(2020, 1, 1)},
        {"role": "assistant", "content": "yo", "sent": None}]}])),
     ["dated.parquet row 1", "Object of type datetime is not JSON serializable", "cast that column to text"]),
    (lambda tmp: str(tmp / "missing.parquet"), ["missing.parquet: no such file or folder"]),
    (lambda tmp: (tmp / "empty").mkdir() or str(tmp / "empty"), ["empty: a folder with no data file"]),
])
def test_a_row_that_cannot_be_read_is_refused_naming_source_row_and_field(tmp_path, build, words):
    source = build(tmp_path)
    with pytest.raises(ConvertError) as caught:
        run(tmp_path, [str(write_jsonl(tmp_path / "good.jsonl", [as_messages(SHAREGPT[2])])), source])
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert not (tmp_path / "shard").exists() and not list(tmp_path.glob(".shard*"))


def test_settings_are_checked_before_anything_is_read(tmp_path):
    source = str(write_jsonl(tmp_path / "a.jsonl", [as_messages(SHAREGPT[0])]))
    for change, message in [({"eval_fraction": 0.2}, "not both"), ({"eval": None}, "not neither"),
                            ({"eval": None, "eval_fraction": 1.5}, "eval_fraction must be a number in"),
                            ({"format": "dolly"}, "format must be auto or one of"),
                            ({"reasoning": "hide"}, "reasoning must be one of"),
                            ({"template": "tokenizer"}, "is not a folder")]:
        with pytest.raises(ConvertError, match=message):
            convert(ConvertSpec(**{"train": source, "eval": source, "out": str(tmp_path / "out"), **change}))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_line_takes_several_sources_and_a_fraction(tmp_path):
    sharegpt_parquet = to_parquet(tmp_path / "sharegpt.parquet", SHAREGPT)
    completions = saved(tmp_path / "completions", PROMPT_COMPLETION)
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--train", str(sharegpt_parquet),
                           str(completions), "--eval-fraction", "0.2", "--seed", "1", "--out", str(tmp_path / "cli"),
                           "--max-seq-len", "64"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "sharegpt:" in done.stdout and "completions:" in done.stdout
    index = json.loads((tmp_path / "cli" / "eval" / "sft.idx.json").read_text())
    assert index["conversion"]["split"] == {"eval_fraction": 0.2, "seed": 1}
