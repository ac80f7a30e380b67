"""Where a transformers generate() decode step spends its time: the Hub bundle beside the Llama of equal width.

`python benchmarks/generate_profile.py --out FILE [--smoke] [--device cuda]`

The same prompts as `cflib.bench.decode` (64 rows of 64 tokens, BF16 on a GPU) are prefilled once, then
`steps` single-token forwards reuse the dynamic cache, as generate() makes them, under torch.profiler. Per
side the record holds the wall time of a step (between device synchronisations), the operator calls the host
issues per step, the GPU kernels launched per step and the operators taking the most host time. A decode step of
a model this size launches many small kernels, so a side that issues more of them, or spends longer in Python
between them, is slower, whatever its FLOPs.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cflib.atomic import write_json_atomic
from cflib.bench.decode import SMOKE, DecodeBench, hub_bundle_model
from cflib.bench.peer import build_llama
from cflib.bench.timing import sync
from cflib.jobs import record_header
from cflib.model import TRMoEModel, preset


def profile_side(model: torch.nn.Module, prompts: torch.Tensor, steps: int, device: torch.device) -> dict[str, Any]:
    """Prefill, one untimed decode step, then `steps` timed ones and `steps` more under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        out = model(prompts, attention_mask=torch.ones_like(prompts), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def step() -> None:
            nonlocal token
            length = cache.get_seq_length()
            mask = torch.ones(prompts.shape[0], length + 1, dtype=torch.long, device=device)
            positions = torch.full((prompts.shape[0], 1), length, device=device)
            token = model(token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=True).logits[:, -1:].argmax(-1)

        step()
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        seconds = (time.perf_counter() - start) / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync(device)
    events = prof.events()
    top_level = Counter(event.name for event in events if event.cpu_parent is None and event.name.startswith("aten::"))
    kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted(prof.key_averages(), key=lambda row: -row.self_cpu_time_total)[:15]
    return {"step_ms": seconds * 1e3, "host_ops_per_step": sum(top_level.values()) / steps,
            "gpu_kernels_per_step": len(kernels) / steps,
            "gpu_kernel_ms_per_step": sum(event.device_time for event in kernels) / steps / 1e3,
            "top_level_ops_per_step": {name: count / steps for name, count in top_level.most_common(30)},
            "host_time_by_op_us_per_step": {row.key: row.self_cpu_time_total / steps for row in host}}


def run_profile(settings: DecodeBench, device: torch.device, steps: int) -> dict[str, Any]:
    config = preset(settings.model)
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    torch.manual_seed(settings.seed)
    master = TRMoEModel(config).eval()
    generator = torch.Generator().manual_seed(settings.seed)
    prompts = torch.randint(1, config.vocab_size, (settings.prompts, settings.prompt_tokens), generator=generator)
    record: dict[str, Any] = {**record_header("generate_profile", device, packages=("transformers",)),
                              "model": settings.model, "rows": settings.prompts, "prompt_tokens": settings.prompt_tokens,
                              "dtype": str(dtype), "steps": steps, "cache": "dynamic"}
    with tempfile.TemporaryDirectory(prefix="cflib-generate-profile-") as scratch:
        for side, load in (("hf_bundle", lambda: hub_bundle_model(master, Path(scratch), dtype, device)),
                           ("hf_llama", lambda: build_llama(config, device, settings.seed).to(dtype).eval())):
            record[side] = profile_side(load(), prompts.to(device), steps, device)
    record["bundle_vs_llama_step_time"] = record["hf_llama"]["step_ms"] / record["hf_bundle"]["step_ms"]
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks/generate_profile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the record's JSON file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU in seconds (fp32)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one; cpu with --smoke)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed, and as many profiled")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    record = run_profile(SMOKE if args.smoke else DecodeBench(), device, args.steps)
    write_json_atomic(Path(args.out), record)
    for side in ("hf_bundle", "hf_llama"):
        found = record[side]
        print(f"{side:10s} {found['step_ms']:8.2f} ms/step  {found['host_ops_per_step']:6.0f} host ops  "
              f"{found['gpu_kernels_per_step']:6.0f} kernels ({found['gpu_kernel_ms_per_step']:.2f} ms)")
    print(f"bundle vs llama (step time): {record['bundle_vs_llama_step_time']:.2f}x")
    return record


if __name__ == "__main__":
    main()
