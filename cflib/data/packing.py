"""Packing whole examples into fixed `seq_len` windows, never splitting one.

The windows are computed once per run (best-fit decreasing: each example, longest
first, goes into the open window it fills most tightly) and the windows are
then shuffled per epoch like examples. Consecutive examples in a window are
separated by one EOS token whose label is -100; the tail is padded with EOS,
also unsupervised. Each position carries its example's document id, so the
model can keep examples from attending to each other (cflib.ops.attention),
whichever source of a mixture (cflib.data.mixture) they come from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cflib.data.mixture import MixedPartition
from cflib.data.shards import IGNORE_INDEX, ShardPartition


@dataclass
class PackedWindows:
    """Windows of whole examples: window w holds members[offsets[w]:offsets[w + 1]], in order."""

    seq_len: int
    members: np.ndarray  # example indices, window after window
    offsets: np.ndarray  # [windows + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def window(self, index: int) -> np.ndarray:
        return self.members[self.offsets[index]:self.offsets[index + 1]]

    def examples_of(self, windows: Sequence[int]) -> np.ndarray:
        """Every example of the given windows (repeats included), concatenated."""
        return np.concatenate([self.window(int(w)) for w in windows])

    def efficiency(self, lengths: np.ndarray, supervised_counts: np.ndarray) -> dict:
        """Real and supervised tokens per window, over every window (separators count as real)."""
        windows = len(self)
        real = int(lengths.sum()) + len(self.members) - windows  # one separator between neighbours
        supervised = int(supervised_counts.sum())
        return {"windows": windows, "examples": len(self.members), "seq_len": self.seq_len,
                "examples_per_window": len(self.members) / windows,
                "real_tokens_per_window": real / windows,
                "supervised_tokens_per_window": supervised / windows,
                "real_fraction": real / (windows * self.seq_len),
                "supervised_fraction": supervised / (windows * self.seq_len)}


def pack_examples(lengths: np.ndarray, seq_len: int) -> PackedWindows:
    """Best-fit decreasing over example lengths; an example joining a window costs its length plus a separator."""
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = np.flatnonzero(lengths > seq_len)
    if too_long.size:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than seq_len {seq_len}: "
                         "packing never splits an example")
    open_by_space: list[list[int]] = [[] for _ in range(seq_len + 1)]  # free space -> windows with it
    open_count = np.zeros(seq_len + 1, dtype=np.int64)
    windows: list[list[int]] = []
    for example in np.argsort(-lengths, kind="stable"):
        need = int(lengths[example]) + 1  # the example and the separator before it
        fits = open_count[need:] > 0
        if need <= seq_len and fits.any():
            space = need + int(fits.argmax())  # the tightest window it fits
            window = open_by_space[space].pop()
            open_count[space] -= 1
            left = space - need
        else:
            window, left = len(windows), seq_len - int(lengths[example])
            windows.append([])
        windows[window].append(int(example))
        open_by_space[left].append(window)
        open_count[left] += 1
    sizes = np.array([len(w) for w in windows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    members = np.array([e for w in windows for e in w], dtype=np.int64)
    return PackedWindows(seq_len, members, offsets)


def example_tokens(data: ShardPartition | MixedPartition, members: np.ndarray, lengths: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The members' input ids and labels, one after another, gathered with array indexing (a mixture's from
    each source's files in turn)."""
    if isinstance(data, MixedPartition):
        sources = data.source_of[members]
        token_source = np.repeat(sources, lengths)
        input_ids = np.empty(int(lengths.sum()), dtype=np.int64)
        labels = np.empty_like(input_ids)
        for source in np.unique(sources):
            mine = sources == source
            where = token_source == source
            input_ids[where], labels[where] = example_tokens(data.parts[source], members[mine] - data.starts[source],
                                                             lengths[mine])
        return input_ids, labels
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    shard_positions = np.repeat(data.offsets[members], lengths) + within
    return data.input_ids[shard_positions], data.labels[shard_positions]


def pack_window(data: ShardPartition | MixedPartition, members: np.ndarray, seq_len: int
                ) -> tuple[torch.Tensor, ...]:
    """One window: (input_ids, labels, document_ids, example_index), each [seq_len].

    document_ids count the window's examples from 0 (a separator belongs to the
    example before it, the padding is one more document); example_index is the
    shard row of each position, -1 on padding. Built with array indexing, not a
    loop over examples: a window of short examples holds a hundred of them, and
    the batch is assembled while the GPU waits.
    """
    members = np.asarray(members, dtype=np.int64)
    lengths = data.lengths[members]
    # Each example is followed by one separator slot (EOS, label -100).
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
    document_of_token = np.repeat(np.arange(len(members)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    window_positions = starts[document_of_token] + within
    input_ids = np.full(seq_len, data.eos_token_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    input_ids[window_positions], labels[window_positions] = example_tokens(data, members, lengths)
    document_ids = np.full(seq_len, len(members), dtype=np.int64)
    document_ids[window_positions] = document_of_token
    # The separator keeps its slot in the example before it; causally it is seen by no one.
    separators = (starts + lengths)[:-1]
    inside = separators < seq_len
    document_ids[separators[inside]] = np.arange(len(members) - 1)[inside]
    example_index = np.where(document_ids < len(members), members[np.minimum(document_ids, len(members) - 1)], -1)
    return tuple(torch.from_numpy(column) for column in (input_ids, labels, document_ids, example_index))


def collate_packed(data: ShardPartition | MixedPartition, packed: PackedWindows, windows: Sequence[int]
                   ) -> tuple[torch.Tensor, ...]:
    """Stacked windows: input_ids, labels, document_ids, example_index, each [B, seq_len]."""
    parts = [pack_window(data, packed.window(int(w)), packed.seq_len) for w in windows]
    return tuple(torch.stack(column) for column in zip(*parts))
