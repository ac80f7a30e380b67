"""Chat JSONL to the public shard format, streaming: memory stays flat in the number of rows.

Each input line is `{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}` with optional `task`, `group`, `domain`, `source` and
`id` fields, and the semantic `domain`, `mode` and `difficulty`, which go to
each partition's `loss_metadata.jsonl` (cflib.data.loss_metadata). A conversation renders through a chat template:

    every turn:       <role marker> content
    system/user turn: ... followed by turn_end
    assistant turn:   ... followed by eos  (the shard's EOS token)

Only assistant tokens (content and its EOS) are supervised: those of the final
turn, or of every assistant turn (`supervise`). Nothing is truncated or
sliced: a conversation longer than `max_seq_len` is rejected and counted, as
are exact duplicates (same messages), eval conversations that also occur in
train, and empty answers. Malformed input stops the conversion, naming file
and line; nothing is written then. Each partition's sft.idx.json records the
counts, supervised tokens, vocabulary, EOS, cap, the rejections, the
tokenizer, template and source with their SHA-256, and the SHA-256 of every
file written.

    python -m cflib.data convert --train train.jsonl --eval eval.jsonl --out data/my-shard \
        [--tokenizer byte|path/to/tokenizer.json] [--supervise final_turn|all_assistant_turns] \
        [--max-seq-len 2048] [--template template.yaml] [--spec convert.yaml] [--overwrite]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator, Sequence

from cflib.atomic import check_output_folder
from cflib.data import loss_metadata
from cflib.data.shards import IGNORE_INDEX, PARTITIONS, Example, ShardPartition, sha256_file, write_partition
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer
from cflib.errors import shown
from cflib.jobs import one_line_errors
from cflib.jsonio import json_lines
from cflib.locks import exclusive_output
from cflib.yamlio import read_yaml

ROLES = ("system", "user", "assistant")
SUPERVISE = ("final_turn", "all_assistant_turns")
METADATA = ("task", "group", "source", *loss_metadata.FIELDS)


class ConvertError(ValueError):
    """Input that cannot become a shard; the message names the file, line or setting."""


@dataclass(frozen=True)
class ChatTemplate:
    """Role markers and turn ends, as text; special tokens in them are recognised by the tokenizer.

    The default matches the byte tokenizer and the embedded data. ChatML, for a
    tokenizer.json that has its specials: system "<|im_start|>system\\n", user
    "<|im_start|>user\\n", assistant "<|im_start|>assistant\\n", turn_end
    "<|im_end|>\\n", eos "<|im_end|>".
    """

    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    turn_end: str = ""  # after each system and user turn
    eos: str = "<|eos|>"  # one token, after each assistant turn; the shard's EOS

    @classmethod
    def from_dict(cls, raw: dict, source: str = "template") -> "ChatTemplate":
        known = [f.name for f in fields(cls)]
        if not isinstance(raw, dict):
            raise ConvertError(f"{source}: a template is a mapping of {', '.join(known)}")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConvertError(f"{source}: unknown template key(s) {unknown}; known: {known}")
        if not all(isinstance(value, str) for value in raw.values()):
            raise ConvertError(f"{source}: template values are strings")
        return cls(**raw)


@dataclass
class ConvertSpec:
    """What to convert and how; recorded in each partition's sft.idx.json."""

    train: str
    eval: str
    out: str
    tokenizer: str = "byte"  # "byte" or the path of a local tokenizer.json
    supervise: str = "final_turn"
    max_seq_len: int = 2048
    template: ChatTemplate = field(default_factory=ChatTemplate)

    def validate(self) -> None:
        for name in ("train", "eval", "out", "tokenizer"):
            if not isinstance(getattr(self, name), (str, Path)):
                raise ConvertError(f"{name}: one path, got {shown(getattr(self, name))}; a conversion reads one "
                                   "JSONL file per partition (join several with cat a.jsonl b.jsonl > all.jsonl)")
        if self.supervise not in SUPERVISE:
            raise ConvertError(f"supervise must be one of {SUPERVISE}, got {self.supervise!r}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ConvertError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        for name in ("train", "eval"):
            if not Path(getattr(self, name)).is_file():
                raise ConvertError(f"{name}: {getattr(self, name)} is not a file")


class SeenConversations:
    """Digests of the conversations read so far, per partition, in a temporary SQLite file.

    Exact duplicates can only be found by remembering every conversation; on
    disk (SQLite's B-tree, with its bounded page cache) that memory stays flat
    however many rows go by. The file goes when the conversion ends.
    """

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="cflib-convert-")
        self._db = sqlite3.connect(Path(self._folder.name) / "seen.sqlite")
        self._db.execute("PRAGMA journal_mode = OFF")  # a scratch file: nothing to recover
        self._db.execute("PRAGMA synchronous = OFF")
        for partition in PARTITIONS:
            self._db.execute(f"CREATE TABLE {partition} (digest INTEGER PRIMARY KEY)")

    def add(self, partition: str, digest: int) -> bool:
        """Remember a digest; False when the partition already had it."""
        return self._db.execute(f"INSERT OR IGNORE INTO {partition} VALUES (?)", (digest,)).rowcount == 1

    def has(self, partition: str, digest: int) -> bool:
        return self._db.execute(f"SELECT 1 FROM {partition} WHERE digest = ?", (digest,)).fetchone() is not None

    def close(self) -> None:
        self._db.close()
        self._folder.cleanup()


