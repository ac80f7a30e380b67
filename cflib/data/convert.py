"""Conversations to the public shard format, streaming: memory stays flat in the number of rows.

Sources (cflib.data.sources: files, folders, saved datasets, the Hub) are read
through `datasets`; each row, its columns renamed as `columns` says, becomes a
conversation in its format (cflib.data.formats: OpenAI messages, ShareGPT,
prompt-completion, Alpaca, plain text), the reasoning policy applies
(cflib.data.reasoning), and it renders through a template
(cflib.data.rendering: role markers, or the tokenizer's own Jinja chat
template) into input ids and causally aligned labels. Only
assistant tokens (content and end of turn) are taught: those of the final
turn, or of every assistant turn (`supervise`); plain text is taught whole.

Held-out conversations come from `eval` sources, or from the train sources
with `eval_fraction`: each conversation goes to eval by a hash of its content
and the seed, so the same conversation always lands on the same side, before
duplicates are counted; each train source is read once, the conversations it
sends to eval kept in a scratch file for the eval partition. Nothing is
sliced: a conversation longer than
`max_seq_len` is rejected and counted (`overflow: reject`), or keeps its longest
prefix that ends after a whole assistant turn and fits (`overflow: drop_turns`,
counted as truncated; rejected where its first answer does not fit), and a
warning names the partition where more than 1% of its conversations were
rejected as too long. Exact duplicates, eval conversations that also occur in
train, and empty answers are rejected and counted too. A row that cannot
be read stops the conversion, naming source, row and field; nothing is
written then. Each example's `example_id` is generated (`train-00000001`),
unique in its partition; a row's own `id` is kept as `row_id`. Rendered
through the tokenizer's template, the first rows of each source are checked
token for token against `apply_chat_template` before they are written. Each
example keeps its `source`: its row's own, else its input's name. Each
partition's sft.idx.json records the counts per source,
supervised tokens, vocabulary, EOS, cap, the rejections and truncations, the
overflow policy, the tokenizer and template (the tokenizer template's
SHA-256), every source with its columns and the SHA-256 of its files, and the
SHA-256 of every file written.

    python -m cflib.data convert --train SOURCE [SOURCE ...] (--eval SOURCE ... | --eval-fraction F) --out DIR \
        [--format auto|messages|sharegpt|prompt_completion|alpaca|text] [--columns FIELD=COLUMN,...] \
        [--tokenizer byte|tokenizer.json|DIR] [--template tokenizer|template.yaml] \
        [--supervise all_assistant_turns|final_turn] [--reasoning supervise|mask|strip] [--max-seq-len 2048] \
        [--overflow reject|drop_turns] [--seed 0] [--spec convert.yaml] [--overwrite]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from cflib.atomic import check_output_folder, scratch_folder
from cflib.data import loss_metadata
from cflib.data.conversation import SUPERVISE, Conversation, ConvertError, conversation_digest
from cflib.data.formats import FIELDS, FORMATS, check_columns, columns_from_text, detect, read_row, renamed
from cflib.data.marker_template import ChatTemplate
from cflib.data.reasoning import POLICIES, stripped
from cflib.data.rendering import TOKENIZER_TEMPLATE, Renderer, make_renderer, tokenizer_record
from cflib.data.shards import IGNORE_INDEX, PARTITIONS, Example, ShardPartition, write_partition
from cflib.data.sources import Source, SourceReader, describe, distinct_names, parse_source
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer, PretrainedTokenizer
from cflib.errors import ParamError, shown
from cflib.jobs import one_line_errors
from cflib.jsonio import read_json
from cflib.locks import exclusive_output
from cflib.paths import resolve_path
from cflib.schema import Params, coerce, is_none_word, parsed_by
from cflib.yamlio import load_yaml, read_yaml

REJECTIONS = ("too_long", "duplicate", "duplicate_of_train", "empty_answer")
# What a conversation longer than max_seq_len becomes: rejected whole, or its leading whole assistant turns kept.
OVERFLOW = ("reject", "drop_turns")
# Above this share of a partition's conversations rejected as too long, the conversion warns: data lost unseen.
TOO_LONG_WARNING = 0.01
# Rendered through the tokenizer's template, the first rows of each source are compared with apply_chat_template.
IDENTITY_SAMPLE = 16


class ConvertWarning(UserWarning):
    """Data a conversion left out that its summary alone would let go unseen."""


@dataclass
class ConvertSpec:
    """What to convert and how; recorded in each partition's sft.idx.json."""

    train: str | list  # one source or several (cflib.data.sources)
    eval: str | list | None = None  # held-out sources; None: eval_fraction of the train sources
    out: str = ""
    tokenizer: str = "byte"  # "byte", a local tokenizer.json, or a tokenizer folder
    supervise: str = "all_assistant_turns"  # every assistant turn, as TRL's assistant_only_loss teaches
    max_seq_len: int = 2048
    template: ChatTemplate | str = field(default_factory=ChatTemplate)  # or "tokenizer": the tokenizer's own
    format: str = "auto"  # each source's, unless the source names its own
    columns: dict | None = None  # {field: column} renamed in each source's rows, unless the source names its own
    overflow: str = "reject"  # or "drop_turns": keep the longest prefix ending after a whole assistant turn
    reasoning: str = "supervise"
    eval_fraction: float | None = None
    seed: int = 0  # of the eval_fraction split

    def sources(self, partition: str) -> list[Source]:
        """The sources a partition reads: its own, or the train sources split by eval_fraction."""
        given = self.train if partition == "train" or self.eval is None else self.eval
        entries = given if isinstance(given, list) else [given]
        sources = distinct_names([parse_source(entry, partition if self.eval is not None else "train")
                                  for entry in entries])
        return [source if source.columns is not None else replace(source, columns=self.columns)
                for source in sources]

    def validate(self) -> None:
        if self.supervise not in SUPERVISE:
            raise ConvertError(f"supervise must be one of {SUPERVISE}, got {self.supervise!r}")
        if self.reasoning not in POLICIES:
            raise ConvertError(f"reasoning must be one of {POLICIES}, got {self.reasoning!r}")
        if self.format not in ("auto", *FORMATS):
            raise ConvertError(f"format must be auto or one of {FORMATS}, got {self.format!r}")
        if self.overflow not in OVERFLOW:
            raise ConvertError(f"overflow must be one of {OVERFLOW}, got {self.overflow!r}")
        check_columns(self.columns, "columns")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ConvertError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if not self.out:
            raise ConvertError("out: the shard root to write is missing")
        if (self.eval is None) == (self.eval_fraction is None):
            raise ConvertError("give held-out data either as eval sources or as eval_fraction of the train "
                               f"sources, not {'both' if self.eval is not None else 'neither'}")
        if self.eval_fraction is not None and not (isinstance(self.eval_fraction, (int, float))
                                                   and 0 < self.eval_fraction < 1):
            raise ConvertError(f"eval_fraction must be a number in (0, 1), got {self.eval_fraction!r}")
        if not isinstance(self.template, ChatTemplate) and self.template != TOKENIZER_TEMPLATE:
            raise ConvertError(f"template must be a marker template or {TOKENIZER_TEMPLATE!r}, got {self.template!r}")
        for partition in PARTITIONS:
            for source in self.sources(partition):
                if source.format not in ("auto", *FORMATS):
                    raise ConvertError(f"{source.spec}: format must be auto or one of {FORMATS}")
                check_columns(source.columns, f"{partition}: {source.spec}: columns")


