"""The production step before and after a change, side by side in one process, in alternating blocks of steps.

On a GPU at its power limit a step's speed follows the clocks of the moment, which drift by a percent or two
between runs; a change worth less than that shows only side by side. This job builds two sessions of
`measure_throughput`'s production path in one process: A, then, after `--change` has run, B. Each session
steps eagerly once, then captures its CUDA graphs, so A keeps what was captured before the change (a class
attribute read at capture, a function replaced in a module) and B runs the change. The two then step in
alternating blocks (A B, B A, A B, ...) over the same batches, so both meet the same clocks, and the record
keeps each block's tokens/s (with the board's power and SM clock halfway through it on a GPU), each round's B/A
ratio and their median, and the median over pairs of rounds (one with A first, one with B first) of their
ratios' geometric mean, which cancels what a block gains or loses by going second.

    python benchmarks/step_ab.py --change path/to/patch.py:apply --micro-batch 48 --out FILE \\
        [-f params/throughput_200m_h200.yaml] [--before path/to/patch.py:restore] [--rounds 8] [--steps-per-block 8]

A change is a function of no arguments, named `module:function` (an importable module, or a `.py` file); what it
returns (a dict, say, of what it changed) is kept in the record. `--before` runs before A is built, for a change
whose code is in place and whose A is the old way.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cflib.atomic import write_json_atomic
from cflib.bench.throughput import (
    PROJECT_PATHS,
    ThroughputParams,
    batches_of_kind,
    project_session,
    train_params,
)
from cflib.bench.timing import sync
from cflib.jobs import record_header
from cflib.model.config import preset
from cflib.train.params import ParamError, load_params_file
from cflib.train.run import resolve_device

EAGER_AND_CAPTURE_STEPS = 4  # an eager step, the capture, replays: each session's graphs exist before timing


def load_change(spec: str) -> Callable[[], Any]:
    """The function `module:function` names (a module path or a .py file); a clear error if there is none."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ParamError(f"change {spec!r}: name it as module:function or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ParamError(f"change {spec!r}: no file {where}")
        loader_spec = importlib.util.spec_from_file_location(f"step_ab_change_{path.stem}", path)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ParamError(f"change {spec!r}: cannot import {where} ({err})") from err
    function = getattr(module, name, None)
    if not callable(function):
        raise ParamError(f"change {spec!r}: {where} has no function {name}")
    return function


def _clocks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    try:
        return {"watts": torch.cuda.power_draw(device) / 1000, "mhz": torch.cuda.clock_rate(device)}
    except Exception as err:  # noqa: BLE001  (no NVML reading on this machine)
        return {"error": str(err)}


def block_order(rounds: int) -> list[str]:
    """A B, B A, A B, ...: each side goes first in half the rounds."""
    return [side for r in range(rounds) for side in (("a", "b") if r % 2 == 0 else ("b", "a"))]


def summarize(blocks: list[dict]) -> dict:
    """Each side's tokens/s (median, mean, min, max) and the B/A ratio of every round, with their median."""
    summary: dict[str, Any] = {}
    for side in ("a", "b"):
        rates = [b["tokens_per_s"] for b in blocks if b["side"] == side]
        summary[side] = {"median": statistics.median(rates), "mean": statistics.fmean(rates), "min": min(rates),
                         "max": max(rates)}
    rounds = [blocks[i:i + 2] for i in range(0, len(blocks), 2)]
    ratios = [next(b for b in pair if b["side"] == "b")["tokens_per_s"]
              / next(b for b in pair if b["side"] == "a")["tokens_per_s"] for pair in rounds]
    # A round where A goes first beside one where B does: their ratios' geometric mean cancels what the second
    # block of a round gains or loses by its place (the clocks settling, say)
    balanced = [math.sqrt(ratios[i] * ratios[i + 1]) for i in range(0, len(ratios) - 1, 2)]
    summary.update(b_over_a_per_round=ratios, b_over_a_median=statistics.median(ratios),
                   rounds_b_ahead=sum(r > 1 for r in ratios),
                   b_over_a_of_means=summary["b"]["mean"] / summary["a"]["mean"],
                   b_over_a_balanced=statistics.median(balanced) if balanced else None)
    return summary