def conversation_digest(messages: list[dict]) -> int:
    """64 bits of BLAKE2b over roles and contents: a signed SQLite integer."""
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def _check_row(row: object, where: str, to_answer: bool = False) -> list[dict]:
    """The row's messages, or ConvertError naming the line. A conversation to convert ends with the
    assistant turn it teaches; one `to_answer` ends before the assistant's turn."""
    if not isinstance(row, dict):
        raise ConvertError(f"{where}: not a JSON object")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConvertError(f"{where}: needs a non-empty list 'messages'")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise ConvertError(f"{where}: message {turn} needs a role in {ROLES} and a string content, "
                               f"got {str(message)[:80]}")
    for turn, message in enumerate(messages):
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate escape ("\ud800") is valid JSON but no text
            raise ConvertError(f"{where}: message {turn} content is not encodable text (character "
                               f"{message['content'][err.start]!r} at {err.start}: {err.reason})") from None
    _check_turn_order(messages, where)
    if to_answer and messages[-1]["role"] == "assistant":
        raise ConvertError(f"{where}: the last message is the assistant's; a conversation to answer ends with "
                           "a user (or system) turn")
    if not to_answer and messages[-1]["role"] != "assistant":
        raise ConvertError(f"{where}: the last message is {messages[-1]['role']!r}; a conversation ends with "
                           "the assistant turn it teaches")
    for key in METADATA:
        if key in row and not isinstance(row[key], str):
            raise ConvertError(f"{where}: {key!r} must be a string, got {row[key]!r}")
    return messages