def read_sources(name: str, value: Any) -> str | list | None:
    """train_sources / eval_sources: one source or a list of them, as YAML or a notebook gives it, or as papermill's
    `-p` text of a YAML list ("[a.jsonl, b]"), which train_sft's `data` takes too."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "-"):
        value = load_yaml(value, name, ParamError)
    if value is None or is_none_word(value):
        return None
    several = isinstance(value, (list, tuple))
    entries = [str(entry) if isinstance(entry, Path) else entry for entry in (value if several else [value])]
    if not entries or not all(isinstance(entry, (str, dict)) for entry in entries):
        raise ParamError(f"{name}: a source (a file, a folder, a saved dataset, hub:NAME[:CONFIG]:SPLIT) or a "
                         f"non-empty list of them, got {shown(value)}")
    return entries if several else entries[0]


def read_template(name: str, value: Any) -> dict | str | None:
    """template: None (the default markers), "tokenizer", or a mapping of markers (YAML, a notebook, or -p text)."""
    return value if value == TOKENIZER_TEMPLATE else coerce(name, value, dict | None)


def read_columns(name: str, value: Any) -> dict | None:
    """columns: None, a mapping {field: column}, or its text as papermill's `-p` gives it: YAML ("{prompt:
    question}") or the flag's FIELD=COLUMN,... form. Its fields are checked with the conversion's settings."""
    if isinstance(value, str) and "=" in value and not value.strip().startswith("{"):
        try:
            return columns_from_text(value, name)
        except ConvertError as err:
            raise ParamError(str(err)) from None
    return coerce(name, value, dict | None)


