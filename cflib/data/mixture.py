"""Several shard roots mixed at set weights: one global order of examples per epoch (docs/data.md#mixing-sources).

A run's `data` is one shard root, or a list of sources `{path, weight, name}`.
The sources must agree on what a token means (vocabulary, EOS, tokenizer and
chat template, as each partition's manifest records them); `MixedPartition`
reads their partitions as one, source after source, sharing the mapped files.

`MixturePlan` draws each epoch: source s gives `per_epoch[s]` examples, its
share of `examples_per_epoch` (largest remainders, so the counts add up
exactly), taken in turn from an endless stream of fresh shuffles of the
source, so every example of a source is seen once before any is seen again;
a source smaller than its share is drawn with repetition (several shuffles
an epoch). A source of weight 0 is held out only: it gives no train example,
and its eval/ is evaluated with the others' (its root needs no train/:
cflib.train.run_data.open_root never opens one). The epoch's draws are then
shuffled together. Everything is a function of (seed, epoch): the order is
the same on every rank and after a resume, with nothing to save.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from cflib.data.shards import ShardPartition
from cflib.errors import ParamError, shown
from cflib.yamlio import load_yaml

SOURCE_KEYS = ("path", "weight", "name")
MAX_SOURCES = 1024  # a mixture names at most this many shard roots: each is opened and checked before step 1
# Keeps the sources' shuffles apart from the epochs' (np.random.default_rng([seed, epoch])).
_SOURCE_STREAM = 0x6D6978


def _source(entry: Any, where: str) -> dict:
    """One source of a mixture, checked: {path, weight, name}."""
    if not isinstance(entry, dict):
        raise ParamError(f"{where} must be a mapping {{path: ROOT, weight: W}} (name optional), got {shown(entry)}")
    unknown = [key for key in entry if key not in SOURCE_KEYS]
    if unknown:
        raise ParamError(f"{where}: unknown key {shown(unknown[0])}; a source has {', '.join(SOURCE_KEYS)}")
    path, weight, name = entry.get("path"), entry.get("weight"), entry.get("name")
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ParamError(f"{where}.path must name a shard root: train/ and eval/, or eval/ alone for a source of "
                         f"weight 0 (evaluated, never trained on), got {shown(path)}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ParamError(f"{where}.weight ({path}) must be a finite number >= 0 (0: evaluated, never trained on), "
                         f"got {shown(weight)}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ParamError(f"{where}.name ({path}) must be a non-empty string or left out, got {shown(name)}")
    return {"path": str(path), "weight": float(weight), "name": name}


def data_sources(name: str, value: Any) -> str | tuple[dict, ...]:
    """`data`: "embedded" or one shard root (a string), or a mixture: a list of {path, weight, name} (from YAML, a
    notebook, or papermill's text of the list)."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "-"):
        value = load_yaml(value, name, ParamError)
    if isinstance(value, (str, Path)):
        if not str(value).strip():
            raise ParamError(f"{name} must be \"embedded\", a shard root, or a list of sources")
        return str(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise ParamError(f"{name} must be \"embedded\", a shard root, or a non-empty list of sources "
                         f"{{path, weight, name}}, got {shown(value)}")
    if len(value) > MAX_SOURCES:
        raise ParamError(f"{name}: {len(value):,} sources, more than the {MAX_SOURCES:,} a mixture may name")
    sources = tuple(_source(entry, f"{name}[{index}]") for index, entry in enumerate(value))
    if not any(source["weight"] > 0 for source in sources):
        raise ParamError(f"{name}: every source has weight 0, so nothing would be trained on; give one a positive "
                         "weight")
    seen: dict[str, int] = {}
    for index, source in enumerate(sources):
        key = os.path.normpath(os.path.expanduser(source["path"]))
        if key in seen:
            raise ParamError(f"{name}[{index}]: {source['path']} is {name}[{seen[key]}] too; each source appears once")
        seen[key] = index
    source_names(sources, name)  # distinct names, or an error naming the two
    return sources


def source_names(sources: Sequence[dict], where: str = "data") -> list[str]:
    """Each source's name: its own `name`, else its folder's; two folders of one name are named by their paths."""
    folder = [Path(source["path"]).name or source["path"] for source in sources]
    names = [source["name"] or (folder[i] if folder.count(folder[i]) == 1 else source["path"])
             for i, source in enumerate(sources)]
    for index, name in enumerate(names):
        if names.index(name) != index:
            raise ParamError(f"{where}[{index}] ({sources[index]['path']}) and {where}[{names.index(name)}] "
                             f"({sources[names.index(name)]['path']}) are both named {name!r}; give each its own name")
    return names


def as_mixture(data: str | tuple[dict, ...], examples_per_epoch: int | None) -> tuple[dict, ...] | None:
    """The sources a run mixes: its list; one root with examples_per_epoch is a mixture of one; else None."""
    if isinstance(data, tuple):
        return data
    return ({"path": data, "weight": 1.0, "name": None},) if examples_per_epoch is not None else None


def template_identity(partition: ShardPartition) -> str:
    """The chat template a partition was rendered through: the SHA-256 of the tokenizer's template, or of the role
    markers as the manifest records them; "unrecorded" where no conversion is recorded."""
    template = (partition.index.get("conversion") or {}).get("template")
    if not isinstance(template, dict):
        return "unrecorded"
    if isinstance(template.get("sha256"), str):
        return template["sha256"]
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(partition: ShardPartition) -> str:
    """The tokenizer a partition was converted with: its kind and the SHA-256 of its files (not where they were)."""
    tokenizer = (partition.index.get("conversion") or {}).get("tokenizer")
    if not isinstance(tokenizer, dict):
        return "unrecorded"
    return json.dumps({"kind": tokenizer.get("kind"), "sha256": tokenizer.get("sha256")}, sort_keys=True)


# What every source of a mixture must share, as its manifest records it: a token means the same in each.
AGREEMENT = {"vocab_size": lambda part: part.vocab_size, "eos_token_id": lambda part: part.eos_token_id,
             "tokenizer": tokenizer_identity, "chat template sha256": template_identity}


def check_agreement(names: Sequence[str], roots: Sequence[Path], partitions: Sequence[ShardPartition]) -> None:
    """ParamError naming the key and the two sources where a source disagrees with the first."""
    for key, read in AGREEMENT.items():
        first = read(partitions[0])
        for name, root, partition in zip(names, roots, partitions):
            if read(partition) != first:
                raise ParamError(
                    f"data: source {name!r} ({root}) has {key} {read(partition)}, source {names[0]!r} ({roots[0]}) "
                    f"has {first}: the sources of a mixture must be converted with one tokenizer and chat template")


class MixedPartition:
    """Several partitions read as one: source 0's examples, then source 1's, ...; item i is (input_ids, labels) as
    ShardPartition gives it, and examples are keyed by (source, index), never by id alone. The mapped files are
    shared, not copied."""

    def __init__(self, parts: Sequence[ShardPartition], names: Sequence[str]) -> None:
        self.parts, self.source_names = list(parts), tuple(names)
        sizes = [len(part) for part in self.parts]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # source s: starts[s]:starts[s + 1]
        self.source_of = np.repeat(np.arange(len(sizes)), sizes)
        self.rows = [row for part in self.parts for row in part.rows]
        self.lengths = np.concatenate([part.lengths for part in self.parts])
        self.supervised_counts = np.concatenate([part.supervised_counts for part in self.parts])
        first = self.parts[0]
        self.vocab_size, self.eos_token_id = first.vocab_size, first.eos_token_id  # the same in every source
        # The conversion every source shares (check_agreement): its tokenizer and chat template name the mixture's.
        self.index = {"conversion": first.index.get("conversion", {})}
        caps = [part.max_seq_len for part in self.parts]
        self.max_seq_len = None if None in caps else max(caps)
        self.directory = ", ".join(str(part.directory) for part in self.parts)  # what messages name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        source = int(self.source_of[index])
        return self.parts[source][int(index - self.starts[source])]

    def tasks(self) -> list[str]:
        return sorted({str(row.get("task")) for row in self.rows})

    def only_tasks(self, tasks: Sequence[str]) -> "MixedPartition":
        return self.subset(np.array([i for i, row in enumerate(self.rows) if str(row.get("task")) in tasks],
                                    dtype=np.int64))

    def subset(self, keep: np.ndarray) -> "MixedPartition":
        """The examples at `keep` (increasing: each source keeps its block), the sources unchanged, maybe emptied."""
        keep = np.asarray(keep, dtype=np.int64)
        if (np.diff(keep) <= 0).any():
            raise ValueError("a mixture's subset keeps its examples in order")
        parts = [part.subset(keep[(keep >= start) & (keep < stop)] - start)
                 for part, start, stop in zip(self.parts, self.starts[:-1], self.starts[1:])]
        return MixedPartition(parts, self.source_names)

    def supervised_tokens(self, indices: Sequence[int] | None = None) -> int:
        counts = self.supervised_counts if indices is None else self.supervised_counts[np.asarray(indices)]
        return int(counts.sum())


def recorded_roots(data: dict) -> list[tuple[str, Path]]:
    """(name, shard root) of every source a run evaluated, from its record's `data`: a mixture's sources in its order
    (held-out-only ones too), else the one root, named by its folder."""
    plan = (data.get("mixture") or {}).get("sources")
    if plan is None:
        return [(Path(data["root"]).name, Path(data["root"]))]
    return [(source["name"], Path(source["root"])) for source in plan]


def recorded_held_out(data: dict, vocab_size: int | None = None) -> ShardPartition | MixedPartition:
    """A run's held-out set as it evaluated it, from its record's `data`: every source's eval/ read as one, else the
    one root's eval/ (`data["root"]` is a mixture's first source alone), without the examples longer than the seq_len
    a run of overlong_examples: drop left out (`data["overlong"]`)."""
    sources = recorded_roots(data)
    parts = [ShardPartition(root / "eval", vocab_size=vocab_size) for _, root in sources]
    if data.get("overlong"):
        parts = [part.subset(np.flatnonzero(part.lengths <= data["overlong"]["seq_len"])) for part in parts]
    return MixedPartition(parts, [name for name, _ in sources]) if data.get("mixture") else parts[0]


@dataclass(frozen=True)
class MixturePlan:
    """Which examples each epoch draws from each source (module docstring)."""

    names: tuple[str, ...]
    roots: tuple[str, ...]
    weights: tuple[float, ...]  # as given; the shares are their normalised values
    available: np.ndarray  # train examples of each source (after train_tasks and filters)
    per_epoch: np.ndarray  # examples drawn from each source every epoch
    seed: int

    @property
    def examples_per_epoch(self) -> int:
        return int(self.per_epoch.sum())

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.available)[:-1]]).astype(np.int64)

    def passes(self) -> np.ndarray:
        """How many times an epoch draws each source's examples, on average (0 for a held-out-only source)."""
        return np.divide(self.per_epoch, self.available, out=np.zeros(len(self.names)), where=self.available > 0)

    def multiplicity(self) -> np.ndarray:
        """How many times an epoch draws each example of the mixed partition, on average."""
        return np.repeat(self.passes(), self.available)

    def draw(self, source: int, epoch: int) -> np.ndarray:
        """Source `source`'s examples of `epoch` (from 1), as indices within the source."""
        count, drawn = int(self.available[source]), int(self.per_epoch[source])
        if drawn == 0:  # weight 0: held out only
            return np.empty(0, dtype=np.int64)
        cycles, within = np.divmod((epoch - 1) * drawn + np.arange(drawn), count)
        picks = np.empty(drawn, dtype=np.int64)
        for cycle in np.unique(cycles):
            shuffle = np.random.default_rng([self.seed, _SOURCE_STREAM, source, int(cycle)]).permutation(count)
            picks[cycles == cycle] = shuffle[within[cycles == cycle]]
        return picks

    def epoch(self, epoch: int) -> np.ndarray:
        """The epoch's examples (indices of the mixed partition), every source's draw shuffled together."""
        drawn = np.concatenate([start + self.draw(source, epoch) for source, start in enumerate(self.starts)])
        return drawn[np.random.default_rng([self.seed, epoch]).permutation(len(drawn))]

    def realised(self, examples: np.ndarray, supervised_counts: np.ndarray) -> list[dict]:
        """Per source: the examples and supervised tokens among `examples` (repeats counted), and their shares."""
        examples = np.asarray(examples, dtype=np.int64)
        source = np.searchsorted(self.starts, examples, side="right") - 1
        counts = np.bincount(source, minlength=len(self.names))
        tokens = np.bincount(source, weights=supervised_counts[examples], minlength=len(self.names))
        return [{"name": name, "examples": int(counts[s]), "example_share": float(counts[s] / max(counts.sum(), 1)),
                 "supervised_tokens": int(tokens[s]),
                 "supervised_token_share": float(tokens[s] / max(tokens.sum(), 1))}
                for s, name in enumerate(self.names)]

    def record(self) -> dict:
        """The plan as the record writes it: each source's weight, share, examples and draw per epoch."""
        shares = np.asarray(self.weights) / sum(self.weights)
        return {"examples_per_epoch": self.examples_per_epoch, "seed": self.seed,
                "draw": "each source's share of examples_per_epoch (largest remainders), from fresh shuffles of the "
                        "source in turn; a source smaller than its share is drawn with repetition",
                "sources": [{"name": name, "root": root, "weight": weight, "share": float(share),
                             "train_examples": int(available), "per_epoch": int(drawn),
                             "passes_per_epoch": float(passes), "with_repetition": bool(drawn > available),
                             "held_out_only": weight == 0}
                            for name, root, weight, share, available, drawn, passes in
                            zip(self.names, self.roots, self.weights, shares, self.available, self.per_epoch,
                                self.passes())]}


