"""Realistic SFT lengths: one stream of examples, trained as the project trains it and fed to the peer as users feed it.

The stream is the shard's examples packed into `seq_len` windows by the plan
the project's `pack_sequences: true` makes (cflib.data.packing, best-fit
decreasing), the windows in a seeded order; a measurement takes the first
micro-batch x (warm-up + timed steps) of them. Every path trains the same
examples in the same order, and the warm-up is the same examples for all:

- the project: those windows, each example attending only to itself;
- `peer_padded`: the windows' examples, micro-batch at a time, right-padded to
  the longest with an attention mask, as TRL's default collator
  (`DataCollatorForLanguageModeling`, `padding_free=False`) pads them; SDPA
  then runs with the padding mask;
- `peer_packed`: the same windows, examples one after another, causal over the
  whole window with an all-ones attention mask: what TRL's
  `packing_strategy="wrapped"` feeds (attention crosses example boundaries under
  any attention implementation). TRL cuts examples at window ends; here the
  windows keep whole examples, so both sides train the same tokens;
- `peer_padding_free`: the windows' examples flattened into one row with
  `position_ids` restarting at each example and the `cu_seq_lens_q/k` and
  `max_length_q/k` of `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`,
  which is what TRL's `packing=True` (default strategy "bfd", which turns on
  `padding_free`) feeds; transformers runs it with a varlen kernel;
- `peer_compile_padding_free`: those padding-free rows into the model under
  torch.compile, as HF Trainer's `torch_compile=True` compiles it (the whole
  model, the loss inside; no Liger, whose kernels do not trace there).

Labels stay the shard's, causally aligned: an example's last position predicts
nothing, which is the boundary TRL's padding-free collator masks (-100 where
`position_ids == 0`, before its shift), so every path supervises the same tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from cflib.bench.synthetic import LENGTH_SIGMA, realistic_lengths
from cflib.data.packing import PackedWindows, collate_packed, pack_examples
from cflib.data.shards import ShardPartition, collate
from cflib.errors import ParamError


@dataclass(frozen=True)
class Feed:
    """How one peer path is fed: what a batch is made of and how it is collated."""

    description: str
    unit: str  # "windows" or "examples": what a micro-batch counts
    varlen: bool  # the batch needs a varlen attention kernel
    collate: Callable[[ShardPartition, PackedWindows, np.ndarray], dict]
    compiled: bool = False  # the model runs under torch.compile


def padded_batch(data: ShardPartition, plan: PackedWindows, examples: np.ndarray) -> dict:
    """Examples right-padded to the longest (pad id EOS, label -100) with the attention mask of the real tokens."""
    input_ids, labels = collate([data[int(i)] for i in examples], data.eos_token_id)
    lengths = torch.as_tensor(data.lengths[np.asarray(examples)])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch(data: ShardPartition, plan: PackedWindows, windows: np.ndarray) -> dict:
    """The project's windows without their document ids: one causal sequence each, an all-ones attention mask."""
    input_ids, labels, _documents, _rows = collate_packed(data, plan, windows)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def flattened_batch(data: ShardPartition, plan: PackedWindows, windows: np.ndarray) -> dict:
    """The windows' examples in one row: no separators and no padding, positions restarting at each example."""
    examples = plan.examples_of(windows)
    lengths = data.lengths[examples]
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths  # where each example starts in the row
    within = np.arange(total) - np.repeat(starts, lengths)
    rows = np.repeat(data.offsets[examples], lengths) + within
    cu_seq_lens = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = int(lengths.max())
    return {"input_ids": torch.from_numpy(data.input_ids[rows].astype(np.int64))[None],
            "labels": torch.from_numpy(data.labels[rows].astype(np.int64))[None],
            "position_ids": torch.from_numpy(within)[None],
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens.clone(),
            "max_length_q": longest, "max_length_k": longest}


FEEDS: dict[str, Feed] = {
    "peer_padded": Feed("examples padded to the longest, SDPA with the padding mask (TRL's default collator)",
                        "examples", False, padded_batch),
    "peer_packed": Feed("the project's windows, causal across examples (TRL's wrapped packing, SDPA)", "windows",
                        False, packed_batch),
    "peer_padding_free": Feed("the windows' examples in one row with cu_seq_lens, a varlen kernel (TRL "
                              "padding-free)", "windows", True, flattened_batch),
    "peer_compile_padding_free": Feed("the padding-free rows into the model under torch.compile (HF Trainer's "
                                      "torch_compile), no Liger", "windows", True, flattened_batch, compiled=True),
}


