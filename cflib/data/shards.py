"""SFT token shards in the public format (docs/data.md): write, open, validate, batch.

A shard root holds `train/` and `eval/`; each partition has `input_ids.bin`
(uint32 LE), `labels.bin` (int32 LE, causally aligned: labels[j] is the target
of position j, -100 where unsupervised), `examples.jsonl` and `sft.idx.json`.
Files are memory-mapped; every check runs when a partition is opened, so a bad
shard fails before any training step, naming the file and the row. Token
checks run over chunks of rows, so their memory does not grow with the shard;
a process that another has already checked for (a torchrun worker) opens with
`check_tokens=False` and only counts the supervised labels.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from cflib.atomic import atomic_directory
from cflib.data import loss_metadata
from cflib.errors import shown
from cflib.jsonio import json_lines, read_json

SHARD_FORMAT = "complexity-sft-token-shard-v2"
IGNORE_INDEX = -100
PARTITIONS = ("train", "eval")
# Token checks hold ~40 bytes per token of one chunk at a time: ~40 MiB, whatever the shard's size.
VALIDATION_CHUNK_TOKENS = 1 << 20
# The largest count or offset an index may hold: 2**48 tokens is far past any shard, and far inside int64.
MAX_COUNT = 2**48
# Writers differ on the name of the sequence cap; the first is what we write.
_CAP_KEYS = ("max_seq_len", "max_sequence_length", "sequence_length_cap", "seq_len_cap", "max_seq_length")


class ShardError(ValueError):
    """A shard that does not honour the format; the message names file and row."""


@dataclass
class Example:
    input_ids: Sequence[int]
    labels: Sequence[int]
    meta: dict


def _plain_file_name(name: str) -> bool:
    """A name of a file directly in the partition: no folder separator, not `.` or `..`, not empty."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_partition(directory: str | Path, examples: Iterable[Example], *, vocab_size: int,
                    eos_token_id: int, max_seq_len: int, index_extra: dict | None = None,
                    sidecar_fields: Sequence[str] = ()) -> Path:
    """Write one partition atomically: a finished directory appears, or nothing does.

    Streams: `examples` may be a generator of any length; memory does not grow
    with it. `index_extra` joins sft.idx.json and is read only once the
    examples are exhausted, so a generator may fill it with what it counted.
    `sidecar_fields` of each example's metadata go to loss_metadata.jsonl
    (cflib.data.loss_metadata) instead of examples.jsonl; none: no sidecar.
    """
    directory = Path(directory)
    hashed = ("input_ids.bin", "labels.bin", "examples.jsonl") + ((loss_metadata.SIDECAR,) if sidecar_fields else ())
    with atomic_directory(directory) as staging:
        offset = count = supervised_total = 0
        with open(staging / "input_ids.bin", "wb") as ids_out, open(staging / "labels.bin", "wb") as labels_out, \
                open(staging / "examples.jsonl", "w") as rows_out, \
                open(staging / loss_metadata.SIDECAR, "w") if sidecar_fields else contextlib.nullcontext() as sidecar:
            for count, example in enumerate(examples, start=1):
                ids = np.asarray(example.input_ids, dtype="<u4")
                labels = np.asarray(example.labels, dtype="<i4")
                if ids.shape != labels.shape:
                    raise ShardError(f"example {count - 1}: {ids.size} input ids but {labels.size} labels")
                ids_out.write(ids.tobytes())
                labels_out.write(labels.tobytes())
                supervised = int((labels != IGNORE_INDEX).sum())
                row = {"example_id": example.meta.get("example_id", f"ex-{count - 1:08d}"), "offset": offset,
                       "num_tokens": int(ids.size), "supervised_tokens": supervised}
                row.update({k: v for k, v in example.meta.items() if k not in row and k not in sidecar_fields})
                rows_out.write(json.dumps(row, sort_keys=True) + "\n")
                if sidecar is not None:
                    loss_metadata.write_row(sidecar, row["example_id"], example.meta, sidecar_fields)
                offset += int(ids.size)
                supervised_total += supervised
        index_doc = {
            "format": SHARD_FORMAT, "num_tokens": offset, "examples": count, "supervised_tokens": supervised_total,
            "eos_token_id": eos_token_id, "vocab_size": vocab_size, "max_seq_len": max_seq_len,
            **(index_extra or {}),
            "sha256": {name: sha256_file(staging / name) for name in hashed},
        }
        (staging / "sft.idx.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    return directory


def unchanged_since_written(directory: str | Path) -> bool:
    """Whether a partition that write_partition wrote is there as written: its index of this format, and every
    file the index hashes (the rows and both token files at least) matching its digest. Parses no row: for a
    shard cflib writes and checks itself (the embedded tasks); a run still opens and checks it as any other."""
    directory = Path(directory)
    try:
        index = read_json(directory / "sft.idx.json", ShardError, "shard index")
    except ShardError:
        return False
    hashes = index.get("sha256") if isinstance(index, dict) and index.get("format") == SHARD_FORMAT else None
    if not isinstance(hashes, dict) or not {"input_ids.bin", "labels.bin", "examples.jsonl"} <= set(hashes):
        return False
    return all(_plain_file_name(name) for name in hashes) and _hash_problem(directory, hashes) is None


def _hash_problem(directory: Path, recorded: dict[str, str]) -> str | None:
    """The first file of `recorded` (name -> SHA-256) missing from `directory` or not matching, said; None: none."""
    for name, expected in recorded.items():
        path = directory / name
        if not path.is_file():
            return f"{path}: recorded in sft.idx.json's sha256 but missing (or not a file): the partition is incomplete"
        actual = sha256_file(path)
        if actual != expected:
            return (f"{path}: sha256 {actual[:12]}... does not match sft.idx.json ({expected[:12]}...): the file "
                    "changed after it was written")
    return None


class ShardPartition(torch.utils.data.Dataset):
    """One validated, memory-mapped partition; item i is (input_ids, labels) of example i."""

    def __init__(self, directory: str | Path, *, vocab_size: int | None = None, seq_len: int | None = None,
                 verify_hashes: bool = False, check_tokens: bool = True, seq_len_remedy: str = "drop them") -> None:
        self.directory = Path(directory)
        index_path = self.directory / "sft.idx.json"
        if not index_path.is_file():
            raise ShardError(f"{index_path}: missing (is {self.directory.parent} a shard root with a "
                             f"{self.directory.name}/ partition?)")
        self.index = read_json(index_path, ShardError, "shard index")
        if not isinstance(self.index, dict):
            raise ShardError(f"{index_path}: a shard index is a JSON object, got {type(self.index).__name__}")
        for key in ("format", "num_tokens", "examples", "eos_token_id", "vocab_size"):
            if key not in self.index:
                raise ShardError(f"{index_path}: missing key {key!r}")
        for key in ("num_tokens", "examples", "eos_token_id", "vocab_size", *_CAP_KEYS):
            value = self.index.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise ShardError(f"{index_path}: {key!r} must be an integer in [0, 2**48], got {shown(value)}")
        hashes = self.index.get("sha256")
        if hashes is not None and not (isinstance(hashes, dict) and all(
                isinstance(k, str) and _plain_file_name(k) and isinstance(v, str) for k, v in hashes.items())):
            raise ShardError(f"{index_path}: 'sha256' must map each file name of the partition (no folder, no '.' "
                             f"or '..') to its hex digest, got {shown(hashes)}")
        if self.index["format"] != SHARD_FORMAT:
            raise ShardError(f"{index_path}: format {self.index['format']!r}, expected {SHARD_FORMAT!r}")
        self.vocab_size = int(self.index["vocab_size"])
        self.eos_token_id = int(self.index["eos_token_id"])
        self.max_seq_len = next((int(self.index[k]) for k in _CAP_KEYS if k in self.index), None)
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ShardError(f"{index_path}: eos_token_id {self.eos_token_id} is not a token id below "
                             f"vocab_size {self.vocab_size}")
        if vocab_size is not None and self.vocab_size > vocab_size:
            raise ShardError(f"{index_path}: shard vocab_size {self.vocab_size} exceeds the model's {vocab_size}: "
                             "its token ids have no embedding; convert the data with the model's own tokenizer, or "
                             "train a model of that vocabulary (init_checkpoint; the presets hold 260 byte tokens, "
                             "tr_hash_200m 32,000)")
        self.rows, self.metadata_fields = self._merged_rows()
        self.input_ids = self._map("input_ids.bin", "<u4")
        self.labels = self._map("labels.bin", "<i4")
        if verify_hashes:
            self.check_hashes()
        self.offsets = np.array([row["offset"] for row in self.rows], dtype=np.int64)
        self.lengths = np.array([row["num_tokens"] for row in self.rows], dtype=np.int64)
        self._validate_rows(seq_len, seq_len_remedy)
        # The model's vocabulary is at least the shard's (checked above): ids obey the shard's own.
        # Token checks run once, where the run is prepared; other processes only count labels.
        self.supervised_counts = np.concatenate([
            self._validate_tokens(start, stop) if check_tokens else self._count_supervised(start, stop)
            for start, stop in _row_chunks(self.lengths, VALIDATION_CHUNK_TOKENS)])
        if (self.supervised_counts == 0).any():
            self._fail("labels.bin", int(np.flatnonzero(self.supervised_counts == 0)[0]),
                       "no supervised token (every label is -100); it would train nothing")
        # Writers may count metadata differently; the loss trusts labels.bin, and says so once.
        for row, (meta, count) in enumerate(zip(self.rows, self.supervised_counts)):
            if "supervised_tokens" in meta and meta["supervised_tokens"] != count:
                warnings.warn(f"{self.directory / 'examples.jsonl'}: row {row} says supervised_tokens "
                              f"{meta['supervised_tokens']}, labels.bin supervises {count}; using labels.bin",
                              stacklevel=2)
                break

    def _merged_rows(self) -> tuple[list[dict], list[str] | None]:
        """examples.jsonl's rows with the semantic fields of loss_metadata.jsonl, when there is one."""
        try:
            return loss_metadata.merge(self.directory, self._read_rows())
        except loss_metadata.LossMetadataError as err:
            raise ShardError(str(err)) from None

    def _read_rows(self) -> list[dict]:
        path = self.directory / "examples.jsonl"
        if not path.is_file():
            raise ShardError(f"{path}: missing")
        rows = []
        # Decoded per line, so bad bytes name their line.
        def where(number: int) -> str:
            return f"{path}: row {number - 1} (line {number})"

        for line_number, row in json_lines(path, ShardError, where=where):
            if not isinstance(row, dict):
                raise ShardError(f"{where(line_number)} is not a JSON object")
            for key in ("offset", "num_tokens"):
                value = row.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                    raise ShardError(f"{where(line_number)} lacks an integer {key!r} in [0, 2**48], got "
                                     f"{shown(value)}")
            for key in ("task", "group", "domain"):  # grouped and sorted by name: strings only
                if key in row and not isinstance(row[key], str):
                    raise ShardError(f"{where(line_number)}: {key!r} must be a string, got {shown(row[key])}")
            rows.append(row)
        if len(rows) != self.index["examples"]:
            raise ShardError(f"{path}: {len(rows)} rows but sft.idx.json says examples={self.index['examples']}")
        if not rows:
            raise ShardError(f"{path}: the partition has no examples")
        return rows

    def _map(self, name: str, dtype: str) -> np.ndarray:
        path = self.directory / name
        if not path.is_file():
            raise ShardError(f"{path}: missing")
        expected = int(self.index["num_tokens"]) * 4
        if path.stat().st_size != expected:
            raise ShardError(f"{path}: {path.stat().st_size} bytes, but num_tokens={self.index['num_tokens']} "
                             f"in sft.idx.json needs {expected} (truncated or corrupt)")
        return np.memmap(path, dtype=dtype, mode="r")

    def check_hashes(self) -> list[str]:
        """Every file whose SHA-256 sft.idx.json records must match it; returns the names checked."""
        recorded = self.index.get("sha256") or {}
        if problem := _hash_problem(self.directory, recorded):
            raise ShardError(problem)
        return sorted(recorded)

    def _fail(self, file: str, row: int, what: str) -> None:
        example_id = self.rows[row].get("example_id", "?")
        raise ShardError(f"{self.directory / file}: row {row} (example_id {example_id!r}): {what}")

    def _too_long(self, over: np.ndarray, name: str, cap: int, remedy: str) -> None:
        """The rows `over` exceed `cap`: how many, and the longest by its row (from 0, as every shard error counts
        them), its example_id and where the converter read it (its source's row, from 1); `remedy` follows "raise
        {name} to {longest} or"."""
        row = int(over[np.argmax(self.lengths[over])])
        origin = self.rows[row].get("origin")
        raise ShardError(f"{self.directory / 'examples.jsonl'}: {len(over):,} example(s) exceed {name} {cap}, the "
                         f"longest row {row} (example_id {self.rows[row].get('example_id', '?')!r}"
                         + (f", read from {origin}" if origin else "") + f") with {self.lengths[row]} tokens; "
                         f"examples are never truncated: raise {name} to {self.lengths[row]} or {remedy}")

    def _validate_rows(self, seq_len: int | None, seq_len_remedy: str) -> None:
        """Offsets, lengths and caps of every row, from examples.jsonl alone; `seq_len_remedy` is what an error
        for examples over seq_len offers besides raising it."""
        starts, lengths, total = self.offsets, self.lengths, int(self.index["num_tokens"])
        ends = starts + lengths
        bad = np.flatnonzero((lengths <= 0) | (starts < 0) | (ends > total))
        if bad.size:
            self._fail("examples.jsonl", int(bad[0]), f"offset {starts[bad[0]]} + num_tokens {lengths[bad[0]]} "
                       f"falls outside the {total} tokens of input_ids.bin")
        overlap = np.flatnonzero(starts[1:] < ends[:-1])
        if overlap.size:
            self._fail("examples.jsonl", int(overlap[0]) + 1, "overlaps the previous example")
        for cap, source, remedy in ((self.max_seq_len, "the shard's sequence cap", "drop them"),
                                    (seq_len, "seq_len", seq_len_remedy)):
            over = np.flatnonzero(lengths > cap) if cap is not None else []
            if len(over):
                self._too_long(over, source, cap, remedy)

    def _count_supervised(self, start: int, stop: int) -> np.ndarray:
        flat = _ranges(self.offsets[start:stop], self.lengths[start:stop])
        row_of_token = np.repeat(np.arange(stop - start), self.lengths[start:stop])
        supervised = self.labels[flat] != IGNORE_INDEX
        return np.bincount(row_of_token, weights=supervised, minlength=stop - start).astype(np.int64)

    def _validate_tokens(self, start: int, stop: int) -> np.ndarray:
        """Check every token of rows [start, stop); returns the supervised-token count of each row."""
        starts, lengths = self.offsets[start:stop], self.lengths[start:stop]
        vocab_size = self.vocab_size
        # Vectorised over one chunk of rows: memory is bounded by the chunk, not the shard.
        row_of_token = np.repeat(np.arange(len(starts), dtype=np.int32), lengths)
        flat = _ranges(starts, lengths)
        example_ids = self.input_ids[flat]
        example_labels = self.labels[flat]

        def locate(token: int) -> tuple[int, int]:
            """(shard row, position within the example) of a token of the chunk's flat arrays."""
            row = int(row_of_token[token])
            return start + row, int(flat[token] - starts[row])

        bad = np.flatnonzero(example_ids >= vocab_size)
        if bad.size:
            row, pos = locate(bad[0])
            self._fail("input_ids.bin", row, f"token id {example_ids[bad[0]]} at position {pos} "
                       f"is out of the vocabulary (vocab_size {vocab_size})")
        supervised = example_labels != IGNORE_INDEX
        bad = np.flatnonzero(supervised & ((example_labels < 0) | (example_labels >= vocab_size)))
        if bad.size:
            row, pos = locate(bad[0])
            self._fail("labels.bin", row, f"label {example_labels[bad[0]]} at position {pos} is neither -100 "
                       f"nor a token id below vocab_size {vocab_size}")
        # Causal alignment: a supervised label at j must equal the input token at j + 1.
        is_last = np.zeros(len(flat), dtype=bool)
        is_last[np.cumsum(lengths) - 1] = True
        next_ids = np.empty_like(example_ids)
        next_ids[:-1] = example_ids[1:]
        misaligned = supervised & ~is_last & (example_labels.astype(np.int64) != next_ids.astype(np.int64))
        if misaligned.any():
            first = int(np.flatnonzero(misaligned)[0])
            row, pos = locate(first)
            self._fail("labels.bin", row, f"label {example_labels[first]} at position {pos} is not the next "
                       f"input token {next_ids[first]}: labels are not causally aligned (already shifted)")
        past_end = np.flatnonzero(supervised & is_last)
        if past_end.size:  # its target would be the next example's first token: trained on, never generated
            row, pos = locate(past_end[0])
            self._fail("labels.bin", row, f"label {example_labels[past_end[0]]} at the last position {pos} "
                       "supervises a token past the example's end; the last label of an example must be -100")
        return np.bincount(row_of_token, weights=supervised, minlength=len(starts)).astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, length = int(self.offsets[index]), int(self.lengths[index])
        ids = torch.from_numpy(self.input_ids[start:start + length].astype(np.int64))
        labels = torch.from_numpy(self.labels[start:start + length].astype(np.int64))
        return ids, labels

    def tasks(self) -> list[str]:
        """The `task` values of examples.jsonl, sorted."""
        return sorted({str(row.get("task")) for row in self.rows})

    def only_tasks(self, tasks: Sequence[str]) -> "ShardPartition":
        """A view of the examples whose `task` is one of `tasks`; the mapped files are shared, not copied."""
        return self.subset(np.array([i for i, row in enumerate(self.rows) if str(row.get("task")) in tasks],
                                    dtype=np.int64))

    def subset(self, keep: np.ndarray) -> "ShardPartition":
        """A view of the examples at `keep`, in that order; the mapped files are shared, not copied."""
        view = copy.copy(self)
        view.rows = [self.rows[i] for i in keep]
        view.offsets, view.lengths = self.offsets[keep], self.lengths[keep]
        view.supervised_counts = self.supervised_counts[keep]
        return view

    def supervised_tokens(self, indices: Sequence[int] | None = None) -> int:
        counts = self.supervised_counts if indices is None else self.supervised_counts[np.asarray(indices)]
        return int(counts.sum())


def _row_chunks(lengths: np.ndarray, budget: int) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges of about `budget` tokens each (at least one row)."""
    ends = np.cumsum(lengths)
    start = 0
    while start < len(lengths):
        base = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, base + budget, side="right")))
        yield start, stop
        start = stop


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [s, s + n) without a Python loop."""
    total = int(lengths.sum())
    step = np.ones(total, dtype=np.int64)
    boundaries = np.cumsum(lengths)[:-1]
    step[0] = starts[0]
    step[boundaries] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(step)


def open_shard(root: str | Path, partition: str, *, vocab_size: int | None = None, seq_len: int | None = None,
               verify_hashes: bool = False, check_tokens: bool = True, seq_len_remedy: str = "drop them"
               ) -> ShardPartition:
    if partition not in PARTITIONS:
        raise ShardError(f"unknown partition {partition!r}; a shard root holds {PARTITIONS}")
    root = Path(root)
    if not root.is_dir():
        raise ShardError(f"{root}: no such shard root")
    return ShardPartition(root / partition, vocab_size=vocab_size, seq_len=seq_len, verify_hashes=verify_hashes,
                          check_tokens=check_tokens, seq_len_remedy=seq_len_remedy)


def collate(batch: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a list of examples to the longest; pads carry label -100."""
    longest = max(ids.numel() for ids, _ in batch)
    input_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, lab) in enumerate(batch):
        input_ids[row, :ids.numel()] = ids
        labels[row, :lab.numel()] = lab
    return input_ids, labels

