"""Synthetic SFT shards for measuring: random-token rows, and examples of realistic SFT lengths.

Both kinds supervise all but the first third of each row or example, and are
deterministic given their seed. Token ids are uniform random and never the
EOS id 0 except where an example ends: the figures they give are throughput,
never quality.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cflib.data.shards import IGNORE_INDEX, Example, write_partition

EOS_TOKEN_ID = 0
# Realistic lengths (docs/measuring.md): log-normal with mean/median = exp(sigma^2 / 2) = 1.35, i.e. a median of
# 300 tokens gives a mean of 405, before the cap.
LENGTH_SIGMA = math.sqrt(2 * math.log(1.35))
SHORTEST_EXAMPLE = 2  # one token to predict from, and the EOS it predicts


def write_random_token_shard(root: Path, vocab_size: int, seq_len: int, train_rows: int, eval_rows: int,
                             seed: int) -> Path:
    """Rows of uniform random token ids ending in the EOS id 0 (a whole example to the reader's checks), the first
    third of each unsupervised."""
    rng = np.random.default_rng(seed)
    unsupervised = seq_len // 3

    def rows(count: int, prefix: str):
        for index in range(count):
            ids = rng.integers(1, vocab_size, size=seq_len, dtype=np.int64)
            ids[-1] = EOS_TOKEN_ID
            labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
            labels[unsupervised:-1] = ids[unsupervised + 1:]  # causally aligned: position j predicts j + 1
            yield Example(ids, labels, {"example_id": f"{prefix}-{index:06d}", "task": "random_tokens"})

    for partition, count in (("train", train_rows), ("eval", eval_rows)):
        write_partition(root / partition, rows(count, partition), vocab_size=vocab_size, eos_token_id=EOS_TOKEN_ID,
                        max_seq_len=seq_len)
    return root


def realistic_lengths(count: int, median: int, cap: int, seed: int) -> np.ndarray:
    """`count` example lengths: log-normal around `median` (sigma LENGTH_SIGMA), rounded, within [2, cap]."""
    rng = np.random.default_rng(seed)
    lengths = np.rint(rng.lognormal(math.log(median), LENGTH_SIGMA, size=count))
    return np.clip(lengths, SHORTEST_EXAMPLE, cap).astype(np.int64)


def realistic_example(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One example of `length` tokens: random ids ending in EOS; the first third (the prompt) unsupervised.

    Labels are causally aligned: position j predicts token j + 1, the last
    supervised position predicts the EOS, and the EOS itself predicts nothing,
    so no position predicts across the boundary to a next example.
    """
    ids = np.empty(length, dtype=np.int64)
    ids[:-1] = rng.integers(1, vocab_size, size=length - 1, dtype=np.int64)
    ids[-1] = EOS_TOKEN_ID
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    prompt = length // 3
    labels[prompt:-1] = ids[prompt + 1:]
    return ids, labels


def write_realistic_shard(root: Path, vocab_size: int, seq_len: int, median: int, train_examples: int,
                          eval_examples: int, seed: int) -> Path:
    """A shard of examples of realistic SFT lengths (capped at seq_len), train and eval partitions."""
    for partition, count, part_seed in (("train", train_examples, seed), ("eval", eval_examples, seed + 1)):
        lengths = realistic_lengths(count, median, seq_len, part_seed)
        rng = np.random.default_rng([part_seed, 1])  # the tokens' stream, apart from the lengths'

        def examples(lengths=lengths, rng=rng, partition=partition):
            for index, length in enumerate(lengths):
                ids, labels = realistic_example(rng, int(length), vocab_size)
                yield Example(ids, labels, {"example_id": f"{partition}-{index:06d}", "task": "realistic_lengths"})

        write_partition(root / partition, examples(), vocab_size=vocab_size, eos_token_id=EOS_TOKEN_ID,
                        max_seq_len=seq_len, index_extra={"generator": {
                            "lengths": "log-normal, rounded, clipped to [2, max_seq_len]", "median": median,
                            "sigma": LENGTH_SIGMA, "seed": part_seed,
                            "tokens": "uniform random ids 1..vocab-1, then EOS (0)",
                            "supervised": "all but the first third of each example; the EOS predicts nothing"}})
    return root


def write_release_like_eval(directory: Path, count: int, vocab_size: int, seed: int, median_tokens: int = 300,
                            answer_median: float = 32.0, answer_sigma: float = 0.5, cap: int = 2048) -> dict:
    """One partition of chat-like examples at realistic lengths, for timing exact match.

    Each example's length comes from realistic_lengths (log-normal, median `median_tokens`, capped
    at `cap`); it ends in an answer of log-normal length (median `answer_median`, log-sd
    `answer_sigma`, at most a quarter of the example) and the EOS, which alone are supervised: the
    prompt is everything before. Returns the generator's settings and the lengths it drew.
    """
    totals = np.maximum(realistic_lengths(count, median_tokens, cap, seed), 4)
    rng = np.random.default_rng([seed, 2])  # answers and tokens, apart from the lengths' stream
    answers = np.clip(np.rint(rng.lognormal(math.log(answer_median), answer_sigma, count)), 1,
                      totals // 4).astype(np.int64)
    prompts = totals - answers - 1

    def rows():
        for index, (prompt, answer) in enumerate(zip(prompts, answers)):
            ids = np.append(rng.integers(1, vocab_size, size=prompt + answer, dtype=np.int64), EOS_TOKEN_ID)
            labels = np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
            labels[prompt - 1:-1] = ids[prompt:]  # the answer and its EOS, causally aligned
            yield Example(ids, labels, {"example_id": f"eval-{index:06d}", "task": "release_like_chat"})

    write_partition(directory, rows(), vocab_size=vocab_size, eos_token_id=EOS_TOKEN_ID, max_seq_len=cap)
    targets = answers + 1  # with the EOS
    return {"generator": "cflib.bench.synthetic.write_release_like_eval", "examples": count, "seed": seed,
            "length": {"distribution": "log-normal", "median": median_tokens, "sigma": LENGTH_SIGMA, "cap": cap},
            "answer": {"distribution": "log-normal", "median": answer_median, "sigma": answer_sigma,
                       "max_share": 0.25},
            "prompt_tokens": {"median": float(np.median(prompts)), "mean": float(prompts.mean()),
                              "max": int(prompts.max())},
            "answer_tokens": {"median": float(np.median(targets)), "mean": float(targets.mean()),
                              "max": int(targets.max()), "total": int(targets.sum())}}