@dataclass
class RealisticStream:
    """The windows one realistic-length measurement trains, warm-up first."""

    data: ShardPartition
    plan: PackedWindows
    order: np.ndarray  # window indices, in the order trained
    micro: int
    warmup_steps: int
    timed_steps: int

    def window_batches(self) -> list[np.ndarray]:
        return [self.order[step * self.micro:(step + 1) * self.micro]
                for step in range(self.warmup_steps + self.timed_steps)]

    def example_batches(self) -> tuple[list[np.ndarray], int]:
        """The same examples in the same order, micro-batch examples a step, and how many steps are warm-up."""
        split = self.warmup_steps * self.micro
        warmup = _chunks(self.plan.examples_of(self.order[:split]), self.micro)
        timed = _chunks(self.plan.examples_of(self.order[split:]), self.micro)
        return warmup + timed, len(warmup)

    def batches(self, unit: str) -> tuple[list[np.ndarray], int]:
        return self.example_batches() if unit == "examples" else (self.window_batches(), self.warmup_steps)

    def examples(self, batch: np.ndarray, unit: str) -> np.ndarray:
        return batch if unit == "examples" else self.plan.examples_of(batch)

    def timed_examples(self) -> np.ndarray:
        return self.plan.examples_of(self.order[self.warmup_steps * self.micro:])

    def useful_flops(self, active_params: int, layers: int, hidden: int) -> int:
        """Model FLOPs of the timed examples, each alone: 6 x active parameters per token + causal attention over
        its own length (docs/measuring.md's count with seq = the example's length); padding and separators do
        no work."""
        lengths = self.data.lengths[self.timed_examples()].astype(np.int64)
        return int(6 * active_params * lengths.sum() + 6 * layers * hidden * (lengths ** 2).sum())

    def summary(self) -> dict:
        timed = self.data.lengths[self.timed_examples()]
        return {"micro_batch": self.micro, "windows": len(self.order),
                "examples": len(self.plan.examples_of(self.order)), "timed_examples": len(timed),
                "timed_example_tokens": int(timed.sum()),
                "timed_supervised_tokens": self.data.supervised_tokens(self.timed_examples()),
                "timed_length_median": float(np.median(timed)), "timed_length_mean": float(timed.mean()),
                "timed_length_max": int(timed.max()),
                "plan": self.plan.efficiency(self.data.lengths, self.data.supervised_counts)}


def _chunks(examples: np.ndarray, size: int) -> list[np.ndarray]:
    return [examples[start:start + size] for start in range(0, len(examples), size)]


def realistic_stream(data: ShardPartition, seq_len: int, micro: int, warmup_steps: int, timed_steps: int,
                     seed: int) -> RealisticStream:
    """The first micro x (warm-up + timed) windows of the shard's pack plan in a seeded order, or ParamError."""
    plan = pack_examples(data.lengths, seq_len)
    needed = micro * (warmup_steps + timed_steps)
    if len(plan) < needed:
        raise ParamError(f"shard {data.directory}: its {len(data):,} examples pack into {len(plan):,} windows of "
                         f"{seq_len} tokens, but micro-batch {micro} x {warmup_steps + timed_steps} steps needs "
                         f"{needed:,}; lower timed_steps or compare_micro_batch, or give a larger shard")
    order = np.random.default_rng(seed).permutation(len(plan))[:needed]
    return RealisticStream(data, plan, order, micro, warmup_steps, timed_steps)


def examples_to_fill(windows: int, seq_len: int, median: int, seed: int) -> int:
    """How many generated examples (synthetic.realistic_lengths, this seed) pack into at least `windows` windows."""
    mean = median * math.exp(LENGTH_SIGMA ** 2 / 2)
    count = math.ceil(1.1 * windows * seq_len / (min(mean, seq_len) + 1)) + 8
    while len(pack_examples(realistic_lengths(count, median, seq_len, seed), seq_len)) < windows:
        count = math.ceil(count * 1.25)
    return count
