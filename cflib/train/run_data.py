"""The data a run trains and evaluates on: one shard root, or a mixture of several (cflib.data.mixture), opened and
checked before any step, with the train examples it keeps and its mixture's plan.

The process that prepares a run checks every partition (cflib.data.preflight: hashes, tokens, labels, caps); a
torchrun worker opens them unchecked (its launcher checked them). A mixture's sources are checked one by one, each
error naming its entry of `data`, then against each other (vocabulary, EOS, tokenizer and chat template).

Examples longer than seq_len stop the run (`overlong_examples: error`), or are left out of every partition
(`drop`): a function of the lengths and seq_len alone, so every rank and every resume keeps the same ones, before
train_tasks, filters, a mixture's draw and packing see them. Each partition's (and source's) drop is counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from cflib.data.filters import parse_filters, select
from cflib.data.mixture import MixedPartition, MixturePlan, as_mixture, check_agreement, plan_mixture, source_names
from cflib.data.preflight import preflight
from cflib.data.shards import MAX_COUNT, ShardError, ShardPartition, open_shard
from cflib.data.tasks import TASKS, ensure_embedded_shard
from cflib.errors import ParamError, shown
from cflib.jsonio import read_json
from cflib.paths import resolve_path
from cflib.train.params import TrainParams

Partition = ShardPartition | MixedPartition
# How much opening checks: the preflight (tokens, hashes, the manifest's findings), every token alone, or nothing
# but the supervised counts (a torchrun worker, whose launcher ran the preflight).
Check = Literal["preflight", "tokens", "counts"]


@dataclass
class RunData:
    """A run's partitions, checked; `root` is the shard root (a mixture's first source: every source shares its
    tokenizer and chat template)."""

    root: Path
    train: Partition
    eval: Partition
    preflight: dict | None  # partition (and source) -> report; None where the launcher checked
    filter_counts: dict | None
    overlong: dict | None  # overlong_examples: drop: seq_len and each partition's (and source's) drop
    mixture: MixturePlan | None


def shard_root(path: str) -> Path:
    """Where `data` (or a source's path) points: the embedded shard, written once, or a shard root."""
    return ensure_embedded_shard(resolve_path("outputs/data")) if path == "embedded" else resolve_path(path)


# What a refusal of examples longer than seq_len offers besides raising it.
DROP_REMEDY = "set overlong_examples: drop to leave them out of training and evaluation"


def open_root(root: Path, vocab_size: int, seq_len: int | None, check: Check, release_ready: bool,
              trains: bool = True) -> tuple[ShardPartition, ShardPartition, dict | None]:
    """A shard root's train and eval partitions, with their preflight reports where the preflight ran; seq_len None
    holds them to the shard's own cap alone (overlong_examples: drop, whose caller leaves the longer ones out). A
    root that does not train (a mixture's source of weight 0) needs no train/: it is not opened, and an empty view
    of the root's eval/ stands for it, so the mixture's sources keep their places and none of its examples is fed."""
    partitions = ("train", "eval") if trains else ("eval",)
    if check != "preflight":
        opened = {partition: open_shard(root, partition, vocab_size=vocab_size, seq_len=seq_len,
                                        check_tokens=check == "tokens", seq_len_remedy=DROP_REMEDY)
                  for partition in partitions}
        reports = None
    else:
        checked = {partition: preflight(root, partition, vocab_size=vocab_size, seq_len=seq_len,
                                        require_release_ready=release_ready, seq_len_remedy=DROP_REMEDY)
                   for partition in partitions}
        opened = {partition: shard for partition, (shard, _) in checked.items()}
        reports = {partition: report for partition, (_, report) in checked.items()}
    held_out = opened["eval"]
    if trains:
        return opened["train"], held_out, reports
    train = held_out.subset(np.zeros(0, dtype=np.int64))
    train.held_out_only = True  # its digest is a marker, never eval/'s manifest (resume_identity.partition_digest)
    return train, held_out, reports


def open_mixture(sources: tuple[dict, ...], vocab_size: int, seq_len: int, drop: bool, check: Check,
                 release_ready: bool) -> tuple[MixedPartition, MixedPartition, dict | None, dict]:
    """Every source's partitions read as one, each source checked (errors name its entry of `data`) and, with
    `drop`, left without its examples longer than seq_len (their counts returned last, keyed as the preflight's
    reports), then the sources against each other."""
    names = source_names(sources)
    roots, trains, evals, reports, dropped = [], [], [], {}, {}
    for index, (source, name) in enumerate(zip(sources, names)):
        root = shard_root(source["path"])
        twin = next((i for i, seen in enumerate(roots) if root.resolve() == seen.resolve()), None)
        if twin is not None:
            raise ParamError(f"data[{index}] ({source['path']}) is the shard root of data[{twin}] "
                             f"({sources[twin]['path']}); each source appears once")
        try:
            train, held_out, report = open_root(root, vocab_size, None if drop else seq_len, check, release_ready,
                                                trains=source["weight"] > 0)
            if drop:
                train, held_out, counts = drop_overlong(train, held_out, seq_len, name)
                dropped.update(counts)
        except ShardError as err:
            role = ", held out only: its eval/ is read, never its train/" if source["weight"] == 0 else ""
            raise ShardError(f"data[{index}] (source {name!r}{role}): {err}") from None
        roots.append(root)
        trains.append(train)
        evals.append(held_out)
        reports.update({f"{partition} ({name})": value for partition, value in (report or {}).items()})
    for partitions in (trains, evals):
        check_agreement(names, roots, partitions)
    # A source of weight 0 is held out only: its train part is empty (open_root), never drawn nor counted.
    return (MixedPartition(trains, names), MixedPartition(evals, names),
            reports if check == "preflight" else None, dropped)


def without_overlong(shard: ShardPartition, seq_len: int, partition: str) -> tuple[ShardPartition, dict]:
    """The examples of `shard` that fit seq_len, in order, and the count of those left out; a partition none of
    whose examples fits is a ShardError naming it and the seq_len that would keep one."""
    fits = shard.lengths <= seq_len
    counts = {"examples": len(shard), "dropped": int((~fits).sum()), "kept": int(fits.sum()),
              "longest": int(shard.lengths.max())}
    if not fits.any():
        shortest = int(shard.lengths.min())
        raise ShardError(f"{shard.directory}: overlong_examples: drop would leave no {partition} example: all "
                         f"{len(shard):,} are longer than seq_len {seq_len} (the shortest has {shortest} tokens); "
                         f"raise seq_len to at least {shortest}")
    return (shard if fits.all() else shard.subset(np.flatnonzero(fits))), counts


def drop_overlong(train: ShardPartition, held_out: ShardPartition, seq_len: int, source: str | None = None
                  ) -> tuple[ShardPartition, ShardPartition, dict]:
    """A root's partitions without their examples longer than seq_len, and each one's count, keyed "train" and
    "eval" ("train (NAME)" for a mixture's source, as the preflight's reports); a held-out-only source's empty train
    part is neither filtered nor counted."""
    kept, counts = {}, {}
    for partition, shard in (("train", train), ("eval", held_out)):
        if getattr(shard, "held_out_only", False):
            kept[partition] = shard
            continue
        key = partition if source is None else f"{partition} ({source})"
        kept[partition], counts[key] = without_overlong(shard, seq_len, partition)
    return kept["train"], kept["eval"], counts


def describe_overlong(overlong: dict) -> str:
    """What overlong_examples: drop left out, as one line: each partition's (and source's) count."""
    counts = overlong["partitions"]
    return (f"examples longer than seq_len {overlong['seq_len']} left out: "
            + ", ".join(f"{name} {c['dropped']:,} of {c['examples']:,}" for name, c in counts.items())
            + f" (the longest: {max(c['longest'] for c in counts.values()):,} tokens)")


def kept_examples(params: TrainParams, train_data: Partition) -> tuple[Partition, dict | None]:
    """The train examples of train_tasks and filters, and each filter's count; an empty result is an error."""
    if params.train_tasks is not None:
        missing = [task for task in params.train_tasks if task not in train_data.tasks()]
        if missing:
            raise ParamError(f"train_tasks: no example of {train_data.directory} has task {missing[0]!r}; its "
                             f"tasks: {', '.join(train_data.tasks())}")
        train_data = train_data.only_tasks(params.train_tasks)
    if params.filters is None:
        return train_data, None
    keep, counts = select(train_data.rows, train_data.supervised_counts, parse_filters(params.filters, "filters"),
                          params.seed)
    if not len(keep):
        emptied = next(key for key, count in counts.items() if count == 0)
        raise ParamError(f"filters: {emptied} keeps no train example of {train_data.directory} ({counts}); "
                         "loosen it")
    return train_data.subset(keep), counts


def kept_data(params: TrainParams, filter_counts: dict | None = None) -> str:
    """The train examples a run keeps, as an error about them names them."""
    chosen = [name for name in ("train_tasks", "filters") if getattr(params, name) is not None]
    chosen += ["overlong_examples: drop"] if params.overlong_examples == "drop" else []
    if not chosen:
        return "the train data"
    return f"the train examples {' and '.join(chosen)} keep" + (f" ({filter_counts})" if filter_counts else "")


def open_data(params: TrainParams, vocab_size: int, check: Check) -> RunData:
    """The run's data, checked as `check` says, without the examples overlong_examples: drop leaves out, the train
    examples kept, a mixture's plan drawn up."""
    sources = as_mixture(params.data, params.examples_per_epoch)
    drop = params.overlong_examples == "drop"
    if sources is None:
        root = shard_root(params.data)
        train, held_out, reports = open_root(root, vocab_size, None if drop else params.seq_len, check,
                                             params.require_release_ready)
        train, held_out, dropped = drop_overlong(train, held_out, params.seq_len) if drop else (train, held_out, {})
    else:
        train, held_out, reports, dropped = open_mixture(sources, vocab_size, params.seq_len, drop, check,
                                                         params.require_release_ready)
        root = train.parts[0].directory.parent
    train, filter_counts = kept_examples(params, train)
    mixture = None
    if sources is not None:
        mixture = plan_mixture(train.source_names, [part.directory.parent for part in train.parts],
                               [source["weight"] for source in sources], [len(part) for part in train.parts],
                               params.examples_per_epoch, params.seed)
    overlong = {"seq_len": params.seq_len, "partitions": dropped} if drop else None
    return RunData(root, train, held_out, reports, filter_counts, overlong, mixture)


def count_train_examples(params: TrainParams) -> int:
    """Train examples an epoch takes, from the data's index alone: examples_per_epoch, else every example of the
    trained sources (of train_tasks only, when named); the embedded set's count is known before it is written."""
    if params.examples_per_epoch is not None:
        return params.examples_per_epoch
    if isinstance(params.data, tuple):  # a source of weight 0 is evaluated, never trained on
        return sum(_root_examples(source["path"], params.train_tasks) for source in params.data if source["weight"])
    return _root_examples(params.data, params.train_tasks)


def _root_examples(data: str, tasks: tuple[str, ...] | None) -> int:
    if data == "embedded":
        return sum(count for task, (_, count) in TASKS.items() if tasks is None or task in tasks)
    index = resolve_path(data) / "train" / "sft.idx.json"
    if not index.is_file():
        raise ShardError(f"{index}: missing (is {index.parent.parent} a shard root with train/ and eval/?)")
    if tasks is not None:
        return len(ShardPartition(index.parent).only_tasks(tasks))
    document = read_json(index, ShardError, "shard index")
    examples = document.get("examples") if isinstance(document, dict) else None
    if isinstance(examples, bool) or not isinstance(examples, int) or not 0 <= examples <= MAX_COUNT:
        raise ShardError(f"{index}: 'examples' must be an integer in [0, 2**48], got {shown(examples)}")
    return examples
