"""Seeds of a run's random streams: one integer per (run seed, rank, step, stream), each stream a constant of its
own so that no two coincide."""
from __future__ import annotations

import numpy as np


def stream_seed(seed: int, rank: int, step: int, stream: int) -> int:
    """A 64-bit seed for `rank`'s generator of `stream` in a run of `seed`, from `step` (0: the run's start; a
    resume that finds no generator state of its own starts a stream of its own at its step)."""
    return int(np.random.SeedSequence([seed, rank, step, stream]).generate_state(1, np.uint64)[0])
