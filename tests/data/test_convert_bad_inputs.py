"""`python -m cflib.data convert` fed what users get wrong: each case ends in an error naming the file, line
or folder at fault, and every file that existed before is unchanged (the inputs above all)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cflib.data.convert import ConvertError, ConvertSpec, convert
from cflib.data.marker_template import ChatTemplate

ROOT = Path(__file__).resolve().parents[2]


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def row(*messages: dict, **meta) -> str:
    return json.dumps({"messages": list(messages), **meta})


GOOD = [row(turn("user", f"{a}+{a}="), turn("assistant", str(2 * a))) for a in range(10, 20)]


def write_inputs(folder: Path, train_lines: list[str] | None = None) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("\n".join(train_lines or GOOD[:8]) + "\n")
    (folder / "eval.jsonl").write_text("\n".join(GOOD[8:]) + "\n")
    return {"train": folder / "train.jsonl", "eval": folder / "eval.jsonl"}


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def with_line(line: str) -> Callable[[Path], dict]:
    """A train file whose third line is `line`: the error must name train.jsonl row 3."""
    def build(tmp: Path) -> dict:
        inputs = write_inputs(tmp / "in", GOOD[:2] + [line] + GOOD[2:8])
        if line.startswith("@@"):  # bytes that are no UTF-8: written as Latin-1
            raw = inputs["train"].read_bytes()
            inputs["train"].write_bytes(raw.replace(line.encode(), line.strip("@").encode("latin-1")))
        return {"train": str(inputs["train"]), "eval": str(inputs["eval"]), "out": str(tmp / "out")}
    return build


def folder_case(arrange: Callable[[Path, dict], str], overwrite: bool = True) -> Callable[[Path], dict]:
    """`arrange(tmp, inputs)` prepares the folder the conversion is pointed at and returns it."""
    def build(tmp: Path) -> dict:
        inputs = write_inputs(tmp / "in")
        out = arrange(tmp, inputs)
        return {"train": str(inputs["train"]), "eval": str(inputs["eval"]), "out": out, "overwrite": overwrite}
    return build


def previous_output_with(extra: str) -> Callable[[Path, dict], str]:
    def arrange(tmp: Path, inputs: dict) -> str:
        convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp / "shard")))
        (tmp / "shard" / extra).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "shard" / extra).write_text("the user's own notes")
        return str(tmp / "shard")
    return arrange


# (id, build(tmp) -> convert arguments, words the message must contain)
CASES = [
    # --- conversations out of turn order: no user turn before the answer, two questions in a row ----------
    ("assistant-first", with_line(row(turn("assistant", "hello"), turn("user", "hi"), turn("assistant", "yo"))),
     ["train.jsonl row 3", "message 0", "'assistant' where the 'user' turn belongs"]),
    ("assistant-only", with_line(row(turn("assistant", "42"))), ["train.jsonl row 3", "message 0", "'user' turn"]),
    ("user-after-user", with_line(row(turn("user", "a"), turn("user", "b"), turn("assistant", "c"))),
     ["train.jsonl row 3", "message 1", "'user' where the 'assistant' turn belongs"]),
    ("system-in-the-middle", with_line(row(turn("user", "a"), turn("system", "b"), turn("assistant", "c"))),
     ["train.jsonl row 3", "message 1", "system turn after the first message"]),
    ("system-then-assistant", with_line(row(turn("system", "s"), turn("assistant", "c"))),
     ["train.jsonl row 3", "message 1", "'user' turn belongs"]),
    ("developer-in-the-middle", with_line(row(turn("user", "a"), turn("developer", "b"), turn("assistant", "c"))),
     ["train.jsonl row 3", "message 1", "developer turn after the first message"]),
    # --- OpenAI's fine-tuning fields the converter cannot honour ---------------------------------------------
    ("weight-a-half", with_line(row(turn("user", "a"), {"role": "assistant", "content": "b", "weight": 0.5})),
     ["train.jsonl row 3", "message 1 weight", "0 (not taught) or 1 (taught), got 0.5"]),
    ("weight-a-string", with_line(row(turn("user", "a"), {"role": "assistant", "content": "b", "weight": "0"})),
     ["train.jsonl row 3", "message 1 weight", "got '0'"]),
    ("weight-on-a-user-turn", with_line(row({"role": "user", "content": "a", "weight": 1}, turn("assistant", "b"))),
     ["train.jsonl row 3", "message 0 weight", "only an assistant turn has a weight"]),
    ("content-an-image-part", with_line(row({"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]},
        turn("assistant", "a cat"))), ["train.jsonl row 3", "message 0 content part 1 is 'image_url'",
                                       "only text parts"]),
    # --- odd text -------------------------------------------------------------------------------------------
    ("lone-surrogate", with_line('{"messages": [{"role": "user", "content": "\\ud800"}, '
                                 '{"role": "assistant", "content": "x"}]}'),
     ["train.jsonl row 3", "message 0", "not encodable text"]),
    ("not-utf8", with_line("@@latin-1: caf\xe9@@"), ["train.jsonl row 3", "not valid JSON"]),
    ("a-json-list", with_line("[1, 2]"), ["train.jsonl row 3", "not a JSON object"]),
    ("nan-literal", with_line("NaN"), ["train.jsonl row 3", "not a JSON object"]),
    ("content-a-number", with_line(row(turn("user", "a"), {"role": "assistant", "content": 5})),
     ["train.jsonl row 3", "message 1", "string content"]),
    ("role-unknown", with_line(row(turn("user", "a"), turn("bot", "b"))), ["train.jsonl row 3", "message 1", "role"]),
    ("task-a-mapping", with_line(row(turn("user", "a"), turn("assistant", "b"), task={"a": 1})),
     ["train.jsonl row 3", "'task' must be a string"]),
    ("truncated-line", with_line('{"messages": [{"role": "user", "content": "a'), ["train.jsonl row 3", "not valid JSON"]),
    ("nested-deep", with_line('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     ["train.jsonl row 3", "JSON nested deeper than 64 levels"]),
    # --- the output folder: never an input, never anything the command did not write ----------------------
    ("out-holds-the-inputs", folder_case(lambda tmp, inputs: str(tmp / "in")),
     ["contains the train input", "would delete it"]),
    ("out-is-an-input-file", folder_case(lambda tmp, inputs: str(inputs["train"])), ["is the train input itself"]),
    ("out-inside-an-input", folder_case(lambda tmp, inputs: str(inputs["train"] / "shard")),
     ["lies inside the train input"]),
    ("out-holds-an-unrelated-file", folder_case(previous_output_with("notes.txt")),
     ["'notes.txt'", "did not write"]),
    ("out-partition-holds-an-unrelated-file", folder_case(previous_output_with("train/extra.bin")),
     ["'train'", "did not write"]),
    ("out-is-someone-elses-folder", folder_case(lambda tmp, inputs: (
        (tmp / "mine").mkdir(), (tmp / "mine" / "train").mkdir(), (tmp / "mine" / "train" / "a.txt").write_text("x"),
        str(tmp / "mine"))[-1]), ["'train'", "did not write"]),
    ("out-partition-index-nested-deep", folder_case(lambda tmp, inputs: (
        (tmp / "mine" / "train").mkdir(parents=True),
        (tmp / "mine" / "train" / "sft.idx.json").write_text('{"conversion": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        str(tmp / "mine"))[-1]), ["'train'", "did not write"]),
    ("out-exists-without-overwrite", folder_case(previous_output_with("notes.txt"), overwrite=False),
     ["already exists", "--overwrite"]),
    ("out-under-a-file", folder_case(lambda tmp, inputs: (
        (tmp / "afile").write_text("x"), str(tmp / "afile" / "shard"))[-1]), ["afile is a file"]),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_conversion_input_names_the_culprit_and_changes_nothing(tmp_path, build, words):
    arguments = build(tmp_path)
    overwrite = arguments.pop("overwrite", False)
    before = digest(tmp_path)
    with pytest.raises(ConvertError) as caught:
        convert(ConvertSpec(**arguments), overwrite=overwrite)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert digest(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*") if "staging" in p.name]


def test_overwrite_replaces_a_folder_of_its_own_output(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    spec = ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "shard"))
    first = convert(spec)
    (tmp_path / "in" / "train.jsonl").write_text("\n".join(GOOD[:6]) + "\n")
    again = convert(spec, overwrite=True)
    assert first["train"]["examples"] == 8 and again["train"]["examples"] == 6


@pytest.mark.slow
def test_the_command_line_names_the_folder_and_keeps_the_input(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    (tmp_path / "in" / "unrelated.txt").write_text("keep me")
    before = digest(tmp_path)
    done = subprocess.run([sys.executable, "-m", "cflib.data", "convert", "--train", str(inputs["train"]),
                           "--eval", str(inputs["eval"]), "--out", str(tmp_path / "in"), "--overwrite"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "contains the train input" in done.stderr
    assert digest(tmp_path) == before


def test_the_battery_is_large():
    assert len(CASES) >= 20


def test_a_conversion_killed_mid_write_leaves_nothing_the_next_one_keeps(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    leftover = tmp_path / ".shard.staging-k1ll3d_x"  # what a kill during the write leaves beside the target
    (leftover / "train").mkdir(parents=True)
    (leftover / "train" / "input_ids.bin").write_bytes(b"\0" * 1024)
    convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "shard")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "shard"]


def beside(tmp: Path) -> dict[str, str]:
    """Entries a user keeps beside an output called `shard`, with its name in theirs: never the command's."""
    (tmp / ".shard.keep").mkdir()
    (tmp / ".shard.keep" / "notes.txt").write_text("the user's")
    (tmp / ".shard.bak").write_text("a backup")
    (tmp / ".shard.swp").write_text("an editor's swap file")
    (tmp / ".shard.staging-notes").mkdir()  # a user's name in the command's own pattern: but a file of theirs
    return digest(tmp)


