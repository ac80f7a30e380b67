"""The foundation's readers: YAML and JSON read with bounds, a value shown in an error without its whole size.

Each hostile document below must end in the reader's error naming the file, and at once: the bound in
`returns_at_once` is generous (a hang lasts hours), it only says the reader did not expand, walk or recurse
through what the input stands for.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import cflib.jsonio
import cflib.yamlio
from cflib.errors import ParamError, shown
from cflib.jsonio import MAX_DEPTH, json_lines, parse_json, read_bounded, read_json
from cflib.train.params import load_params_file
from cflib.yamlio import MAX_NODES, load_yaml, read_yaml

# Under 500 bytes: nine aliases of nine aliases, nine levels deep, stand for 9**9 (387 million) strings.
LAUGHS = "".join(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]\n" if level else
                 "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" for level in range(9))


def returns_at_once(call: Callable[[], Any], seconds: float = 5.0) -> Any:
    """call()'s error (it must raise one), checked to come well inside `seconds`."""
    start = time.monotonic()
    with pytest.raises(ParamError) as caught:
        call()
    assert time.monotonic() - start < seconds, "the reader walked what the input stands for"
    return caught.value


def test_a_billion_laughs_is_refused_before_it_is_expanded(tmp_path):
    assert len(LAUGHS.encode()) < 500
    path = tmp_path / "curriculum.yaml"
    path.write_text(LAUGHS)
    error = returns_at_once(lambda: read_yaml(path, ParamError, "curriculum file"))
    assert str(path) in str(error) and f"more than {MAX_NODES:,} values" in str(error)
    assert len(str(error)) < 400  # the message names the file, it does not repeat the document


def test_aliases_that_stay_small_still_read(tmp_path):
    document = "shared: &common {lr: 0.003}\nstages:\n  - {name: a, <<: *common}\n  - {name: b, <<: *common}\n"
    assert load_yaml(document, "c.yaml", ParamError)["stages"][1] == {"name": "b", "lr": 0.003}


@pytest.mark.parametrize("document, words", [
    ("[" * 100_000 + "]" * 100_000, f"nested deeper than {MAX_DEPTH} levels"),
    ("- " * 100_000 + "x", f"nested deeper than {MAX_DEPTH} levels"),
    ("a: &a [*a]", "refers to a node that contains it"),
    ("a: 1\n---\nb: 2\n", "not valid YAML"),
], ids=["deep-flow", "deep-block", "recursive-alias", "two-documents"])
def test_hostile_yaml_is_refused_naming_the_file(document, words):
    error = returns_at_once(lambda: load_yaml(document, "stages.yaml", ParamError))
    assert str(error).startswith("stages.yaml: ") and words in str(error)


@pytest.mark.parametrize("document, words", [
    ("data:\n  max_seq_len: 2001-13-45\n", "month must be in 1..12"),
    ("max_seq_len: " + "1" * 5000 + "\n", "Exceeds the limit"),
    ('lr: !!timestamp "x"\n', "timestamp"),
], ids=["bad-date", "huge-int", "bad-timestamp"])
def test_a_value_pyyaml_cannot_build_is_refused_naming_the_file_and_line(tmp_path, document, words):
    path = tmp_path / "spec.yaml"
    path.write_text(document)
    with pytest.raises(ParamError) as caught:
        read_yaml(path, ParamError, "data spec")
    assert str(caught.value).startswith(f"{path}: not valid YAML") and words in str(caught.value)
    assert f"line {document.count(chr(10))}" in str(caught.value)


def test_a_folder_or_a_missing_file_is_named_for_what_it_was_meant_to_be(tmp_path):
    with pytest.raises(ParamError, match=f"{tmp_path}: a folder, not a curriculum file"):
        read_yaml(tmp_path, ParamError, "curriculum file")
    with pytest.raises(ParamError, match="nowhere.yaml: no such curriculum file"):
        read_yaml(tmp_path / "nowhere.yaml", ParamError, "curriculum file")
    with pytest.raises(ParamError, match=f"{tmp_path}: a folder, not a run record"):
        read_json(tmp_path, ParamError, "run record")