def compare_step(params_file: str, change: str, before: str | None, micro: int, rounds: int, block: int,
                 work: Path, log: Callable[[str], None] = print) -> dict:
    """Build A (after `before`), run `change`, build B, time alternating blocks; the record's fields."""
    change_fn, before_fn = load_change(change), load_change(before) if before else None
    timed = 2 * rounds * block
    params = ThroughputParams.from_dict({
        **load_params_file(params_file), "micro_batches": [micro], "compare_micro_batch": micro,
        "paths": ["production"], "batches": ["random_rows"], "warmup_steps": EAGER_AND_CAPTURE_STEPS,
        "timed_steps": timed, "out_dir": str(work)})
    device = resolve_device(params.device)
    config = preset(params.model)
    batches = batches_of_kind("random_rows", params, config, work)
    steps, _ = batches.steps_of("production", micro, EAGER_AND_CAPTURE_STEPS, timed)

    def build(side: str):
        tparams = train_params(params, micro, 100_000, batches.root, work / f"run-{side}", PROJECT_PATHS["production"])
        session = project_session("production", tparams)
        for i in range(EAGER_AND_CAPTURE_STEPS):
            session.step(steps[i], steps[i + 1])
        sync(device)
        return session

    started = time.perf_counter()
    before_result = before_fn() if before_fn else None
    sessions = {"a": build("a")}
    change_result = change_fn()
    sessions["b"] = build("b")
    log(f"built both sessions in {time.perf_counter() - started:.1f} s")
    tokens_per_step = micro * params.seq_len
    blocks, index = [], EAGER_AND_CAPTURE_STEPS
    for side in block_order(rounds):
        sync(device)
        start, clocks = time.perf_counter(), {}
        for i in range(block):
            sessions[side].step(steps[(index + i) % len(steps)], steps[(index + i + 1) % len(steps)])
            if i == block // 2:
                clocks = _clocks(device)
        sync(device)
        seconds = time.perf_counter() - start
        index += block
        blocks.append({"side": side, "tokens_per_s": block * tokens_per_step / seconds, "seconds": seconds, **clocks})
        log(f"{side} {blocks[-1]['tokens_per_s']:,.0f} tokens/s")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"params_file": params_file, "change": change, "before": before, "change_returned": repr(change_result),
            "before_returned": repr(before_result), "micro_batch": micro, "seq_len": params.seq_len,
            "rounds": rounds, "steps_per_block": block,
            "kernel_path": {side: session.kernel_path() for side, session in sessions.items()},
            "peak_memory_gib_both": peak, "summary": summarize(blocks), "blocks": blocks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/step_ab.py", description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--params", default="params/throughput_200m_h200.yaml",
                        help="measure_throughput's parameter file (model, sequence length, device)")
    parser.add_argument("--change", required=True, help="module:function or file.py:function, run before B")
    parser.add_argument("--before", help="module:function or file.py:function, run before A")
    parser.add_argument("--micro-batch", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--out", required=True, help="the record's path (JSON)")
    args = parser.parse_args(argv)
    for name in ("micro_batch", "rounds", "steps_per_block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        with tempfile.TemporaryDirectory(prefix="step_ab_") as work:
            result = compare_step(args.params, args.change, args.before, args.micro_batch, args.rounds,
                                  args.steps_per_block, Path(work))
    except ParamError as err:
        parser.error(str(err))
    write_json_atomic(Path(args.out), {**record_header("step_ab"), **result})
    summary = result["summary"]
    balanced = "" if summary["b_over_a_balanced"] is None else f", {summary['b_over_a_balanced']:.4f} order-balanced"
    print(f"B/A {summary['b_over_a_median']:.4f} (median of {args.rounds} rounds, B ahead in "
          f"{summary['rounds_b_ahead']}{balanced}); A {summary['a']['median']:,.0f}, B {summary['b']['median']:,.0f} "
          "tokens/s")


if __name__ == "__main__":
    main()
