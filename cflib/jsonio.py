"""JSON read with bounds, with errors that name the file (and line) and say what is wrong.

Every JSON document cflib reads from a user's disk (a shard's index and rows, a
checkpoint's config.json, a run's record, chat JSONL, a bundle's tokenizer
files) goes through here: a document past MAX_BYTES or nested deeper than
MAX_DEPTH is refused by name before any caller walks it, so no input makes a
reader recurse out of the stack or hold more than its size.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

MAX_BYTES = 64 * 2**20  # one document: a file, or one line of a JSONL file
MAX_DEPTH = 64  # lists and objects inside each other; cflib's own documents nest a few levels


def too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _openings(text: str | bytes) -> int:
    """An upper bound of the nesting of the JSON in `text`: every list and object opens with a bracket."""
    return text.count(b"[") + text.count(b"{") if isinstance(text, bytes) else text.count("[") + text.count("{")


def parse_json(text: str | bytes, where: str | Callable[[], str], error: type[Exception],
               limit: int = MAX_BYTES) -> Any:
    """The JSON value of `text`, or `error` naming `where` (a file, a file:line; or a function that says it, called
    only for an error: a reader of many rows names none of them until one is wrong); at most `limit` bytes."""
    def place() -> str:
        return where() if callable(where) else where

    if len(text) > limit:
        raise error(f"{place()}: {len(text):,} bytes of JSON, more than the {limit:,} cflib reads in one document")
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{place()}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # bad JSON, or bytes that are not UTF-8
        raise error(f"{place()}: not valid JSON ({err})") from None
    # The walk only where the brackets could nest that deep: a row of a JSONL file has one or two.
    if _openings(text) > MAX_DEPTH and too_deep(value, MAX_DEPTH):
        raise error(f"{place()}: JSON nested deeper than {MAX_DEPTH} levels")
    return value


# What a path that is no regular file is, for the message that refuses it.
NOT_FILES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))


def open_regular(path: Path, error: type[Exception], what: str) -> BinaryIO:
    """The regular file `path` opened to read bytes, or `error` naming it and what it was meant to be (a `what`):
    missing, a folder, unreadable, or no regular file. A FIFO's open() waits for a writer forever and a device
    such as /dev/zero never ends, so the file is opened without waiting (O_NONBLOCK, which a regular file's reads
    ignore) and judged by its descriptor: a check of the path before opening could be raced by a swap."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as err:
        if path.is_dir():  # Windows refuses to open a folder, as Linux does one this user may not list
            raise error(f"{path}: a folder, not a {what}") from None
        raise error(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        if stat.S_ISDIR(mode):
            raise error(f"{path}: a folder, not a {what}")
        kind = next((name for test, name in NOT_FILES if test(mode)), "a special file")
        raise error(f"{path}: not a regular file ({kind}); cflib reads a {what} from a regular file only: write it "
                    "to one first")
    return os.fdopen(descriptor, "rb")


def read_bounded(path: str | Path, limit: int, error: type[Exception], what: str) -> bytes:
    """The bytes of the file `path`, at most `limit` of them, or `error` naming it and what it was meant to be (a
    `what`): missing, a folder, no regular file, unreadable or larger. Only limit + 1 bytes are ever read."""
    path = Path(path)
    with open_regular(path, error, what) as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as err:
            raise error(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than the {limit:,} bytes cflib reads in a {what}")
    return data


def read_json(path: str | Path, error: type[Exception], what: str = "JSON file") -> Any:
    """The JSON document in the file `path`, or `error` naming it: missing, a folder, too large, invalid."""
    return parse_json(read_bounded(path, MAX_BYTES, error, what), str(path), error)


def json_lines(path: str | Path, error: type[Exception], where: Callable[[int], str] | None = None,
               on_line: Callable[[bytes], None] | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSONL file, read a line at a time (each at most
    MAX_BYTES); `where(number)` names a line in errors (default `path:number`), `on_line` sees every line's bytes
    (a digest)."""
    path = Path(path)
    name = where or (lambda number: f"{path}:{number}")
    with open_regular(path, error, "JSONL file") as handle:
        number = 0
        while line := handle.readline(MAX_BYTES + 1):
            number += 1
            if len(line) > MAX_BYTES:
                raise error(f"{name(number)}: a line longer than the {MAX_BYTES:,} bytes cflib reads in one row")
            if on_line is not None:
                on_line(line)
            if line.strip():
                yield number, parse_json(line, lambda: name(number), error)