def plan_mixture(names: Sequence[str], roots: Sequence[str], weights: Sequence[float], available: Sequence[int],
                 examples_per_epoch: int | None, seed: int) -> MixturePlan:
    """Each source's examples per epoch: its share of examples_per_epoch (None: every trained source's examples
    together), by largest remainders; a trained source (weight above 0) left with no example, or drawing none,
    is an error naming it."""
    available = np.asarray(available, dtype=np.int64)
    trained = np.asarray(weights, dtype=np.float64) > 0
    for name, root, count, trains in zip(names, roots, available, trained):
        if count == 0 and trains:
            raise ParamError(f"data: source {name!r} ({root}) has no train example (after train_tasks and filters); "
                             "remove it from the mixture, loosen the selection, or give it weight 0 to evaluate "
                             "it only")
    total = int(available[trained].sum()) if examples_per_epoch is None else examples_per_epoch
    exact = total * np.asarray(weights, dtype=np.float64) / sum(weights)
    per_epoch = np.floor(exact).astype(np.int64)
    per_epoch[np.argsort(per_epoch - exact, kind="stable")[:total - int(per_epoch.sum())]] += 1
    for name, root, weight, drawn in zip(names, roots, weights, per_epoch):
        if drawn == 0 and weight > 0:
            raise ParamError(f"data: source {name!r} ({root}) at weight {weight:g} draws no example of the "
                             f"{total} an epoch takes; raise examples_per_epoch or its weight")
    return MixturePlan(tuple(names), tuple(str(root) for root in roots), tuple(float(w) for w in weights),
                       available, per_epoch, seed)


def mixture_table(plan: dict, realised: list[dict]) -> str:
    """A plan (MixturePlan.record()) and the shares of the examples and supervised tokens some draw took from each
    source, as a markdown table."""
    lines = ["| source | weight | share | train examples | per epoch | passes | share of examples "
             "| share of supervised tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for source, drawn in zip(plan["sources"], realised):
        lines.append(f"| {source['name']} | {source['weight']:g} | {source['share']:.3f} | "
                     f"{source['train_examples']:,} | {source['per_epoch']:,} | {source['passes_per_epoch']:.2f}"
                     f"{' (repeated)' if source['with_repetition'] else ''}"
                     f"{' (held out only)' if source.get('held_out_only') else ''} | {drawn['example_share']:.3f} | "
                     f"{drawn['supervised_token_share']:.3f} |")
    return "\n".join(lines)