def located(sources: str | list | dict | None) -> str | list | dict | None:
    """Sources with their local paths taken from the project root, as a notebook's are; Hub sources as they are."""
    if isinstance(sources, list):
        return [located(source) for source in sources]
    if isinstance(sources, dict):
        return {**sources, "path": located(sources["path"])} if isinstance(sources.get("path"), str) else sources
    return sources if sources is None or sources.startswith("hub:") else str(resolve_path(sources))


@dataclass(frozen=True)
class ConvertParams(Params):
    """convert_chat.ipynb's parameters: ConvertSpec's keys under the notebook's names, its paths from the project
    root. Defaults: the small sample in examples/chat through the byte tokenizer."""

    train_sources: str | list = parsed_by(read_sources, "examples/chat/train.jsonl")
    eval_sources: str | list | None = parsed_by(read_sources, "examples/chat/eval.jsonl")  # None: eval_fraction
    eval_fraction: float | None = None
    seed: int = 0
    out: str = "outputs/data/chat-sample"
    data_format: str = "auto"
    columns: dict | None = parsed_by(read_columns, None)
    tokenizer: str = "byte"
    template: dict | str | None = parsed_by(read_template, None)
    supervise: str = "all_assistant_turns"
    reasoning: str = "supervise"
    max_seq_len: int = 256
    overflow: str = "reject"
    overwrite: bool = True

    def validate(self) -> None:
        if self.train_sources is None:
            raise ParamError("train_sources: a source or a list of them is needed")
        if self.data_format not in ("auto", *FORMATS):
            raise ParamError(f"data_format must be auto or one of {', '.join(FORMATS)}, got {shown(self.data_format)}")

    def spec(self) -> ConvertSpec:
        """The conversion these parameters ask for (ConvertSpec checks it as convert() starts)."""
        template = self.template if self.template == TOKENIZER_TEMPLATE else ChatTemplate.from_dict(self.template or {})
        return ConvertSpec(train=located(self.train_sources), eval=located(self.eval_sources),
                           out=str(resolve_path(self.out)), eval_fraction=self.eval_fraction, seed=self.seed,
                           format=self.data_format, columns=self.columns, template=template, supervise=self.supervise,
                           tokenizer=self.tokenizer if self.tokenizer == "byte" else str(resolve_path(self.tokenizer)),
                           reasoning=self.reasoning, max_seq_len=self.max_seq_len, overflow=self.overflow)


class HeldOut:
    """The conversations eval_fraction sends to eval, kept as the train partition reads its sources and read back
    for the eval partition, so each source is read (and a Hub source downloaded) once.

    JSON Lines in `scratch` (gone with the conversion's staging, as SeenConversations' file): memory stays flat
    however many are held out, and the file is bounded by the input. Each line is one conversation, in the order
    read: `source` (its source's index in the spec's train list), `where` (its row), `digest` (of the
    conversation as split, after `reasoning: strip`, which is not applied twice), and the Conversation's fields.
    Every value is one JSON writes and reads back as it was: conversation_digest has already written the
    messages, tools, text and context_turns as JSON before the split chose a side (a value JSON cannot write, a
    datetime or bytes from a Parquet column, fails there, as it did when each partition read the sources), and
    meta holds strings and integers (check_metadata, the row's id). Rows give no tuple or non-string key to
    change on the way: JSON's own, and `datasets`' lists and dicts (it refuses Arrow's map type). Text is written
    as UTF-8, not escaped, so the file is about the size of the held-out rows; a lone surrogate passes through
    (surrogatepass) and is read back as itself.
    """

    def __init__(self, scratch: Path) -> None:
        self.path = scratch / "held_out.jsonl"
        self._out = open(self.path, "w", encoding="utf-8", errors="surrogatepass", newline="\n", buffering=1 << 20)
        self.rows_seen = 0  # every conversation the train partition read, either side of the split
        self.sources: list[dict] = []  # each train source as the train partition recorded it (files, Hub commit)
        self._records: Iterator[tuple[int, str, int, Conversation]] | None = None
        self._pending: tuple[int, str, int, Conversation] | None = None

    def keep(self, source: int, where: str, digest: int, conversation: Conversation) -> None:
        record = {"source": source, "where": where, "digest": digest,
                  **{item.name: getattr(conversation, item.name) for item in fields(Conversation)}}
        self._out.write(json.dumps(record, ensure_ascii=False) + "\n")  # UTF-8: a third of escapes' size

    def finish(self, rows_seen: int) -> None:
        """The train partition read every source: what it kept can be read back."""
        self._out.close()
        self.rows_seen = rows_seen

    def of_source(self, source: int) -> Iterator[tuple[str, int, Conversation]]:
        """(where, digest, conversation) of each conversation kept from the spec's `source`-th train source, in the
        order read; asked of each source in turn, as the train partition read them."""
        if self._records is None:
            self._records = self._read()
            self._pending = next(self._records, None)
        while self._pending is not None and self._pending[0] == source:
            yield self._pending[1:]
            self._pending = next(self._records, None)

    def _read(self) -> Iterator[tuple[int, str, int, Conversation]]:
        with open(self.path, encoding="utf-8", errors="surrogatepass", newline="\n") as lines:
            for line in lines:
                record = json.loads(line)
                yield record["source"], record["where"], record["digest"], Conversation(
                    **{item.name: record[item.name] for item in fields(Conversation)})

    def close(self) -> None:
        self._out.close()
        if self._records is not None:
            self._records.close()