def test_a_file_past_its_bound_is_refused_naming_it(tmp_path, monkeypatch):
    """One reader bounds every file, JSON and YAML alike: a byte past the bound and the file is named, never read
    further."""
    path = tmp_path / "params.yaml"
    path.write_text("[" + "1, " * 40 + "1]")
    with pytest.raises(ParamError, match=f"{path}: larger than the 64 bytes cflib reads in a parameter file"):
        read_bounded(path, 64, ParamError, "parameter file")
    assert read_bounded(path, path.stat().st_size, ParamError, "parameter file") == path.read_bytes()
    monkeypatch.setattr(cflib.yamlio, "MAX_BYTES", 64)
    monkeypatch.setattr(cflib.jsonio, "MAX_BYTES", 64)
    with pytest.raises(ParamError, match=f"{path}: larger than the 64 bytes cflib reads in a parameter file"):
        read_yaml(path, ParamError, "parameter file")
    with pytest.raises(ParamError, match=f"{path}: larger than the 64 bytes cflib reads in a run record"):
        read_json(path, ParamError, "run record")


def refused_without_waiting(call: Callable[[], Any], fifo: Path, seconds: float = 5.0) -> ParamError:
    """call()'s ParamError, which must come at once. A plain open() of a FIFO waits for a writer forever, so the
    call runs in a thread; one still waiting after `seconds` is let go (a writer opens the FIFO and closes it) and
    fails the test instead of hanging the suite."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as err:  # handed to the test's own thread, which judges it
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader waits in open(): this lets it read EOF
        thread.join(seconds)
        pytest.fail(f"{fifo}: the reader waited for a writer instead of refusing a FIFO")
    assert isinstance(outcome.get("error"), ParamError), f"expected a ParamError, got {outcome.get('error')!r}"
    return outcome["error"]  # type: ignore[return-value]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("read", [
    lambda path: read_bounded(path, 64, ParamError, "parameter file"),
    lambda path: read_yaml(path, ParamError, "data spec"),
    lambda path: read_json(path, ParamError, "run record"),
    lambda path: list(json_lines(path, ParamError)),
    load_params_file,
], ids=["read_bounded", "read_yaml", "read_json", "json_lines", "load_params_file"])
def test_a_fifo_or_a_device_is_refused_naming_it_not_waited_on(tmp_path, read):
    """`mkfifo spec.yaml` (or `--spec <(...)`) and `/dev/zero` are no files: the first waits forever for a writer,
    the second never ends. Each is refused by name, at once."""
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    error = refused_without_waiting(lambda: read(fifo), fifo)
    assert str(error).startswith(f"{fifo}: not a regular file (a FIFO)")
    if Path("/dev/zero").exists():
        with pytest.raises(ParamError, match="^/dev/zero: not a regular file \\(a character device\\)"):
            read(Path("/dev/zero"))


def test_deep_json_is_refused_where_python_would_recurse_out_of_its_stack():
    error = returns_at_once(lambda: parse_json("[" * 200_000 + "]" * 200_000, "config.json", ParamError))
    assert str(error) == f"config.json: JSON nested deeper than {MAX_DEPTH} levels"
    # Past the bound but within Python's own limit: refused by the bound, before any caller walks it.
    with pytest.raises(ParamError, match="nested deeper"):
        parse_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "config.json", ParamError)
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "config.json", ParamError) is not None
    # Many brackets side by side are wide, not deep; as bytes (a JSONL row) the same bound holds.
    assert len(parse_json("[" + ",".join(["{}", "[]"] * MAX_DEPTH) + "]", "config.json", ParamError)) == 2 * MAX_DEPTH
    with pytest.raises(ParamError, match="row.jsonl:1: JSON nested deeper"):
        parse_json(b"{\"a\": " + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", lambda: "row.jsonl:1",
                   ParamError)


def test_a_jsonl_line_names_its_number(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"a": 1}\n\n' + "[" * 5000 + "]" * 5000 + "\n")
    rows = json_lines(path, ParamError)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(ParamError, match=f"{path}:3: JSON nested deeper"):
        next(rows)


def test_a_value_in_a_message_is_shown_in_bounded_size():
    nested: list = ["lol"] * 9
    for _ in range(9):  # nine levels of nine references: 387 million strings if walked
        nested = [nested] * 9
    start = time.monotonic()
    text = shown(nested)
    assert time.monotonic() - start < 5.0 and len(text) <= 200
    assert shown("x" * 10_000).count("x") < 100 and shown(3) == "3"
