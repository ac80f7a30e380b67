"""Packing whole examples into fixed `seq_len` windows, never splitting one.

One shard's windows are computed once per run (best-fit decreasing: each example,
longest first, goes into the open window it fills most tightly) and the windows
are then shuffled per epoch like examples. A mixture (cflib.data.mixture) draws
other examples every epoch, so each epoch's draw is packed anew (EpochWindows),
from (seed, epoch) alone. Consecutive examples in a window are separated by one
EOS token whose label is -100; the tail is padded with EOS, also unsupervised.
Each position carries its example's document id, so the model can keep examples
from attending to each other (cflib.ops.attention), whichever source they come from.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

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
        return window_efficiency(self.seq_len, len(self), lengths[self.members], supervised_counts[self.members])


def window_efficiency(seq_len: int, windows: int, lengths: np.ndarray, supervised_counts: np.ndarray) -> dict:
    """Real and supervised tokens per window of `windows` holding examples of these lengths and counts."""
    real = int(lengths.sum()) + len(lengths) - windows  # one separator between neighbours
    supervised = int(supervised_counts.sum())
    return {"windows": windows, "examples": len(lengths), "seq_len": seq_len,
            "examples_per_window": len(lengths) / windows,
            "real_tokens_per_window": real / windows,
            "supervised_tokens_per_window": supervised / windows,
            "real_fraction": real / (windows * seq_len),
            "supervised_fraction": supervised / (windows * seq_len)}


class EpochWindows:
    """Each epoch's draw packed anew (a mixture's: other examples every epoch), numbered across the run: epoch 1's
    windows first, then epoch 2's, ..., so that a unit names one window of one epoch in a step, the record and
    after a resume alike. An epoch is planned when first asked for, with every epoch before it, and kept: its
    windows are a function of its draw, itself a function of (seed, epoch), so every rank and every resume plans
    the same windows and nothing is saved."""

    def __init__(self, draw: Callable[[int], np.ndarray], lengths: np.ndarray, seq_len: int) -> None:
        self.draw, self.lengths, self.seq_len = draw, lengths, seq_len
        self.epochs: list[PackedWindows] = []  # epoch e's windows at e - 1, members as the partition's indices
        self.starts = [0]  # the run-wide number of each planned epoch's first window, then one past the last

    def of_epoch(self, epoch: int) -> PackedWindows:
        """Epoch `epoch`'s (from 1) windows: its draw, best-fit decreasing as one shard's examples are."""
        if epoch < 1:
            raise ValueError(f"epochs count from 1, got {epoch}")
        while len(self.epochs) < epoch:
            drawn = self.draw(len(self.epochs) + 1)
            packed = pack_examples(self.lengths[drawn], self.seq_len)
            self.epochs.append(PackedWindows(self.seq_len, drawn[packed.members], packed.offsets))
            self.starts.append(self.starts[-1] + len(packed))
        return self.epochs[epoch - 1]

    def first_window(self, epoch: int) -> int:
        """The run-wide number of epoch `epoch`'s first window."""
        self.of_epoch(epoch)
        return self.starts[epoch - 1]

    def __len__(self) -> int:
        """The windows of the epochs planned so far."""
        return self.starts[-1]

    def window(self, index: int) -> np.ndarray:
        epoch = bisect.bisect_right(self.starts, index)  # starts[epoch - 1] <= index < starts[epoch]
        return self.epochs[epoch - 1].window(index - self.starts[epoch - 1])

    def examples_of(self, windows: Sequence[int]) -> np.ndarray:
        """Every example of the given windows (repeats included), concatenated."""
        return np.concatenate([self.window(int(w)) for w in windows]) if len(windows) else np.zeros(0, np.int64)

    def efficiency(self, lengths: np.ndarray, supervised_counts: np.ndarray) -> dict:
        """As PackedWindows.efficiency, over every epoch planned so far (an example counted at each draw)."""
        members = np.concatenate([epoch.members for epoch in self.epochs])
        return {**window_efficiency(self.seq_len, len(self), lengths[members], supervised_counts[members]),
                "epochs": len(self.epochs), "packed": "each epoch's draw anew"}


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


def collate_packed(data: ShardPartition | MixedPartition, packed: PackedWindows | EpochWindows,
                   windows: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Stacked windows: input_ids, labels, document_ids, example_index, each [B, seq_len]."""
    parts = [pack_window(data, packed.window(int(w)), packed.seq_len) for w in windows]
    return tuple(torch.stack(column) for column in zip(*parts))