class SeenConversations:
    """Digests of the conversations read so far, per partition, in an SQLite file in `scratch`.

    Exact duplicates can only be found by remembering every conversation; on
    disk (SQLite's B-tree, with its bounded page cache) that memory stays flat
    however many rows go by. `convert` keeps the file in its staging output,
    so it goes when the conversion ends, or with the staging a kill left.
    """

    def __init__(self, scratch: Path) -> None:
        self._db = sqlite3.connect(scratch / "seen.sqlite")
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


def held_out(digest: int, seed: int, fraction: float) -> bool:
    """Whether eval_fraction sends this conversation to eval: a uniform draw from its content and the seed."""
    draw = hashlib.blake2b(f"{seed}:{digest}".encode(), digest_size=8).digest()
    return int.from_bytes(draw, "little") / 2 ** 64 < fraction


def read_conversations(source: Source, reader: SourceReader, fmt: str) -> Iterator[tuple[str, Conversation]]:
    """(where, conversation) of each row of a source, its columns renamed and its format named or taken from its
    first row."""
    if source.format != "auto":
        fmt, named_by = source.format, f"the source's 'format: {source.format}'"
    else:
        named_by = f"--format {fmt}"
    named = fmt != "auto"
    columns = source.columns or {}
    for where, row in reader.rows(source):
        row = renamed(row, columns, where)
        fmt = detect(row, where) if fmt == "auto" else fmt
        if named:
            check_named_format(row, fmt, where, named_by)
        yield where, read_row(row, fmt, where)


def check_named_format(row: object, fmt: str, where: str, named_by: str) -> None:
    """A row without the fields of the format named for its source: the error says who named the format (not
    detected, so no first row chose it) and what the row looks like."""
    missing = [key for key in FIELDS[fmt] if isinstance(row, dict) and row.get(key) is None]
    if not missing:
        return
    try:
        looks = f"; this row is {detect(row, where)}"
    except ConvertError:
        looks = ""
    raise ConvertError(f"{where}: no {missing[0]!r} field, which the {fmt} format needs (the format was given by "
                       f"{named_by}{looks}); name the rows' format, or auto to take it from each source's first row")