def _check_turn_order(messages: list[dict], where: str) -> None:
    """An optional system turn first, then user and assistant in turn, the user first: an answer with no
    question before it, or two questions in a row, would teach the template a conversation it never sees."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    for turn, message in enumerate(turns, start=len(messages) - len(turns)):
        expected = "user" if (turn - (len(messages) - len(turns))) % 2 == 0 else "assistant"
        if message["role"] != expected:
            what = ("a system turn after the first message" if message["role"] == "system" else
                    f"{message['role']!r} where the {expected!r} turn belongs")
            raise ConvertError(f"{where}: message {turn} is {what}; a conversation is an optional system turn, "
                               "then user and assistant turns in turn, starting with the user")


def conversation_to_answer(row: object, where: str) -> list[dict]:
    """The messages of {"messages": [...]} ending with a user or system turn, or ConvertError naming `where`."""
    return _check_row(row, where, to_answer=True)


class ChatRenderer:
    """Messages to (input_ids, labels) under a template, supervising assistant turns."""

    def __init__(self, tokenizer: ByteTokenizer | JsonTokenizer, template: ChatTemplate, supervise: str) -> None:
        eos = tokenizer.token_id(template.eos)
        if eos is None:
            raise ConvertError(f"tokenizer {tokenizer.description} has no token {template.eos!r} (the template's "
                               "eos); add it as a special token or set the template's eos to the tokenizer's")
        self.tokenizer, self.template, self.supervise, self.eos_token_id = tokenizer, template, supervise, eos
        self.markers = {role: tokenizer.encode_template(getattr(template, role)) for role in ROLES}
        self.turn_end = tokenizer.encode_template(template.turn_end)

    def _turn(self, role: str, content: str) -> tuple[list[int], list[int]]:
        """A turn's marker ids, then its content and end ids (EOS after the assistant's)."""
        end = [self.eos_token_id] if role == "assistant" else self.turn_end
        return self.markers[role], self.tokenizer.encode(content) + end

    def render(self, messages: list[dict]) -> tuple[list[int], list[int]] | None:
        """Causally aligned ids and labels; None when a supervised answer is empty."""
        ids: list[int] = []
        supervised: list[bool] = []
        last = len(messages) - 1
        for turn, message in enumerate(messages):
            role = message["role"]
            taught = role == "assistant" and (self.supervise == "all_assistant_turns" or turn == last)
            if taught and not message["content"].strip():
                return None
            marker, body = self._turn(role, message["content"])
            ids += marker + body
            supervised += [False] * len(marker) + [taught] * len(body)
        # labels[j] is the target of position j: the next token when that token is supervised.
        labels = [ids[j + 1] if supervised[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
        return ids, labels + [IGNORE_INDEX]

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """What a model trained on this template sees before it answers `messages` (see
        conversation_to_answer): every turn as in training, then the assistant marker."""
        if not self.markers["assistant"]:
            raise ConvertError(f"the template names no assistant marker (assistant: "
                               f"{self.template.assistant!r}): nothing tells the model that its turn begins")
        ids: list[int] = []
        for message in messages:
            marker, body = self._turn(message["role"], message["content"])
            ids += marker + body
        return ids + self.markers["assistant"]


def _read_jsonl(path: Path, digest: "hashlib._Hash") -> Iterator[tuple[int, object]]:
    """(line number, parsed row) of each non-blank line, hashing the bytes read on the way."""
    return json_lines(path, ConvertError, on_line=digest.update)


def _examples(path: Path, partition: str, renderer: ChatRenderer, max_seq_len: int, seen: SeenConversations,
              stats: dict) -> Iterator[Example]:
    """The accepted examples of one JSONL file; `stats` is filled as rows are read."""
    source_digest = hashlib.sha256()
    rejected: Counter = Counter()
    per_task: Counter = Counter()
    read = 0
    for number, row in _read_jsonl(path, source_digest):
        read += 1
        messages = _check_row(row, f"{path}:{number}")
        digest = conversation_digest(messages)
        if not seen.add(partition, digest):
            rejected["duplicate"] += 1
            continue
        if partition == "eval" and seen.has("train", digest):
            rejected["duplicate_of_train"] += 1
            continue
        rendered = renderer.render(messages)
        if rendered is None:
            rejected["empty_answer"] += 1
            continue
        input_ids, labels = rendered
        if len(input_ids) > max_seq_len:
            rejected["too_long"] += 1
            continue
        example_id = row.get("id") if isinstance(row.get("id"), str) else f"{partition}-{number:08d}"
        meta = {"example_id": example_id, "line": number, **{k: row[k] for k in METADATA if k in row}}
        per_task[meta.get("task", "")] += 1
        yield Example(input_ids, labels, meta)
    if read - sum(rejected.values()) == 0:
        raise ConvertError(f"{path}: no conversation was accepted ({read} read, rejected: {dict(rejected)})")
    stats.update({"rows_read": read, "rejected": {k: rejected[k] for k in
                                                 ("too_long", "duplicate", "duplicate_of_train", "empty_answer")},
                  "truncated_examples": 0, "examples_per_task": dict(sorted(per_task.items())),
                  "source": {"path": str(path), "sha256": source_digest.hexdigest()}})


def convert(spec: ConvertSpec, overwrite: bool = False) -> dict[str, dict]:
    """Write spec.out/{train,eval}; returns each partition's sft.idx.json. All or nothing."""
    spec.validate()
    out = Path(spec.out)
    inputs = {"train": spec.train, "eval": spec.eval,
              "tokenizer": None if spec.tokenizer == "byte" else spec.tokenizer}
    def check() -> None:
        check_output_folder(out, inputs, ConvertError, owned=_written_by_convert, overwrite=overwrite, what="out:")

    check()
    try:
        tokenizer = load_tokenizer(spec.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        raise ConvertError(f"tokenizer: {err}") from None
    renderer = ChatRenderer(tokenizer, spec.template, spec.supervise)
    tokenizer_record = {"kind": "byte" if isinstance(tokenizer, ByteTokenizer) else "tokenizer.json",
                        "path": None if isinstance(tokenizer, ByteTokenizer) else str(tokenizer.path),
                        "sha256": None if isinstance(tokenizer, ByteTokenizer) else sha256_file(tokenizer.path)}
    conversion = {"tokenizer": tokenizer_record, "template": asdict(spec.template), "supervise": spec.supervise}
    seen = SeenConversations()
    try:  # `out` checked again under its lock: a conversion that wrote it meanwhile is never silently replaced
        with exclusive_output(out, check, ConvertError, what="out:") as staging:
            for partition in PARTITIONS:  # train first: eval conversations also in train are rejected
                stats: dict = {}
                examples = _examples(Path(getattr(spec, partition)), partition, renderer, spec.max_seq_len, seen,
                                     stats)
                # The generator fills `stats` as it ends, before write_partition reads index_extra.
                write_partition(staging / partition, examples, vocab_size=tokenizer.vocab_size,
                                eos_token_id=renderer.eos_token_id, max_seq_len=spec.max_seq_len,
                                index_extra={"conversion": {**conversion, "stats": stats}},
                                sidecar_fields=loss_metadata.FIELDS)
    finally:
        seen.close()
    return {p: json.loads((out / p / "sft.idx.json").read_text()) for p in ("train", "eval")}


_PARTITION_FILES = {"input_ids.bin", "labels.bin", "examples.jsonl", "sft.idx.json", loss_metadata.SIDECAR}


def _written_by_convert(entry: Path) -> bool:
    """A partition this command wrote: only its files, its manifest recording a conversion."""
    if entry.name not in PARTITIONS or entry.is_symlink() or not entry.is_dir():
        return False
    if {item.name for item in entry.iterdir()} - _PARTITION_FILES:
        return False
    try:
        return isinstance(json.loads((entry / "sft.idx.json").read_text()).get("conversion"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def spec_from_args(argv: Sequence[str]) -> tuple[ConvertSpec, bool]:
    parser = argparse.ArgumentParser(prog="python -m cflib.data convert",
                                     description="Chat JSONL to an SFT token shard (train/ and eval/).")
    parser.add_argument("--spec", help="YAML with any of: train, eval, out, tokenizer, supervise, max_seq_len, "
                                       "template (a mapping); flags win")
    parser.add_argument("--train")
    parser.add_argument("--eval")
    parser.add_argument("--out")
    parser.add_argument("--tokenizer", help='"byte" (default) or a local tokenizer.json')
    parser.add_argument("--supervise", choices=SUPERVISE)
    parser.add_argument("--max-seq-len", type=int, dest="max_seq_len")
    parser.add_argument("--template", help="YAML or JSON file with the template's keys")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an out folder this command wrote (nothing else in it)")
    args = parser.parse_args(argv)
    raw: dict = {}
    if args.spec:
        raw = read_yaml(args.spec, ConvertError, "conversion spec") or {}
        if not isinstance(raw, dict):
            raise ConvertError(f"{args.spec}: a conversion spec is a mapping")
    known = [f.name for f in fields(ConvertSpec)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConvertError(f"{args.spec}: unknown key(s) {unknown}; known: {known}")
    raw.update({k: v for k, v in vars(args).items() if k in known and v is not None})
    if args.template:
        raw["template"] = read_yaml(args.template, ConvertError, "template file")
    missing = [name for name in ("train", "eval", "out") if not raw.get(name)]
    if missing:
        raise ConvertError(f"missing {', '.join(missing)} (flags --{' --'.join(missing)} or the spec file)")
    template = ChatTemplate.from_dict(raw.pop("template", None) or {}, args.template or args.spec or "template")
    return ConvertSpec(**{**raw, "template": template}), args.overwrite


def summary(indexes: dict[str, dict]) -> str:
    """A few lines per partition: what was written and what was rejected."""
    lines = []
    for partition, index in indexes.items():
        stats = index["conversion"]["stats"]
        rejected = ", ".join(f"{k} {v}" for k, v in stats["rejected"].items())
        lines.append(f"{partition:5s} {index['examples']:,} examples of {stats['rows_read']:,} rows, "
                     f"{index['num_tokens']:,} tokens, {index['supervised_tokens']:,} supervised; "
                     f"rejected: {rejected}")
    any_index = next(iter(indexes.values()))
    lines.append(f"vocab_size {any_index['vocab_size']}, eos_token_id {any_index['eos_token_id']}, "
                 f"max_seq_len {any_index['max_seq_len']}, tokenizer {any_index['conversion']['tokenizer']['kind']}")
    return "\n".join(lines)


def show_example(shard: ShardPartition, index: int, tokenizer: ByteTokenizer | JsonTokenizer) -> str:
    """One example as text, its supervised tokens (what the loss teaches) between [[ and ]]."""
    ids, labels = shard[index]
    # labels[j] supervises token j + 1, so token t is supervised when labels[t - 1] is not -100.
    supervised = [False] + [int(label) != IGNORE_INDEX for label in labels[:-1]]
    pieces, run, state = [], [], False
    for token, taught in zip(ids.tolist(), supervised):
        if taught != state and run:
            pieces.append(f"[[{tokenizer.decode_template(run)}]]" if state else tokenizer.decode_template(run))
            run = []
        run.append(token)
        state = taught
    pieces.append(f"[[{tokenizer.decode_template(run)}]]" if state else tokenizer.decode_template(run))
    return "".join(pieces)


def main(argv: Sequence[str]) -> None:
    with one_line_errors("convert", ConvertError):
        spec, overwrite = spec_from_args(argv)
        indexes = convert(spec, overwrite)
    print(f"wrote {spec.out}")
    print(summary(indexes))
