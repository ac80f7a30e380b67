"""Semantic loss metadata: `loss_metadata.jsonl` beside `examples.jsonl` in a shard partition.

One JSON row per example, `{"example_id": ..., "domain": ..., "mode": ...,
"difficulty": ...}`: what an example is about, for the cells of the loss
weighting and the filters of a curriculum stage. It never changes tokens,
labels or offsets: the reader merges its fields into the example index, and
its ids must be exactly the index's, each once, so that no example is
silently left without its metadata or described twice.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, TextIO

from cflib.errors import shown
from cflib.jsonio import json_lines

SIDECAR = "loss_metadata.jsonl"
# What the converter copies from a chat row into the sidecar.
FIELDS = ("domain", "mode", "difficulty")
# The index's own keys: metadata describes an example, it never moves one.
INDEX_KEYS = ("offset", "num_tokens", "supervised_tokens")


class LossMetadataError(ValueError):
    """A sidecar that does not describe its partition's examples exactly once; names the file and row."""


def write_row(handle: TextIO, example_id: str, meta: dict, fields: Iterable[str]) -> None:
    """One example's sidecar row: its id and whichever of `fields` its metadata has."""
    row = {"example_id": example_id, **{name: meta[name] for name in fields if name in meta}}
    handle.write(json.dumps(row, sort_keys=True) + "\n")


def _read(path: Path) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for number, row in json_lines(path, LossMetadataError, where=lambda number: f"{path}: line {number}"):
        if not isinstance(row, dict) or not isinstance(row.get("example_id"), str):
            raise LossMetadataError(f"{path}: line {number} is not a JSON object with a string 'example_id'")
        moved = [key for key in INDEX_KEYS if key in row]
        if moved:
            raise LossMetadataError(f"{path}: line {number} sets {moved[0]!r}, which only examples.jsonl holds")
        named = next((key for key in FIELDS if key in row and not isinstance(row[key], str)), None)
        if named is not None:  # grouped and filtered by name: strings only
            raise LossMetadataError(f"{path}: line {number}: {named!r} must be a string, got {shown(row[named])}")
        example_id = row.pop("example_id")
        if example_id in found:
            raise LossMetadataError(f"{path}: line {number}: example_id {shown(example_id)} appears twice")
        found[example_id] = row
    return found


def merge(directory: Path, rows: list[dict]) -> tuple[list[dict], list[str] | None]:
    """The index rows with the sidecar's fields merged in, and those fields' names; (rows, None) without one."""
    path = directory / SIDECAR
    if not path.is_file():
        return rows, None
    sidecar = _read(path)
    ids = [row.get("example_id") for row in rows]
    missing = [example_id for example_id in ids if example_id not in sidecar]
    extra = sorted(set(sidecar) - set(ids))
    if missing or extra or len(set(ids)) != len(ids):
        what = (f"{len(missing)} example(s) of examples.jsonl have no row (first {missing[0]!r})" if missing else
                f"{len(extra)} row(s) name no example of examples.jsonl (first {extra[0]!r})" if extra else
                "examples.jsonl repeats an example_id, so its rows cannot be told apart")
        raise LossMetadataError(f"{path}: its example_id set must equal examples.jsonl's exactly: {what}")
    merged = []
    for row in rows:
        extra_fields = sidecar[row["example_id"]]
        clash = next((key for key, value in extra_fields.items() if key in row and row[key] != value), None)
        if clash is not None:
            raise LossMetadataError(f"{path}: example_id {row['example_id']!r} says {clash} "
                                    f"{extra_fields[clash]!r}, examples.jsonl says {row[clash]!r}")
        merged.append({**row, **extra_fields})
    return merged, sorted({key for fields in sidecar.values() for key in fields})