class PartitionReader:
    """The accepted examples of one partition, its counts filled in as they go by. Under eval_fraction (`held`)
    the train partition reads the sources and keeps what the split sends to eval; the eval partition reads that."""

    def __init__(self, partition: str, spec: ConvertSpec, renderer: Renderer, reader: SourceReader,
                 seen: SeenConversations, held: HeldOut | None = None) -> None:
        self.partition, self.spec, self.renderer, self.reader, self.seen = partition, spec, renderer, reader, seen
        self.held = held
        self.rejected: Counter = Counter()
        self.per_task: Counter = Counter()
        self.per_source: Counter = Counter()
        self.supervised_per_source: Counter = Counter()
        self.rows_read = 0  # the conversations of this partition (eval_fraction sends the others away)
        self.rows_seen = 0  # every conversation read from the sources, either side of the split
        self.truncated = 0  # conversations kept without their last turns (overflow: drop_turns)
        self.sources: list[dict] = []

    def examples(self) -> Iterator[Example]:
        kept = self.held is not None and self.partition == "eval"  # read from what the train partition kept
        if kept:
            self.rows_seen = self.held.rows_seen
        for index, source in enumerate(self.spec.sources(self.partition)):
            rows_before, checked = self.rows_read, 0
            conversations = self.held.of_source(index) if kept else self._conversations(index, source)
            for where, digest, conversation in conversations:
                example = self._accept(where, digest, conversation, source, checked < IDENTITY_SAMPLE)
                checked += example is not None
                if example is not None:
                    yield example
            described = (self.held.sources[index] if kept
                         else describe(source, self.reader.hub_commits.get(source.spec)))
            if self.held is not None and not kept:
                self.held.sources.append(described)
            self.sources.append({**described, "rows_read": self.rows_read - rows_before})
        if self.held is not None and not kept:
            self.held.finish(self.rows_seen)
        if not sum(self.per_source.values()):
            raise ConvertError(self._nothing_accepted())

    def _nothing_accepted(self) -> str:
        """Why the partition is empty: the split sent it nothing (say the fraction and what to change), or every
        conversation it got was rejected (say how many, and why)."""
        names = ", ".join(source.spec for source in self.spec.sources(self.partition))
        fraction = self.spec.eval_fraction
        if fraction is None or self.rows_read or not self.rows_seen:
            return (f"{self.partition}: no conversation was accepted from {names} ({self.rows_read} read, "
                    f"rejected: {dict(self.rejected)})")
        share = fraction if self.partition == "eval" else 1 - fraction
        advice = ("raise eval_fraction (--eval-fraction), or give held-out sources (--eval; eval_sources in the "
                  "notebook)" if self.partition == "eval" else "lower eval_fraction (--eval-fraction)")
        return (f"{self.partition}: eval_fraction {fraction} sent none of the {self.rows_seen:,} conversations read "
                f"from {names} to {self.partition} (about {share * self.rows_seen:.2g} expected); {advice}")

    def _conversations(self, index: int, source: Source) -> Iterator[tuple[str, int, Conversation]]:
        """(where, digest, conversation) of each conversation of the partition read from the spec's `index`-th
        source, its reasoning stripped where the policy says; those eval_fraction sends to eval, the train
        partition keeps for it (`held`)."""
        for where, conversation in read_conversations(source, self.reader, self.spec.format):
            if self.spec.reasoning == "strip":
                conversation = stripped(conversation)
            try:
                digest = conversation_digest(conversation)
            except TypeError as err:  # json's words: "Object of type bytes is not JSON serializable"
                raise ConvertError(f"{where}: its messages or tools hold a value a chat template cannot be given "
                                   f"({err}): a date, bytes or a decimal of a Parquet or Arrow column; cast that "
                                   "column to text before converting") from None
            self.rows_seen += 1
            if self.spec.eval_fraction is not None and held_out(digest, self.spec.seed, self.spec.eval_fraction) != (
                    self.partition == "eval"):
                if self.held is not None:
                    self.held.keep(index, where, digest, conversation)
                continue
            yield where, digest, conversation

    def _accept(self, where: str, digest: int, conversation: Conversation, source: Source, check_identity: bool
                ) -> Example | None:
        """The example of one conversation of the partition, or None where it is rejected."""
        self.rows_read += 1
        reason = self._rejection(digest, conversation)
        if reason is None:
            try:
                kept = self._rendered(conversation, check_identity)
            except ConvertError as err:
                raise ConvertError(f"{where}: {err}") from None
            if kept is None:
                reason = "too_long"
            elif kept[0] is not conversation:  # overflow: drop_turns kept its leading turns
                # They may be another conversation whole (chats that share their first turns): a duplicate of it,
                # never written twice.
                reason = self._rejection(conversation_digest(kept[0]), kept[0])
                self.truncated += reason is None
        if reason is not None:
            self.rejected[reason] += 1
            return None
        conversation, input_ids, labels = kept
        # example_id is the shard's key (loss_metadata.jsonl joins on it): generated, so unique in the partition;
        # the row's own id, which data sets repeat, stays beside it as row_id (cflib.data.formats).
        meta = {"source": source.name, "origin": where, **conversation.meta,
                "example_id": f"{self.partition}-{self.rows_read:08d}"}
        self.per_task[meta.get("task", "")] += 1
        self.per_source[meta["source"]] += 1
        self.supervised_per_source[meta["source"]] += sum(label != IGNORE_INDEX for label in labels)
        return Example(input_ids, labels, meta)

    def _rendered(self, conversation: Conversation, check_identity: bool
                  ) -> tuple[Conversation, list[int], list[int]] | None:
        """The conversation as it is written (itself, or with overflow: drop_turns its leading turns), its ids and
        labels; None where it is longer than max_seq_len and overflow keeps no part of it."""
        input_ids, labels = self.renderer.render(conversation)
        if check_identity and conversation.text is None:
            _check_identity(self.renderer, conversation, input_ids)
        if len(input_ids) <= self.spec.max_seq_len:
            return conversation, input_ids, labels
        if self.spec.overflow != "drop_turns" or conversation.text is not None:  # text has no turns to drop
            return None
        # The longest prefix first: one that ends after a whole assistant turn of the completion (never within
        # an answer, never within a prompt's context turns), has an answer to teach, ends on a taught turn (one of
        # weight 0 would cost length and teach nothing), and fits.
        ends = [turn + 1 for turn, message in enumerate(conversation.messages[:-1])
                if message["role"] == "assistant" and turn >= conversation.context_turns]
        for end in reversed(ends):
            prefix = replace(conversation, messages=conversation.messages[:end])
            if prefix.messages[-1].get("weight", 1) == 0 or prefix.has_empty_answer(self.spec.supervise):
                continue
            input_ids, labels = self.renderer.render(prefix)
            if len(input_ids) <= self.spec.max_seq_len:
                if check_identity:
                    _check_identity(self.renderer, prefix, input_ids)
                return prefix, input_ids, labels
        return None

    def _rejection(self, digest: int, conversation: Conversation) -> str | None:
        if not self.seen.add(self.partition, digest):
            return "duplicate"
        if self.partition == "eval" and self.seen.has("train", digest):
            return "duplicate_of_train"
        if conversation.has_empty_answer(self.spec.supervise) or conversation.text == "":
            return "empty_answer"
        return None

    def stats(self) -> dict:
        return {"rows_read": self.rows_read, "rejected": {k: self.rejected[k] for k in REJECTIONS},
                "truncated_examples": self.truncated, "examples_per_task": dict(sorted(self.per_task.items())),
                "examples_per_source": dict(sorted(self.per_source.items())),
                "supervised_tokens_per_source": dict(sorted(self.supervised_per_source.items())),
                "sources": self.sources}


