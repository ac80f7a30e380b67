"""How the benchmarks time and count: device syncs, steady-state steps, the matmul ceiling, FLOPs, profiles."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cflib.atomic import write_json_atomic, write_text_atomic
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEEngine
from cflib.model.fast import FusedTRMoEEngine, swap_class
from cflib.train.collector import steady_collector


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(active_params: int, layers: int, hidden: int, seq_len: int) -> int:
    """docs/measuring.md: 6 x active parameters (the tied head once) + 6 x layers x hidden x seq for causal
    attention."""
    return 6 * active_params + 6 * layers * hidden * seq_len


def _square_operands(device: torch.device, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """a, b and the output of the ceilings' size x size matmul."""
    return (torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype),
            torch.empty(size, size, device=device, dtype=dtype))


def matmul_ceiling(device: torch.device, size: int, repeats: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Achievable matmul TFLOP/s on this device, now: the figure model FLOP utilisation is taken against."""
    a, b, out = _square_operands(device, size, dtype)
    for _ in range(3):  # kernel selection and clocks settle first
        torch.matmul(a, b, out=out)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    sync(device)
    seconds = time.perf_counter() - start
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "seconds": seconds,
            "tflops_per_s": 2 * size**3 * repeats / seconds / 1e12}


def sustained_matmul_ceiling(device: torch.device, size: int, seconds: float,
                             dtype: torch.dtype = torch.bfloat16) -> dict:
    """The matmul rate the device holds for `seconds` after as long a warm-up: under its power limit, as the
    timed steps run, rather than the first burst at boost clocks (matmul_ceiling)."""
    a, b, out = _square_operands(device, size, dtype)

    def run_for(duration: float) -> tuple[int, float]:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            for _ in range(8):
                torch.matmul(a, b, out=out)
            count += 8
            sync(device)
        return count, time.perf_counter() - start

    run_for(seconds)
    repeats, elapsed = run_for(seconds)
    clock, watts = gpu_clock_and_power(device)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "seconds": elapsed,
            "warmup_s": seconds, "tflops_per_s": 2 * size**3 * repeats / elapsed / 1e12, "gpu_clock_mhz": clock,
            "gpu_power_w": watts}


def release_memory(device: torch.device) -> None:
    """A clean device for the next path: nothing cached, peak statistics from zero."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # also creates the context: the statistics calls below fail without one
        # cuBLAS keeps a workspace for every stream it has run on (each CUDA graph capture's among them), counted
        # as allocated memory and kept past empty_cache: a path would carry the earlier paths' in its peak.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class CollectorPauses:
    """The garbage collector's pauses while held (gc.callbacks): the host time a step spent collecting."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._began = 0.0

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._began)

    def __enter__(self) -> "CollectorPauses":
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._observe)


def gpu_clock_and_power(device: torch.device) -> tuple[int | None, float | None]:
    """The SM clock (MHz) and the board's power draw (W) now, through NVML; None off CUDA or without NVML."""
    if device.type != "cuda":
        return None, None
    try:
        return torch.cuda.clock_rate(device), torch.cuda.power_draw(device) / 1000
    except Exception:  # noqa: BLE001  (no pynvml, or a driver that does not answer: the figures are optional)
        return None, None


# torch.compile's own timers (torch._dynamo.utils.compilation_time_metrics): a frame's compile (tracing, and the
# backend compiling its forward), and the backward's compile, which AOTAutograd puts off until the first backward.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_totals() -> dict:
    """torch.compile's work in this process so far: seconds spent compiling (COMPILE_TIMERS), graphs made, graph
    breaks met."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"seconds": sum(sum(compilation_time_metrics.get(timer, ())) for timer in COMPILE_TIMERS),
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def with_next(batches: list[np.ndarray]) -> zip:
    """Each batch with the one after it (None after the last), for a step that stages its successor."""
    return zip(batches, [*batches[1:], None])


def time_steps(step: Callable[[np.ndarray, np.ndarray | None], dict], batches: list[np.ndarray], warmup_steps: int,
               device: torch.device) -> dict:
    """Run every batch through `step`, told the next batch (None for the last), whose host work it may do while
    the GPU runs; steady state is the steps after the warm-up ones (at least one). The collector holds what
    exists before the first step out of its walks, as cflib's trainer does. Each step's torch.compile seconds
    (compile_totals) are kept beside its time: a compile in a timed step shows there."""
    if len(batches) <= warmup_steps:
        raise ValueError(f"{len(batches)} batches leave no step to time after {warmup_steps} warm-up steps")
    seconds, rows, paused, clocks, compiling = [], [], [], [], []  # clocks: (MHz, W) after each step
    with steady_collector(), CollectorPauses() as pauses:
        for batch, following in with_next(batches):
            sync(device)
            compiled_before = compile_totals()["seconds"]
            collections, start = len(pauses.seconds), time.perf_counter()
            rows.append(step(batch, following))
            sync(device)
            seconds.append(time.perf_counter() - start)
            paused.append(sum(pauses.seconds[collections:]))
            clocks.append(gpu_clock_and_power(device))
            compiling.append(compile_totals()["seconds"] - compiled_before)
    timed, timed_rows = seconds[warmup_steps:], rows[warmup_steps:]
    total = sum(timed)
    result = {
        "tokens_per_s": sum(r["tokens"] for r in timed_rows) / total,
        "supervised_tokens_per_s": sum(r["supervised_tokens"] for r in timed_rows) / total,
        "warmup_s": sum(seconds[:warmup_steps]),
        "warmup_step_seconds": seconds[:warmup_steps],
        "warmup_compile_s": sum(compiling[:warmup_steps]),
        "timed_compile_s": sum(compiling[warmup_steps:]),
        "step_seconds": timed,
        "collector_pause_s": paused[warmup_steps:],
        "gpu_clock_mhz": [mhz for mhz, _ in clocks[warmup_steps:]],
        "gpu_power_w": [watts for _, watts in clocks[warmup_steps:]],
        "losses": [r["loss"] for r in rows],
    }
    if all("real_tokens" in r for r in timed_rows):  # batches with padding or separators: the examples' own tokens
        result["real_tokens_per_s"] = sum(r["real_tokens"] for r in timed_rows) / total
    return result


def kernel_timeline(spans: list[tuple[float, float, str]], steps: int, wall_ms: float, gap_us: float = 20.0,
                    largest: int = 8) -> dict:
    """Per step, from the kernels' (start, end, name) intervals in microseconds (copies and memsets among
    them): the GPU's busy time (their union), its idle time against the wall time, the kernels launched, and
    the idle time in gaps of at least `gap_us` between two kernels (the host late to launch: a step's setup, a
    wait) apart from the shorter ones (the spacing between kernels queued in time, a CUDA graph's among them);
    the `largest` gaps with the kernels on either side."""
    busy, reach, before, long_gaps, short_gaps = 0.0, None, "", [], 0.0
    for start, end, name in sorted(spans):
        if reach is not None and start > reach:
            gap = start - reach
            if gap >= gap_us:
                long_gaps.append((gap, before, name))
            else:
                short_gaps += gap
        busy += max(0.0, end - start if reach is None else end - max(start, reach))
        if reach is None or end >= reach:
            reach, before = end, name
    busy_ms = busy / 1e3 / steps
    return {"wall_ms_per_step": wall_ms, "gpu_busy_ms_per_step": busy_ms, "gpu_idle_ms_per_step": wall_ms - busy_ms,
            "kernels_per_step": len(spans) / steps, "long_gaps_per_step": len(long_gaps) / steps,
            "long_gap_ms_per_step": sum(gap for gap, *_ in long_gaps) / 1e3 / steps,
            "short_gap_ms_per_step": short_gaps / 1e3 / steps, "gap_threshold_us": gap_us,
            "largest_gaps": [{"us": gap, "after": after[:80], "before": following[:80]}
                             for gap, after, following in sorted(long_gaps, reverse=True)[:largest]]}


def profile_steps(step: Callable[[np.ndarray, np.ndarray | None], dict], batches: list[np.ndarray],
                  device: torch.device, table_path: Path) -> dict:
    """Where a path's step time goes: torch.profiler over a few more steps, the table written beside the record;
    on a GPU also its kernel timeline (kernel_timeline: busy and idle time, launches, gaps)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        started = time.perf_counter()
        for batch, following in with_next(batches):
            step(batch, following)
        sync(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / len(batches)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = profiler.key_averages()
    table_path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(table_path, events.table(sort_by=sort_by, row_limit=40) + "\n")
    # The operators again, one row per input shape: which copy, cast or reduction each small kernel is.
    by_shape = table_path.with_name(table_path.stem + "-by-shape.txt")
    write_text_atomic(by_shape, profiler.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=80)
                      + "\n")
    top = sorted(events, key=lambda e: getattr(e, sort_by), reverse=True)[:10]
    found = {"steps": len(batches), "wall_ms_per_step": wall_ms, "table": str(table_path),
             "table_by_shape": str(by_shape), "sorted_by": sort_by,
             "top_ms": {e.key: getattr(e, sort_by) / 1e3 / len(batches) for e in top}}
    if device.type == "cuda":
        # GPU annotations (a compiled graph's call, an optimizer step) span kernels counted already, and the gaps
        # between them: they are not kernels.
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        found["timeline"] = kernel_timeline(spans, len(batches), wall_ms)
        # Every kernel by its full name (the tables cut names and rows): what each family of kernels costs a step.
        kernels_path = table_path.with_name(table_path.stem + "-kernels.json")
        write_json_atomic(kernels_path, kernel_totals(spans, len(batches)))
        found["kernels"] = str(kernels_path)
    return found


def kernel_totals(spans: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """Per kernel name (copies and memsets among them), its device time and launches per step, largest first."""
    totals: dict[str, list[float]] = {}
    for start, end, name in spans:
        total = totals.setdefault(name, [0.0, 0])
        total[0] += end - start
        total[1] += 1
    return [{"name": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": calls / steps}
            for name, (us, calls) in sorted(totals.items(), key=lambda item: -item[1][0])]


def trmoe_bench_inputs(config: ModelConfig, tokens: int, device: torch.device
                       ) -> tuple[TRMoEEngine, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What TR-MoE layer timings run on: an engine with real weights, its input, token ids, an output gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    engine = TRMoEEngine(config).to(device)
    with torch.no_grad():  # TRMoEEngine leaves its weights uninitialised; time on real values
        for param in engine.parameters():
            param.normal_(0.0, 0.02)
    x = torch.randn(tokens, config.hidden_size, generator=gen, device=device, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=gen, device=device)
    grad = torch.randn(tokens, config.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
    return engine, x, ids, grad


def time_forward_backward(forward: Callable[[], torch.Tensor], grad: torch.Tensor, rep_ms: int = 300) -> float:
    """Median ms of forward (under BF16 autocast) plus backward from `grad` (triton.testing.do_bench)."""
    from triton.testing import do_bench

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward()
        out.backward(grad)
    return do_bench(step, warmup=50, rep=rep_ms, return_mode="median")


def time_trmoe(config: ModelConfig, tokens: int, device: torch.device) -> dict[str, float]:
    """Forward+backward ms of one TR-MoE layer (BF16 autocast), reference vs the fused Triton block."""
    engine, x, ids, grad = trmoe_bench_inputs(config, tokens, device)
    found = {}
    for name, cls in (("torch_dense", TRMoEEngine), ("triton_fused", FusedTRMoEEngine)):
        swap_class(engine, cls)
        found[name] = time_forward_backward(lambda: engine(x, ids), grad)
    return found
