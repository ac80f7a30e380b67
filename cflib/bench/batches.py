"""The kinds of batches a throughput run measures on, and what its record says of how it measured."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cflib.bench.comparison import RANDOM_ROWS, REALISTIC
from cflib.bench.feeding import FEEDS, RealisticStream, examples_to_fill, realistic_stream
from cflib.bench.synthetic import write_random_token_shard, write_realistic_shard
from cflib.data.shards import ShardError, ShardPartition, open_shard
from cflib.errors import ParamError
from cflib.paths import resolve_path


@dataclass
class Batches:
    """One kind of batches: the shard the paths read and, for realistic lengths, the stream of windows."""

    kind: str  # RANDOM_ROWS or REALISTIC
    root: Path
    data: ShardPartition
    stream: RealisticStream | None = None
    source: dict | None = None  # what the record says of realistic lengths

    def micro_batches(self, micro_batches: tuple[int, ...], compare_micro: int) -> tuple[int, ...]:
        """Random rows at every micro-batch; realistic lengths at the compared one."""
        return micro_batches if self.stream is None else (compare_micro,)

    def steps_of(self, name: str, micro: int, warmup_steps: int, timed_steps: int) -> tuple[list[np.ndarray], int]:
        """The batches of one path (row, window or example indices) and how many of them are warm-up."""
        if self.stream is None:  # fresh rows every step
            return [np.arange(i * micro, (i + 1) * micro) for i in range(warmup_steps + timed_steps)], warmup_steps
        return self.stream.batches(FEEDS[name].unit if name in FEEDS else "windows")


def random_rows(root: Path, vocab_size: int, seq_len: int, rows: int, eval_rows: int, seed: int) -> Batches:
    root = write_random_token_shard(root, vocab_size, seq_len, rows, eval_rows, seed)
    return Batches(RANDOM_ROWS, root, open_shard(root, "train", vocab_size=vocab_size, seq_len=seq_len))


def realistic(shard: str | None, generate_at: Path, vocab_size: int, seq_len: int, median: int, micro: int,
              warmup_steps: int, timed_steps: int, eval_examples: int, seed: int) -> Batches:
    """The user's shard, or generated examples enough for one micro-batch's steps; ParamError before any step."""
    if shard is not None:
        root = resolve_path(shard)
        try:
            data = open_shard(root, "train", vocab_size=vocab_size, seq_len=seq_len)
        except ShardError as err:
            raise ParamError(f"shard: {err}") from None
        source = {"shard": str(root)}
    else:
        count = examples_to_fill(micro * (warmup_steps + timed_steps), seq_len, median, seed)
        root = write_realistic_shard(generate_at, vocab_size, seq_len, median, count, eval_examples, seed)
        data = open_shard(root, "train", vocab_size=vocab_size, seq_len=seq_len)
        source = {"generated": str(root), **data.index["generator"]}
    stream = realistic_stream(data, seq_len, micro, warmup_steps, timed_steps, seed)
    return Batches(REALISTIC, root, data, stream, {**source, **stream.summary()})


def timing_protocol(warmup_steps: int, timed_steps: int, device: torch.device, repetitions: int = 1) -> dict:
    """How the figures were taken (docs/measuring.md's measurement protocol), for the record."""
    cuda = device.type == "cuda"
    return {
        "data": {
            RANDOM_ROWS: "uniform random token ids ending in EOS, rows of seq_len, first third of each row "
                         "unsupervised; a fresh set of rows every step, the same rows for every path",
            REALISTIC: "examples of realistic lengths (see 'realistic'), first third unsupervised, EOS-terminated; "
                       "the project trains packed seq_len windows with document masking, the peer is fed them as "
                       "each entry's 'feed' says; the same examples in the same order for every path, the warm-up "
                       "steps' examples included",
        },
        "step": "forward, backward, gradient clipping, fused AdamW, scheduler, then one host read of the loss and "
                "gradient norm; batches copied from pinned memory (every path alike)",
        "warmup_steps_excluded": warmup_steps,
        "timed_steps": timed_steps,
        "repetitions": repetitions if repetitions == 1 else
        f"{repetitions}: every path that many times, round robin; each entry is its fastest repetition, every "
        "repetition under 'repetitions'",
        "realistic_steps": "warm-up and timed steps count windows of micro-batch; peer_padded takes the same "
                           "examples micro-batch at a time, so more steps (entry 'steps')",
        "sync_boundaries": "torch.cuda.synchronize before and after each optimizer step, host perf_counter"
        if cuda else "host perf_counter around each optimizer step (CPU: synchronous)",
        "gpu_clock": "the SM clock (MHz) and board power (W), NVML, read after each step outside the timed "
                     "interval ('gpu_clock_mhz', 'gpu_power_w'): a step time drifting with the clock is the device "
                     "holding its power limit, not the code" if cuda else "-",
        "garbage_collector": "objects alive before the first step frozen out of the collector's walks "
                             "(gc.freeze, as cflib's trainer runs); each step's collection pauses recorded "
                             "('collector_pause_s')",
        "includes_eval": False,
        "includes_checkpoint_io": False,
        "tokens_counted": "tokens_per_s: every position fed (padding and separators included); real_tokens_per_s: "
                          "example tokens; supervised_tokens_per_s: labels other than -100",
        "clean_state": "one model at a time: the previous path's model and optimizer freed, cache emptied, "
                       "peak-memory statistics reset, compiled graphs reset",
        "peak_memory": "torch.cuda.max_memory_allocated over the path's build and steps" if cuda
        else "not measured on CPU (null)",
        "flops_per_token": "random rows: 6 x active parameters (tied head once) + 6 x layers x hidden x seq_len; "
                           "realistic: the same with seq = each example's own length, over example tokens only",
        "mfu": "model TFLOP/s / the bf16 matmul ceiling measured in this run",
    }