def _check_identity(renderer: Renderer, conversation: Conversation, input_ids: list[int]) -> None:
    """The rendered ids must be apply_chat_template's, token for token (a renderer that has a reference)."""
    reference = getattr(renderer, "reference_ids", None)
    if reference is None:
        return
    expected = reference(conversation)
    if expected != input_ids:
        at = next((i for i, (a, b) in enumerate(zip(expected, input_ids)) if a != b), min(len(expected),
                                                                                          len(input_ids)))
        raise ConvertError(f"the rendered ids differ from apply_chat_template's at token {at} ({len(input_ids)} "
                           f"against {len(expected)} tokens)")


def convert(spec: ConvertSpec, overwrite: bool = False) -> dict[str, dict]:
    """Write spec.out/{train,eval}; returns each partition's sft.idx.json. All or nothing."""
    spec.validate()
    out = Path(spec.out)
    inputs = {"tokenizer": None if spec.tokenizer == "byte" else spec.tokenizer, **_local_inputs(spec)}
    def check() -> None:
        check_output_folder(out, inputs, ConvertError, owned=_written_by_convert, overwrite=overwrite, what="out:")

    check()
    renderer = make_renderer(spec.tokenizer, spec.template, spec.supervise, spec.reasoning)
    conversion = {"tokenizer": tokenizer_record(renderer.tokenizer), "template": renderer.record(),
                  "supervise": spec.supervise, "reasoning": spec.reasoning, "format": spec.format,
                  "overflow": spec.overflow,
                  "split": None if spec.eval_fraction is None else {"eval_fraction": spec.eval_fraction,
                                                                     "seed": spec.seed}}
    # `out` checked again under its lock: a conversion that wrote it meanwhile is never silently replaced. The
    # scratch files (seen digests, the conversations held out for eval, `datasets`' cache) live in the staging
    # folder, gone before it is published.
    with exclusive_output(out, check, ConvertError, what="out:") as staging:
        with scratch_folder(staging / "scratch") as scratch:
            seen, reader = SeenConversations(scratch), SourceReader(scratch)
            # eval_fraction: the train partition keeps the conversations it sends to eval, read once.
            held = None if spec.eval_fraction is None else HeldOut(scratch)
            notes: list[str | None] = []  # each partition's warning, given once the shard is written
            try:
                for partition in PARTITIONS:  # train first: eval conversations also in train are rejected
                    rows = PartitionReader(partition, spec, renderer, reader, seen, held)
                    stats: dict = {}
                    # The generator fills `stats` as it ends, before write_partition reads index_extra.
                    write_partition(staging / partition, _filling(rows, stats),
                                    vocab_size=renderer.tokenizer.vocab_size, eos_token_id=renderer.eos_token_id,
                                    max_seq_len=spec.max_seq_len,
                                    index_extra={"conversion": {**conversion, "stats": stats}},
                                    sidecar_fields=loss_metadata.FIELDS)
                    notes.append(too_long_warning(partition, stats, spec))
            finally:
                seen.close()
                if held is not None:
                    held.close()
    for note in filter(None, notes):  # a conversion that failed has its error to say instead
        warnings.warn(note, ConvertWarning, stacklevel=2)
    return {p: json.loads((out / p / "sft.idx.json").read_text()) for p in ("train", "eval")}