def test_a_conversion_touches_nothing_beside_its_output_but_its_own_leftovers(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    before = beside(tmp_path)
    leftover = tmp_path / ".shard.staging-k1ll3d_x"  # what a conversion killed mid-write left: the command's own
    (leftover / "train").mkdir(parents=True)
    convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "shard")))
    after = digest(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("shard/")} == before
    assert not leftover.exists() and (tmp_path / ".shard.staging-notes").is_dir()
    assert not (tmp_path / ".shard.lock").exists()  # the writer's lock goes with it



def test_a_file_of_the_user_s_bearing_the_lock_s_name_is_refused_never_overwritten_or_removed(tmp_path):
    """`.shard.lock` is the name of the lock a conversion into `shard` holds; a file of someone's by that name
    (not empty, not a holder's note) is named and left as it was, and nothing is written."""
    inputs = write_inputs(tmp_path / "in")
    (tmp_path / ".shard.lock").write_text("my notes on the lock-in period")
    before = digest(tmp_path)
    with pytest.raises(ConvertError, match=rf"{tmp_path / '.shard.lock'} holds something other than a lock "
                                           "holder's note: it may be someone's file"):
        convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "shard")))
    assert digest(tmp_path) == before

def test_a_full_disk_names_the_output_and_leaves_nothing(tmp_path, monkeypatch):
    try:
        from small_disk import fill, small_disk
    except ImportError:  # run from the repository root as a package
        from tests.small_disk import fill, small_disk
    inputs = write_inputs(tmp_path / "in", [row(turn("user", f"{a} " * 100), turn("assistant", "x" * 1000))
                                            for a in range(40)])
    with small_disk(tmp_path / "disk", "1m") as disk:
        if disk is None:  # no tmpfs here: the write fails as a full disk makes it fail
            disk = tmp_path / "disk"
            disk.mkdir(exist_ok=True)

            def full(*args, **kwargs):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr("cflib.data.convert.write_partition", full)
        else:
            fill(disk, leave=16 * 1024)
        before = digest(disk)
        with pytest.raises(ConvertError) as caught:
            convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(disk / "shard")))
        assert str(caught.value).startswith(f"out of disk space writing {disk / 'shard'}")
        assert digest(disk) == before and sorted(p.name for p in disk.iterdir()) == sorted(before)


