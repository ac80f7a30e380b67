"""The memory search of tune_microbatch: the largest micro-batch under a budget, in few real probes.

Peak memory is affine in the microbatch: weights, gradients and AdamW state
are fixed, activations grow per example. Two things bend it: the loss works
on chunks of `loss_chunk_tokens` supervised tokens, so its buffers grow until
one microbatch fills a chunk and then repeat with each partial chunk
(`loss_chunk_saturation`), and allocator rounding adds small steps. So the
search never fits one line to everything. After microbatch 1 and a first
guess that errs small, it predicts from the line through the two measured
probes nearest the budget (interpolating between the largest that fits and
the smallest that does not, else extrapolating from the two largest that
fit), verifies the prediction with real steps and moves along the refitted
line. A probe that runs out of memory is freed completely and becomes an
upper bound whose peak was at least the cap (regula falsi toward it; after
two failures in a row, with probes to spare, bisection). The last probe aims
one below the prediction, since a failure there would leave the answer far
below. The answer is always a microbatch that a probe verified.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cflib.errors import ParamError

GIB = 2**30


@dataclass
class Probe:
    micro: int
    outcome: str  # "fits", "over_budget" (measured above the usable budget) or "out_of_memory" (hit the cap)
    peak_bytes: int | None  # the measure that decides; None after an out-of-memory
    detail: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


@dataclass(frozen=True)
class Line:
    """Peak bytes = intercept + slope x microbatch, through two measured probes."""

    slope: float
    intercept: float
    through: tuple[int, int]

    def __call__(self, micro: float) -> float:
        return self.intercept + self.slope * micro

    def largest_under(self, limit_bytes: float) -> int | None:
        """The largest microbatch the line keeps under `limit_bytes`; None when it does not grow."""
        return math.floor((limit_bytes - self.intercept) / self.slope) if self.slope > 0 else None


def local_line(probes: list[Probe]) -> Line | None:
    """The line through the two measured probes nearest the budget.

    The largest that fits and the smallest measured one that does not
    (interpolation), else the two largest that fit (extrapolation): the
    small microbatches, where the loss chunks are not yet full, stay out of it.
    """
    fitting = sorted(p for p in ((p.micro, p.peak_bytes) for p in probes if p.fits))
    over = sorted((p.micro, p.peak_bytes) for p in probes if p.outcome == "over_budget")
    over = [point for point in over if not fitting or point[0] > fitting[-1][0]]  # noise must not cross the pair
    if fitting and over:
        pair = [fitting[-1], over[0]]
    elif len(fitting) >= 2:
        pair = fitting[-2:]
    else:
        return None
    (m1, y1), (m2, y2) = pair
    slope = (y2 - y1) / (m2 - m1)
    return Line(slope, y1 - slope * m1, (m1, m2))


@dataclass
class Search:
    probes: list[Probe]
    micro: int  # the largest microbatch verified to fit
    line: Line | None
    stopped_because: str
    predictions: list[dict]


def search(measure: Callable[[int], Probe], usable_bytes: int, cap_bytes: int, persistent_bytes: int,
           max_micro: int, max_probes: int, progress: Callable[[str], None] = print) -> Search:
    """Largest microbatch whose measured peak fits `usable_bytes`, with at most `max_probes` calls to `measure`.

    `cap_bytes` is the enforced budget: a probe that runs out of memory peaked at least there.
    """
    probes: list[Probe] = []
    predictions: list[dict] = []

    def run(micro: int, why: str) -> Probe:
        probe = measure(micro)
        probes.append(probe)
        peak = f"{probe.peak_bytes / GIB:.4g} GiB" if probe.peak_bytes is not None else "n/a"
        seconds = probe.detail.get("probe_seconds")
        progress(f"probe {len(probes)}/{max_probes}: micro {micro} ({why}) -> {probe.outcome}, peak {peak} "
                 f"(usable {usable_bytes / GIB:.4g} GiB){f', {seconds:.1f} s' if seconds is not None else ''}")
        return probe

    first = run(1, "does one example fit?")
    if not first.fits:
        raise ParamError(
            f"microbatch 1 does not fit: {_describe(first)} against {usable_bytes / GIB:.4g} GiB usable "
            "(budget_gib less headroom); raise budget_gib, or lower seq_len, or set grad_ckpt: true or bf16: true")
    lo, hi = 1, None  # lo fits (verified); hi is the smallest probed microbatch that does not
    # Everything measured at 1 above the weights and moments counts as per-example here: that over-states
    # the slope, so this first guess errs small, and leaves a long baseline for the line that follows.
    guess = (usable_bytes - persistent_bytes) // max(first.peak_bytes - persistent_bytes, 1)
    predictions.append({"after_probe": 1, "predicted": int(guess), "by": "persistent-state floor"})
    candidate, why = max(guess, 2), "first guess from microbatch 1"  # a floor, not a prediction: probe 2 at least
    while (stopped := _stop_reason(lo, hi, candidate, max_micro)) is None and len(probes) < max_probes:
        micro = min(candidate, max_micro)
        if len(probes) == max_probes - 1 and micro - 1 > lo:
            # The last probe: if it fails the answer falls back to lo, so aim one below the prediction,
            # which still lands within one of the largest that fits.
            micro, why = micro - 1, f"{why}, less one: the last probe"
        probe = run(micro, why)
        if probe.fits:
            lo = micro
        else:
            hi = micro
        candidate, why = _next_candidate(probes, lo, hi, usable_bytes, cap_bytes, max_probes - len(probes))
        predictions.append({"after_probe": len(probes), "predicted": int(candidate), "by": why})
    return Search(probes, lo, local_line(probes), stopped or f"max_probes {max_probes} used", predictions)


def _next_candidate(probes: list[Probe], lo: int, hi: int | None, usable_bytes: int, cap_bytes: int,
                    probes_left: int) -> tuple[int, str]:
    """The next microbatch to probe, and why."""
    line = local_line(probes)
    if line is not None and line.slope > 0:
        candidate = line.largest_under(usable_bytes)
        if hi is None or candidate < hi:
            return candidate, f"line through {line.through}"
    creeping = probes_left >= 2 and len(probes) >= 3 and not probes[-1].fits and not probes[-2].fits
    if hi is not None and next(p for p in probes if p.micro == hi).outcome == "out_of_memory" and not creeping:
        # hi ran out of memory, so its peak was at least the cap: interpolate to that bound (regula falsi).
        # A near miss of the line lands just below hi. After two failures in a row, with probes to spare,
        # bisection takes over: a jump in memory would otherwise be crept down on one microbatch at a time.
        lo_peak = next(p.peak_bytes for p in probes if p.micro == lo and p.fits)
        slope = (cap_bytes - lo_peak) / (hi - lo)
        return lo + math.floor((usable_bytes - lo_peak) / slope), f"line from {lo} to the cap at {hi}"
    # Two failures in a row, or a flat line (allocator noise) and nothing above: halve the gap, or double.
    return (lo + (hi or 2 * lo)) // 2, "bisection"


def _stop_reason(lo: int, hi: int | None, candidate: int, max_micro: int) -> str | None:
    if lo >= max_micro:
        return f"max_micro_batch {max_micro} fits"
    if hi == lo + 1:
        return f"bracketed: {lo} fits, {hi} does not"
    if candidate <= lo:
        return f"the line predicts {lo + 1} exceeds the usable budget"
    return None


def sweep(measure: Callable[[int], Probe], max_micro: int, budget_bytes: int,
          progress: Callable[[str], None] = print) -> list[Probe]:
    """Every microbatch from 1 up to the first that exceeds the budget itself (memory only grows with it).

    It goes on past the usable budget, so the record shows the largest under the budget and under the headroom.
    """
    probes = []
    for micro in range(1, max_micro + 1):
        probes.append(measure(micro))
        progress(f"sweep: micro {micro} -> {probes[-1].outcome}, {_describe(probes[-1])}, "
                 f"{probes[-1].detail.get('probe_seconds', 0):.1f} s")
        if probes[-1].peak_bytes is None or probes[-1].peak_bytes > budget_bytes:
            break
    return probes


def _describe(probe: Probe) -> str:
    if probe.peak_bytes is None:
        return f"out of memory at the cap ({probe.detail.get('error', '')})"
    return f"peak {probe.peak_bytes / GIB:.4g} GiB"