def too_long_warning(partition: str, stats: dict, spec: ConvertSpec) -> str | None:
    """What to say where more than TOO_LONG_WARNING of a partition's conversations were rejected as too long.
    convert() warns it, the one function the command line and the notebook both call, so neither loses them
    silently."""
    count, rows = stats["rejected"]["too_long"], stats["rows_read"]
    if count <= TOO_LONG_WARNING * rows:
        return None
    advice = ("raise max_seq_len (--max-seq-len), or keep their leading whole assistant turns with overflow: "
              "drop_turns (--overflow drop_turns)" if spec.overflow == "reject" else
              "with overflow: drop_turns, not even their first answer fits: raise max_seq_len (--max-seq-len)")
    return (f"{partition}: {count:,} of {rows:,} conversations ({count / rows:.1%}) are longer than max_seq_len "
            f"{spec.max_seq_len} and were rejected (too_long); {advice}")


def _filling(rows: PartitionReader, stats: dict) -> Iterator[Example]:
    yield from rows.examples()
    stats.update(rows.stats())


def _local_inputs(spec: ConvertSpec) -> dict[str, str]:
    """Each local source by the name an error about the output folder gives it."""
    named = {}
    for partition in PARTITIONS:
        sources = [source for source in spec.sources(partition) if not source.is_hub]
        for source in sources:
            named[partition if len(sources) == 1 else f"{partition} ({source.name})"] = source.spec
    return named


_PARTITION_FILES = {"input_ids.bin", "labels.bin", "examples.jsonl", "sft.idx.json", loss_metadata.SIDECAR}


def _written_by_convert(entry: Path) -> bool:
    """A partition this command wrote: only its files, its manifest recording a conversion (not the embedded
    tasks', which record theirs to mix with converted data)."""
    if entry.name not in PARTITIONS or entry.is_symlink() or not entry.is_dir():
        return False
    if {item.name for item in entry.iterdir()} - _PARTITION_FILES:
        return False
    try:
        index = read_json(entry / "sft.idx.json", ConvertError, "shard index")
    except ConvertError:  # unreadable, too large or too deep: not this command's
        return False
    conversion = index.get("conversion") if isinstance(index, dict) else None
    return isinstance(conversion, dict) and conversion.get("format") != "embedded"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cflib.data convert",
                                     description="Conversations (files, folders, saved datasets, the Hub) to an SFT "
                                                 "token shard (train/ and eval/).")
    parser.add_argument("--spec", help="YAML with any of: " + ", ".join(f.name for f in fields(ConvertSpec))
                        + "; flags win")
    parser.add_argument("--train", nargs="+", help="sources: files (.jsonl .json .parquet .arrow .csv), folders, "
                                                   "saved datasets, hub:NAME[:CONFIG]:SPLIT[@REVISION]")
    parser.add_argument("--eval", nargs="+", help="held-out sources (or --eval-fraction)")
    parser.add_argument("--eval-fraction", type=float, dest="eval_fraction",
                        help="hold out this fraction of the train sources' conversations instead")
    parser.add_argument("--seed", type=int, help="of the --eval-fraction split (default 0)")
    parser.add_argument("--out")
    parser.add_argument("--format", choices=("auto", *FORMATS), help="the rows' format (default: auto, per source)")
    parser.add_argument("--columns", metavar="FIELD=COLUMN,...",
                        help="read a format's field from another column, renamed before the format is detected "
                             "(prompt=question,completion=answer)")
    parser.add_argument("--tokenizer", help='"byte" (default), a local tokenizer.json, or a tokenizer folder')
    parser.add_argument("--template", help='"tokenizer" (the tokenizer folder\'s chat template), or a YAML/JSON '
                                           "file of role markers (default: the byte tokenizer's markers)")
    parser.add_argument("--supervise", choices=SUPERVISE, help=f"which assistant turns are taught (default "
                                                                f"{ConvertSpec.supervise})")
    parser.add_argument("--reasoning", choices=POLICIES, help="what the loss does with reasoning (default: "
                                                              "supervise)")
    parser.add_argument("--max-seq-len", type=int, dest="max_seq_len",
                        help=f"longer conversations are rejected and counted, or as --overflow says (default "
                             f"{ConvertSpec.max_seq_len})")
    parser.add_argument("--overflow", choices=OVERFLOW,
                        help="a conversation longer than --max-seq-len: reject it (default), or drop_turns: keep its "
                             "longest prefix that ends after a whole assistant turn, counted as truncated")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an out folder this command wrote (nothing else in it); a spec may say "
                             "overwrite: true")
    return parser