@pytest.mark.slow
def test_two_conversions_into_one_folder_at_once_one_wins_the_other_is_refused(tmp_path):
    """Started together in two processes: one writes the folder, the other is refused by name (while the first
    writes, or because the folder it found missing now exists); never a silent replacement."""
    runs = {}
    for name, answer in (("a", "A"), ("b", "B")):
        lines = [row(turn("user", f"{i} {name} " * 40), turn("assistant", answer * 200)) for i in range(6000)]
        runs[name] = write_inputs(tmp_path / name, lines)
    go = tmp_path / "go"
    wait_then_convert = ("import sys, time, pathlib\nwhile not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.001)\n"
                         "from cflib.data.__main__ import main\nmain(sys.argv[2:])")
    children = {name: subprocess.Popen(
        [sys.executable, "-c", wait_then_convert, str(go), "convert", "--train", str(inputs["train"]), "--eval",
         str(inputs["eval"]), "--out", str(tmp_path / "shard")], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for name, inputs in runs.items()}
    time.sleep(2)  # both interpreters up, cflib imported
    go.write_text("")
    results = {name: (child.wait(timeout=300), child.stderr.read()) for name, child in children.items()}
    winners = [name for name, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    code, message = results["b" if winners == ["a"] else "a"]
    assert "Traceback" not in message and ("is being written by another command" in message
                                           or "already exists" in message), message
    index = json.loads((tmp_path / "shard" / "train" / "sft.idx.json").read_text())
    assert index["conversion"]["stats"]["sources"][0]["spec"] == str(runs[winners[0]]["train"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "go", "shard"]


def chatml_tokenizer(path: Path) -> str:
    """A byte-level BPE whose only specials are ChatML's, as Qwen's: no <|system|>, <|user|> or <|assistant|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(GOOD, trainer)
    tokenizer.save(str(path))
    return str(path)


@pytest.mark.parametrize("tokenizer, markers, words", [
    ("byte", {"assistant": ""}, "template.yaml: the template names no assistant marker"),
    ("byte", {"user": "<|assistant|>"}, "template.yaml: the template's user and assistant markers are the same"),
    ("byte", {"eos": "<|user|>"}, "the template's eos '<|user|>' is also in its user marker"),
    ("chatml", {"eos": "<|im_end|>"}, "template system '<|system|>': tokenizer .*chatml.json has no token "
                                      "'<|system|>', so it would be written as 10 tokens of plain text"),  # one a byte
], ids=["empty-assistant", "user-is-assistant", "eos-is-the-user-marker", "markers-the-tokenizer-lacks"])
def test_a_marker_template_the_model_could_not_read_is_refused_before_any_row(tmp_path, tokenizer, markers, words):
    """Refused at conversion, not when the chat later needs the markers (or never: text markers train silently)."""
    inputs = write_inputs(tmp_path / "in")
    tokenizer = chatml_tokenizer(tmp_path / "chatml.json") if tokenizer == "chatml" else tokenizer
    with pytest.raises(ConvertError, match=words.replace("|", "\\|")):
        convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "out"), tokenizer=tokenizer,
                            template=ChatTemplate.from_dict(markers, "template.yaml")))
    assert not (tmp_path / "out").exists()
    if tokenizer != "byte":  # the ChatML markers the message names convert
        chatml = {"system": "<|im_start|>system\n", "user": "<|im_start|>user\n",
                  "assistant": "<|im_start|>assistant\n", "turn_end": "<|im_end|>\n", "eos": "<|im_end|>"}
        convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "out"), tokenizer=tokenizer,
                            template=ChatTemplate.from_dict(chatml, "template.yaml")))


def test_a_template_without_a_system_marker_converts_data_without_system_turns_and_refuses_a_system_turn(tmp_path):
    """Alpaca-style markers (no system turn in the data): an empty system marker is a template, not a mistake;
    only a row with a system turn, which would run into the turn after it, is refused, naming the row."""
    alpaca = ChatTemplate.from_dict({"system": "", "user": "### Instruction:\n", "assistant": "### Response:\n"},
                                    "alpaca.yaml")
    inputs = write_inputs(tmp_path / "in")
    convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "out"), template=alpaca))
    assert (tmp_path / "out" / "train" / "sft.idx.json").is_file()
    with_system = [row(turn("system", "be brief"), turn("user", "1+1="), turn("assistant", "2"))] + GOOD[:7]
    inputs = write_inputs(tmp_path / "in2", with_system)
    with pytest.raises(ConvertError, match="row 1: .*names no system marker"):
        convert(ConvertSpec(str(inputs["train"]), str(inputs["eval"]), str(tmp_path / "out2"), template=alpaca))
    assert not (tmp_path / "out2").exists()
