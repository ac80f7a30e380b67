"""Which train examples a run (or a curriculum stage) keeps, from the merged example metadata.

`filters` is a mapping of any of: `difficulties` and `domains` and `tasks`
(lists of names: an example is kept when its field is one of them; domain is
the `domain` field, or `group` where there is none, as in the loss
weighting), `max_supervised_tokens` (an example supervising more is dropped)
and `max_examples` (a count, or `all`: a seeded, deterministic choice of that
many among those the other filters kept, in their original order). They apply
in that order, and each one's count of examples kept is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cflib.errors import ParamError

NAME_FILTERS = {"difficulties": "difficulty", "tasks": "task", "domains": "domain"}
KEYS = (*NAME_FILTERS, "max_supervised_tokens", "max_examples")


@dataclass(frozen=True)
class Filters:
    difficulties: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    domains: tuple[str, ...] | None = None
    max_supervised_tokens: int | None = None
    max_examples: int | None = None  # None: all


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ParamError(f"{where} must be a positive integer, got {value!r}")
    return value


def parse_filters(raw: Any, where: str) -> Filters:
    """A filters mapping checked; `where` names it in errors (e.g. "stage 'warmup' filters")."""
    if not isinstance(raw, dict):
        raise ParamError(f"{where} must be a mapping of {', '.join(KEYS)}, got {raw!r}")
    unknown = [key for key in raw if key not in KEYS]
    if unknown:
        raise ParamError(f"{where}: unknown filter {unknown[0]!r}; known: {', '.join(KEYS)}")
    names: dict[str, tuple[str, ...] | None] = {}
    for key in NAME_FILTERS:
        value = raw.get(key)
        if isinstance(value, str):
            value = [value]
        if value is not None and (not isinstance(value, (list, tuple)) or not value
                                  or not all(isinstance(item, str) and item for item in value)):
            raise ParamError(f"{where}: {key} must be a non-empty list of names, got {value!r}")
        names[key] = None if value is None else tuple(value)
    cap = raw.get("max_supervised_tokens")
    count = raw.get("max_examples")
    return Filters(**names,
                   max_supervised_tokens=None if cap is None else _positive_int(cap, f"{where}: max_supervised_tokens"),
                   max_examples=None if count in (None, "all") else _positive_int(count, f"{where}: max_examples"))


def _field(row: dict, name: str) -> Any:
    return row.get("domain", row.get("group")) if name == "domain" else row.get(name)


def select(rows: list[dict], supervised_counts: np.ndarray, filters: Filters, seed: int) -> tuple[np.ndarray, dict]:
    """The indices of the examples kept, in order, and how many each filter kept (`examples` first)."""
    keep = np.arange(len(rows))
    counts = {"examples": len(rows)}
    for key, field in NAME_FILTERS.items():
        wanted = getattr(filters, key)
        if wanted is not None:
            keep = keep[[_field(rows[i], field) in wanted for i in keep]] if len(keep) else keep
            counts[key] = len(keep)
    if filters.max_supervised_tokens is not None:
        keep = keep[supervised_counts[keep] <= filters.max_supervised_tokens]
        counts["max_supervised_tokens"] = len(keep)
    if filters.max_examples is not None and filters.max_examples < len(keep):
        # Its own generator: the choice depends on the seed and the candidates alone.
        chosen = np.random.default_rng(seed).choice(len(keep), size=filters.max_examples, replace=False)
        keep = keep[np.sort(chosen)]
    if filters.max_examples is not None:
        counts["max_examples"] = len(keep)
    counts["kept"] = len(keep)
    return keep, counts