def spec_from_args(argv: Sequence[str]) -> tuple[ConvertSpec, bool]:
    args = _parser().parse_args(argv)
    raw: dict = {}
    if args.spec:
        raw = read_yaml(args.spec, ConvertError, "conversion spec") or {}
        if not isinstance(raw, dict):
            raise ConvertError(f"{args.spec}: a conversion spec is a mapping")
    known = [f.name for f in fields(ConvertSpec)]
    unknown = sorted(set(raw) - {*known, "overwrite"})
    if unknown:
        raise ConvertError(f"{args.spec}: unknown key(s) {unknown}; known: {[*known, 'overwrite']}")
    overwrite = raw.pop("overwrite", False)
    if not isinstance(overwrite, bool):
        raise ConvertError(f"{args.spec}: overwrite must be true or false, got {shown(overwrite)}")
    if args.eval is not None and args.eval_fraction is not None:
        raise ConvertError("--eval and --eval-fraction both give held-out data: keep --eval SOURCE ... for "
                           "held-out sources, or --eval-fraction F to hold out part of the train sources")
    raw.update({k: v for k, v in vars(args).items() if k in known and v is not None and k != "template"})
    if args.columns is not None:
        raw["columns"] = columns_from_text(args.columns, "--columns")
    if args.eval_fraction is not None:
        raw.pop("eval", None)  # the flag chooses the split over the spec's eval sources
    elif args.eval is not None:
        raw.pop("eval_fraction", None)  # and held-out sources over the spec's split
    where = "template"
    if args.template == TOKENIZER_TEMPLATE:
        raw["template"] = TOKENIZER_TEMPLATE
    elif args.template:
        raw["template"], where = read_yaml(args.template, ConvertError, "template file"), args.template
    elif args.spec:
        where = args.spec
    missing = [name for name in ("train", "eval", "out") if not raw.get(name)
               and not (name == "eval" and raw.get("eval_fraction") is not None)]
    if missing:
        raise ConvertError(f"missing {', '.join(missing)} (flags --{' --'.join(missing)} or the spec file"
                           + ("; --eval-fraction F instead of eval sources)" if "eval" in missing else ")"))
    template = raw.pop("template", None) or {}
    if template != TOKENIZER_TEMPLATE:
        template = ChatTemplate.from_dict(template, where)
    return ConvertSpec(**{**raw, "template": template}), overwrite or args.overwrite


def summary(indexes: dict[str, dict]) -> str:
    """A few lines per partition: what was written and what was rejected."""
    lines = []
    for partition, index in indexes.items():
        stats = index["conversion"]["stats"]
        rejected = ", ".join(f"{k} {v}" for k, v in stats["rejected"].items())
        lines.append(f"{partition:5s} {index['examples']:,} examples of {stats['rows_read']:,} rows, "
                     f"{index['num_tokens']:,} tokens, {index['supervised_tokens']:,} supervised; "
                     f"rejected: {rejected}" + (f"; truncated (turns dropped): {stats['truncated_examples']:,}"
                                                if index["conversion"].get("overflow") == "drop_turns" else ""))
        if len(stats["examples_per_source"]) > 1:
            lines += [f"      {name}: {count:,} examples, {stats['supervised_tokens_per_source'][name]:,} supervised"
                      for name, count in stats["examples_per_source"].items()]
    any_index = next(iter(indexes.values()))
    conversion = any_index["conversion"]
    template = conversion["template"]
    lines.append(f"vocab_size {any_index['vocab_size']}, eos_token_id {any_index['eos_token_id']}, "
                 f"max_seq_len {any_index['max_seq_len']}, tokenizer {conversion['tokenizer']['kind']}, template "
                 + (f"tokenizer (sha256 {template['sha256'][:12]}...)" if template["kind"] == "tokenizer"
                    else "markers"))
    return "\n".join(lines)


def show_example(shard: ShardPartition, index: int, tokenizer: ByteTokenizer | JsonTokenizer | PretrainedTokenizer
                 ) -> str:
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
    with one_line_errors("convert", ConvertError), warnings.catch_warnings():
        warnings.showwarning = _one_line(warnings.showwarning)
        spec, overwrite = spec_from_args(argv)
        indexes = convert(spec, overwrite)
    print(f"wrote {spec.out}")
    print(summary(indexes))


def _one_line(show: Any) -> Any:
    """warnings.showwarning that gives a ConvertWarning as one line of the command's (no source line under it)."""
    def shown_on_one_line(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, ConvertWarning):
            print(f"convert: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *args, **kwargs)
    return shown_on_one_line
