"""Synthetic SFT shards for measuring: random-token rows, the first third of each unsupervised."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cflib.data.shards import IGNORE_INDEX, Example, write_partition


def write_random_token_shard(root: Path, vocab_size: int, seq_len: int, train_rows: int, eval_rows: int,
                             seed: int) -> Path:
    """Rows of uniform random token ids (never the EOS id 0), the first third of each unsupervised."""
    rng = np.random.default_rng(seed)
    unsupervised = seq_len // 3

    def rows(count: int, prefix: str):
        for index in range(count):
            ids = rng.integers(1, vocab_size, size=seq_len, dtype=np.int64)
            labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
            labels[unsupervised:-1] = ids[unsupervised + 1:]  # causally aligned: position j predicts j + 1
            yield Example(ids, labels, {"example_id": f"{prefix}-{index:06d}", "task": "random_tokens"})

    for partition, count in (("train", train_rows), ("eval", eval_rows)):
        write_partition(root / partition, rows(count, partition), vocab_size=vocab_size, eos_token_id=0,
                        max_seq_len=seq_len)
    return root
