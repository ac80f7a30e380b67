"""Held-out evaluation: token-mean SFT loss and greedy exact match.

Each example is evaluated on its own: examples are right-padded into batches,
and under the causal mask no real token attends to a pad, so batching changes
nothing but speed. A mixture's held-out set is every source's, and both
figures are also given per source (`loss_by_source`, `exact_match_by_source`).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from cflib.data.mixture import MixedPartition
from cflib.data.shards import IGNORE_INDEX, ShardPartition, collate
from cflib.model.decoder import TRMoEModel
from cflib.model.generate import Decoder
from cflib.ops.loss import chunked_cross_entropy_sum


def autocast(device: torch.device, bf16: bool, cache: bool = True) -> contextlib.AbstractContextManager:
    """BF16 autocast when bf16; cache: keep each weight's cast for the context's other uses (off inside a CUDA
    graph's capture, whose memory the cache would outlive)."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _sources(shard: ShardPartition | MixedPartition) -> tuple[tuple[str, ...], np.ndarray]:
    """The sources of a partition's examples (a mixture's, or one) and each example's source."""
    if isinstance(shard, MixedPartition):
        return shard.source_names, shard.source_of
    return ("",), np.zeros(len(shard), dtype=np.int64)


def _batches(lengths: np.ndarray, sources: np.ndarray, micro_batch: int) -> list[tuple[int, np.ndarray]]:
    """(source, examples) of each evaluation batch: one source's examples, of similar lengths (less padding)."""
    order = np.lexsort((lengths, sources))  # by source, then by length (stable)
    bounds = np.flatnonzero(np.diff(sources[order])) + 1
    return [(int(sources[run[0]]), run[start:start + micro_batch]) for run in np.split(order, bounds)
            for start in range(0, len(run), micro_batch)]


@torch.no_grad()
def eval_loss(model: TRMoEModel, shard: ShardPartition | MixedPartition, micro_batch: int,
              device: str | torch.device, bf16: bool = False, loss_chunk_tokens: int = 1024,
              fp32_loss: bool = True) -> dict:
    """Mean cross-entropy over every supervised token of the partition (and of each source of a mixture)."""
    device = torch.device(device)
    names, sources = _sources(shard)
    loss_sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    supervised = np.zeros(len(names), dtype=np.int64)
    with _eval_mode(model):
        for source, members in _batches(shard.lengths, sources, micro_batch):
            input_ids, labels = collate([shard[int(i)] for i in members], shard.eos_token_id)
            with autocast(device, bf16):
                hidden = model(input_ids.to(device))
                batch_sum, count = chunked_cross_entropy_sum(hidden, model.head_weight, labels.to(device),
                                                             loss_chunk_tokens, fp32_loss)
            loss_sums[source] += batch_sum.double()
            supervised[source] += count
    result = {"loss": float(loss_sums.sum()) / int(supervised.sum()), "supervised_tokens": int(supervised.sum()),
              "examples": len(shard)}
    if isinstance(shard, MixedPartition):
        result["loss_by_source"] = {name: float(loss_sums[s]) / int(supervised[s]) for s, name in enumerate(names)}
    return result


def final_turn(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an example into the prompt before its last supervised span and that span."""
    supervised = (labels != IGNORE_INDEX).nonzero().flatten()
    end = int(supervised[-1]) + 1
    start = end - 1
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    # labels[start] is the target of position start, so the prompt runs through start.
    return input_ids[:start + 1], labels[start:end]


def scored_examples(shard: ShardPartition | MixedPartition, limit: int | None) -> np.ndarray:
    """The held-out examples exact match decodes: every one with None. A limit takes each source's tasks' prompts
    in turn (each task's in file order), so that every source and task is scored: a file sorted by task would
    otherwise give the first `limit` of one task."""
    if limit is None or limit >= len(shard):
        return np.arange(len(shard))
    _, sources = _sources(shard)
    groups: dict[tuple[int, str], int] = {}  # (source, task) -> its place among its source's tasks
    tasks_of_source: dict[int, int] = defaultdict(int)
    turn, rank = np.empty(len(shard), dtype=np.int64), np.empty(len(shard), dtype=np.int64)
    seen: dict[tuple[int, str], int] = defaultdict(int)
    for index, row in enumerate(shard.rows):
        key = (int(sources[index]), str(row.get("task", "all")))
        if key not in groups:
            groups[key] = tasks_of_source[key[0]]
            tasks_of_source[key[0]] += 1
        turn[index], rank[index] = groups[key], seen[key]
        seen[key] += 1
    # The first prompt of every (source, task), then the second of each, ...: task by task within a round, the
    # sources alternating, so that a limit of one per source scores every source.
    return np.lexsort((sources, turn, rank))[:limit]


def exact_match(model: TRMoEModel, shard: ShardPartition | MixedPartition, bf16: bool = False,
                limit: int | None = None, batch_size: int = 64) -> dict:
    """Greedy-decode each held-out prompt; a hit reproduces the answer and its EOS exactly.

    Decodes through cflib.model.generate's KV cache (CUDA graphs on a GPU), prompts of all
    lengths batched together, on the model's device; each prompt gets as many new tokens as its
    answer has, with no EOS stop, so the generated ids are what one full forward per token would
    choose.
    Returns the rate per `task` (from examples.jsonl) and `overall`, the rate per `group`,
    the first few decoded samples, and how the decoder ran (CUDA graphs, kernels).
    """
    chosen = scored_examples(shard, limit)
    count = len(chosen)
    targets = {}
    prompts = []
    for index in chosen.tolist():
        prompt, target = final_turn(*shard[index])
        targets[index] = target.tolist()
        prompts.append(prompt)
    decoder = Decoder(model, max_batch=batch_size, autocast_dtype=torch.bfloat16 if bf16 else None)
    answers = decoder.generate(prompts, [len(targets[i]) for i in targets]) if count else []
    scores = score_answers(shard, {index: (targets[index], answer) for index, answer in zip(targets, answers)})
    generated = {index: (prompt.tolist(), targets[index], answer)
                 for index, prompt, answer in zip(targets, prompts, answers)}
    return {**scores, "decoder": decoder.path(), "answers": generated}


def answer_texts(shard: ShardPartition | MixedPartition, answers: dict[int, tuple[list[int], list[int], list[int]]],
                 decode: Callable[[list[int]], str]) -> list[dict]:
    """exact_match's answers as text, in held-out order: {example_id, task, prompt, answer, reference, hit}
    (an answer's EOS and what follows it left out)."""
    eos = shard.eos_token_id

    def answer(ids: list[int]) -> str:
        return decode(ids[:ids.index(eos)] if eos in ids else ids)

    texts = []
    for index, (prompt, target, generated) in sorted(answers.items()):
        row = shard.rows[index]
        texts.append({"example_id": row.get("example_id"), "task": str(row.get("task", "all")),
                      "prompt": decode(prompt), "answer": answer(generated), "reference": answer(target),
                      "hit": generated == target})
    return texts


def score_answers(shard: ShardPartition | MixedPartition, answers: dict[int, tuple[list[int], list[int]]]) -> dict:
    """exact_match's rates from {example index: (target ids, generated ids)}."""
    hits = {index: generated == target for index, (target, generated) in answers.items()}
    per_task: dict[str, list[bool]] = defaultdict(list)
    per_group: dict[str, list[bool]] = defaultdict(list)
    names, sources = _sources(shard)
    per_source: dict[str, list[bool]] = {name: [] for name in names}
    for index, hit in hits.items():
        row = shard.rows[index]
        per_task[str(row.get("task", "all"))].append(hit)
        per_group[f"{row.get('task', 'all')}/{row.get('group', 'all')}"].append(hit)
        per_source[names[sources[index]]].append(hit)
    rates = {task: float(np.mean(values)) for task, values in sorted(per_task.items())}
    rates["overall"] = float(np.mean(list(hits.values()))) if hits else 0.0
    samples = [{"example_id": shard.rows[i].get("example_id"), "task": shard.rows[i].get("task"),
                "hit": hits[i], "generated_ids": answers[i][1]} for i in sorted(hits)[:8]]
    scores = {"exact_match": rates,
              "exact_match_by_group": {g: float(np.mean(v)) for g, v in sorted(per_group.items())},
              "examples": len(hits), "samples": samples}
    if isinstance(shard, MixedPartition):
        scores["exact_match_by_source"] = {name: float(np.mean(v)) if v else None for name, v in per_source.items()}
    return scores
