"""Where the production step's idle GPU time goes: how long a CUDA graph takes to start, by its node count, and
the host's share of the production step before its graph's first kernel.

    python launch_probe.py OUT_JSON [MICRO_BATCH]

Part 1: graphs of N small kernels. 'start_ms' is one replay on an idle GPU, from an event recorded before the
replay to one recorded after it, minus the replay's own GPU time (replays queued back to back): the time the GPU
waited for the graph to start. 'host_ms' is replay()'s host time.
Part 2: the production step (measure_throughput's) at MICRO_BATCH: after 12 warm-up steps, 6 steps timed in pieces
with perf_counter (train_step's start to replay(), replay() itself, its return to the step's end), then 3 steps
under torch.profiler: each cudaGraphLaunch's host span and the first kernel after it."""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

out_json = Path(sys.argv[1])
micro = int(sys.argv[2]) if len(sys.argv) > 2 else 48
device = torch.device("cuda")
result = {"synthetic": [], "step": {}}


def median(values):
    return float(np.median(values))


x = torch.zeros(1 << 20, device=device)
for nodes in (50, 300, 1300, 2600):
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(nodes):
            x.add_(1.0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    steady = begin.elapsed_time(end) / 20
    singles, hosts = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        begin.record()
        started = time.perf_counter()
        graph.replay()
        hosts.append((time.perf_counter() - started) * 1e3)
        end.record()
        end.synchronize()
        singles.append(begin.elapsed_time(end))
    result["synthetic"].append({"nodes": nodes, "steady_ms": steady, "single_ms": median(singles),
                                "start_ms": median(singles) - steady, "host_ms": median(hosts)})
    print(result["synthetic"][-1], flush=True)
    del graph

from cflib.bench.throughput import PROJECT_PATHS, ThroughputParams, _batches, _project_session, train_params  # noqa: E402
from cflib.model.config import PRESETS  # noqa: E402
from cflib.bench.timing import sync, with_next  # noqa: E402

work = Path("/tmp/launch_probe")
import yaml  # noqa: E402

profile = yaml.safe_load(Path("params/throughput_200m_h200.yaml").read_text())
params = ThroughputParams.from_dict({**profile, "micro_batches": [micro], "compare_micro_batch": micro,
                                     "paths": ["production"], "batches": ["random_rows"], "warmup_steps": 12,
                                     "timed_steps": 9, "out_dir": str(work)})
config = PRESETS[params.model]
batches = _batches("random_rows", params, config, work)
steps, _ = batches.steps_of("production", micro, 12, 9)
tparams = train_params(params, micro, len(steps), batches.root, work / "run", PROJECT_PATHS["production"])
session = _project_session("production", tparams)
marks = []
original_replay = torch.cuda.CUDAGraph.replay


def timed_replay(self):
    started = time.perf_counter()
    original_replay(self)
    marks.append((started, time.perf_counter()))


torch.cuda.CUDAGraph.replay = timed_replay
pairs = list(with_next(steps))
pieces = []
for index, (batch, following) in enumerate(pairs[:18]):
    sync(device)
    marks.clear()
    started = time.perf_counter()
    session.step(batch, following)
    sync(device)
    ended = time.perf_counter()
    if index >= 12 and len(marks) == 1:
        (replay_start, replay_end), = marks
        pieces.append({"to_replay_ms": (replay_start - started) * 1e3, "replay_ms": (replay_end - replay_start) * 1e3,
                       "after_replay_ms": (ended - replay_end) * 1e3, "step_ms": (ended - started) * 1e3})
result["step"]["micro_batch"] = micro
result["step"]["pieces"] = pieces
result["step"]["median"] = {key: median([p[key] for p in pieces]) for key in pieces[0]} if pieces else None
print(result["step"]["median"], flush=True)
sync(device)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as profiler:
    for batch, following in pairs[18:21]:
        sync(device)
        session.step(batch, following)
        sync(device)
events = profiler.events()
kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
launches = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "cudaGraphLaunch")
syncs = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
               if e.name in ("cudaDeviceSynchronize", "cudaStreamSynchronize"))
found = []
for start, end in launches:
    first = next((k for k in kernels if k[0] >= start), None)
    before = [k for k in kernels if k[1] <= start]
    found.append({"launch_host_us": end - start,
                  "first_kernel_after_launch_start_us": None if first is None else first[0] - start,
                  "first_kernel_after_launch_end_us": None if first is None else first[0] - end,
                  "first_kernel": None if first is None else first[2][:80],
                  "idle_before_launch_us": None if not before else start - max(k[1] for k in before)})
result["step"]["profiled_launches"] = found
print(found, flush=True)
out_json.write_text(json.dumps(result, indent=1))
