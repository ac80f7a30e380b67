"""Decoding speed: `python -m cflib.bench.decode --out DIR [--smoke] [--device cuda]`.

The same weights (the preset at random init, one seed) and the same prompts go
through each path, greedy, forced to the same number of new tokens, in BF16 on
a GPU (fp32 with --smoke, a tiny model on the CPU in seconds):

  decoder          cflib.model.generate.Decoder: static KV cache, each decode step replayed as a CUDA graph
  decoder_eager    the same decoder launching every kernel from the host (what the graph saves)
  decoder_compiled the decoder with its decode step compiled by torch.compile (inductor) before the capture
  decoder_kernels  the decoder with the fast kernels of choose_kernels("auto") (Triton TR-MoE, fused QKV
                   norm+RoPE, add+RMSNorm, Liger): the path read back is recorded
                   (decoder_compiled runs last: its compile takes the longest)
  no_cache         one full forward per new token (how exact match decoded before the cache)
  hf_bundle        transformers generate() on the Hub bundle exported from the same weights (cflib.export.hub),
                   its DynamicCache
  hf_bundle_static the bundle's generate() with cache_implementation="static", its decode steps compiled by
                   generate itself (CompileConfig: inductor, fullgraph, reduce-overhead) on a GPU
  hf_llama         transformers generate() on a Llama of equal active width (random weights): the peer, DynamicCache
  hf_llama_static  the Llama with the static cache, compiled the same way

The bundle's targets beside the Llama are in `targets`: generate() at least as fast with the dynamic cache,
and with the static cache compiled. Each path is timed once after a warm-up call of the same length (graph
capture, kernel selection for every cache length, compilation: twice for the compiled static paths, whose CUDA
graphs record on the second), between
torch.cuda.synchronize calls, prefill included; tokens/s counts new tokens. Then exact match
(cflib.train.held_out.exact_match, with the fast kernels as training evaluates on a GPU) over
held-out prompts at the released data's lengths (cflib.bench.synthetic.write_release_like_eval) is
timed end to end, graph captures included.
Every part is guarded: one that fails records its error and the others still run. DIR/record.json.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cflib.atomic import scratch_folder, write_json_atomic
from cflib.bench.peer import build_llama
from cflib.bench.synthetic import write_release_like_eval
from cflib.bench.timing import release_memory, sync
from cflib.data.shards import ShardPartition
from cflib.export.bundle import load_bundle_model
from cflib.export.hub import export_hub
from cflib.jobs import guarded, one_line_errors, record_header
from cflib.model import ModelConfig, TRMoEModel, preset, save_checkpoint
from cflib.model.fast import use_kernels
from cflib.model.generate import Decoder
from cflib.model.rope import rope_inv_freq
from cflib.ops.dispatch import KernelChoice, choose_kernels
from cflib.train.held_out import exact_match
from cflib.train.records import count_parameters
from cflib.train.run import resolve_device


@dataclass(frozen=True)
class DecodeBench:
    model: str = "tr_hash_200m"
    prompts: int = 64
    prompt_tokens: int = 64
    new_tokens: int = 128
    bf16: bool = True
    seed: int = 0
    exact_match_examples: int = 3000
    exact_match_batch: int = 64
    median_tokens: int = 300  # exact-match examples: log-normal lengths (see write_release_like_eval)
    answer_median: float = 32.0
    length_cap: int = 2048


SMOKE = DecodeBench(model="smoke", prompts=4, prompt_tokens=8, new_tokens=8, bf16=False,
                    exact_match_examples=24, exact_match_batch=8, median_tokens=24, answer_median=4.0,
                    length_cap=96)


def timed(run: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    out = run()
    sync(device)
    return out, time.perf_counter() - start


def section(record: dict, name: str, part: Callable[[], dict], out: Path) -> dict | None:
    """record[name]: the part's result, or its failure (`cflib.jobs.guarded`); None when it did not run."""
    record[name] = guarded(part)
    write_json_atomic(out / "record.json", record)  # what has run so far survives a crash of the next part
    return record[name] if record[name]["status"] == "ok" else None


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How far two paths' greedy tokens agree: identical rows and the mean length of the common prefix."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(tokens, reference)]
    return {"identical_rows": sum(x == y for x, y in zip(tokens, reference)), "rows": len(reference),
            "mean_common_prefix": float(np.mean(prefixes))}


def decoder_path(model: TRMoEModel, prompts: list[list[int]], settings: DecodeBench, device: torch.device,
                 cuda_graph: bool, compile_step: bool = False) -> dict:
    decoder = Decoder(model, max_batch=len(prompts), autocast_dtype=torch.bfloat16 if settings.bf16 else None,
                      cuda_graph=cuda_graph, compile_step=compile_step)
    run = lambda: decoder.generate(prompts, settings.new_tokens)  # noqa: E731 - no EOS stop: every row in full
    run()  # warm-up: cache allocation, compilation, graph capture, kernel selection
    tokens, seconds = timed(run, device)
    return {"seconds": seconds, "new_tokens": sum(map(len, tokens)), "tokens_per_s": sum(map(len, tokens)) / seconds,
            "decoder": decoder.path(), "tokens": tokens}


def no_cache_path(model: TRMoEModel, prompts: list[list[int]], settings: DecodeBench, device: torch.device) -> dict:
    """The loop exact match ran before the cache: the whole sequence through the model for each new token."""
    context = torch.autocast(device.type, dtype=torch.bfloat16) if settings.bf16 else contextlib.nullcontext()

    def run(steps: int) -> list[list[int]]:
        tokens = torch.tensor(prompts, device=device)
        with torch.no_grad(), context:
            for _ in range(steps):
                last = model(tokens)[:, -1]
                tokens = torch.cat([tokens, (last @ model.head_weight.t().to(last.dtype)).argmax(-1)[:, None]], 1)
        return tokens[:, len(prompts[0]):].tolist()

    run(settings.new_tokens)  # warm-up through every length the timed call meets (kernel selection per shape)
    tokens, seconds = timed(lambda: run(settings.new_tokens), device)
    return {"seconds": seconds, "new_tokens": sum(map(len, tokens)), "tokens_per_s": sum(map(len, tokens)) / seconds,
            "kernel_path": model.kernel_path(), "tokens": tokens}


def hf_generate_path(hf_model: torch.nn.Module, prompts: list[list[int]], settings: DecodeBench,
                     device: torch.device, static: bool = False) -> dict:
    """transformers generate(): greedy, exactly new_tokens per row (EOS suppressed until then), its DynamicCache;
    static: cache_implementation="static", and on a GPU generate() compiles its decode step (prefill stays eager),
    as transformers documents it."""
    input_ids = torch.tensor(prompts, device=device)
    options: dict[str, Any] = {}
    if static:
        from transformers import CompileConfig

        options = {"cache_implementation": "static",
                   "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead", dynamic=False)}

    def run(steps: int) -> list[list[int]]:
        with torch.no_grad():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=steps, min_new_tokens=steps, use_cache=True, pad_token_id=0,
                                    **options)
        return out[:, input_ids.shape[1]:].tolist()

    # Warm up at the timed shape: a dynamic cache meets a new length at every step, and the first call through
    # each length selects its kernels (on the H200 the first of two identical calls ran at a third of the
    # second's speed); the static cache's length is part of the compiled graph, whose CUDA graphs record on the
    # second call.
    for _ in range(2 if static else 1):
        run(settings.new_tokens)
    tokens, seconds = timed(lambda: run(settings.new_tokens), device)
    result = {"seconds": seconds, "new_tokens": sum(map(len, tokens)), "tokens_per_s": sum(map(len, tokens)) / seconds,
              "transformers_attention": getattr(hf_model.config, "_attn_implementation", None), "tokens": tokens,
              "cache": "static" if static else "dynamic"}
    if static:  # generate() compiles only where transformers allows it (a GPU): say whether it did
        result["compiled_decode_step"] = getattr(hf_model, "_compiled_call", None) is not None
    return result


def hub_bundle_model(model: TRMoEModel, work: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model as transformers loads it: saved, exported as a Hub bundle, loaded with the bundle's modeling code
    (cflib's own classes: cflib.export.bundle)."""
    checkpoint = save_checkpoint(model, work / "checkpoint")
    export_hub(checkpoint, work / "bundle", tokenizer="byte", echo=None)  # the prompts are ids: any tokenizer
    hf_model = load_bundle_model(work / "bundle", dtype=dtype)
    return hf_model.to(device).eval()


def exact_match_pass(model: TRMoEModel, settings: DecodeBench, device: torch.device, work: Path) -> dict:
    data = write_release_like_eval(work / "eval", settings.exact_match_examples, model.config.vocab_size,
                                   settings.seed, settings.median_tokens, answer_median=settings.answer_median,
                                   cap=min(settings.length_cap, model.config.max_position_embeddings))
    shard = ShardPartition(work / "eval", vocab_size=model.config.vocab_size)
    result, seconds = timed(lambda: exact_match(model, shard, settings.bf16, batch_size=settings.exact_match_batch),
                            device)
    generated = data["answer_tokens"]["total"]  # every prompt decodes exactly its answer's length
    return {"data": data, "seconds": seconds, "examples": result["examples"], "new_tokens": generated,
            "decoder": result["decoder"],
            "tokens_per_s": generated / seconds, "exact_match": result["exact_match"]["overall"],
            "batch_size": settings.exact_match_batch,
            "includes": "prompt slicing, prefill, decoding, CUDA graph captures, scoring (not writing the shard)"}


def transformers_generate_paths(record: dict, master: TRMoEModel, config: ModelConfig, prompts: list[list[int]],
                                settings: DecodeBench, device: torch.device, work: Path, dtype: torch.dtype,
                                out: Path) -> dict[str, dict | None]:
    """generate() on the bundle and on the Llama, dynamic cache then static compiled, each guarded; one model
    loaded per side for both caches. A side whose model fails to load records that error on both its paths."""
    results: dict[str, dict | None] = {}
    for side, load in (("hf_bundle", lambda: hub_bundle_model(master, work, dtype, device)),
                       ("hf_llama", lambda: build_llama(config, device, settings.seed).to(dtype).eval())):
        loaded: dict[str, torch.nn.Module] = {}

        def path(static: bool) -> dict:
            if "model" not in loaded:
                loaded["model"] = load()
            return hf_generate_path(loaded["model"], prompts, settings, device, static=static)

        results[side] = section(record, side, lambda: path(False), out)
        results[f"{side}_static"] = section(record, f"{side}_static", lambda: path(True), out)
        loaded.clear()
        release_memory(device)
    return results


def targets(rates: dict[str, float | None]) -> dict[str, dict]:
    """The bundle's generate() against the Llama's, per cache: the product's targets are a ratio of at least 1."""
    found = {}
    for cache, bundle, llama in (("dynamic", "hf_bundle", "hf_llama"), ("static_compiled", "hf_bundle_static",
                                                                         "hf_llama_static")):
        if rates.get(bundle) and rates.get(llama):
            ratio = rates[bundle] / rates[llama]
            found[cache] = {"bundle_vs_llama": ratio, "target": 1.0, "met": ratio >= 1.0}
    return found


def run_bench(settings: DecodeBench, out: Path, device: torch.device) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = preset(settings.model)
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    torch.manual_seed(settings.seed)
    master = TRMoEModel(config).eval()  # fp32: what a checkpoint holds
    generator = torch.Generator().manual_seed(settings.seed)
    prompts = torch.randint(1, config.vocab_size, (settings.prompts, settings.prompt_tokens),
                            generator=generator).tolist()
    model = copy.deepcopy(master).to(device=device, dtype=dtype)
    # Module.to casts every float buffer: RoPE's frequencies stay fp32, as the model computes them.
    model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    record: dict[str, Any] = {
        **record_header("decode_bench", device, out), "settings": asdict(settings),
        "model_config": config.to_dict(), **count_parameters(model), "params_active": config.active_parameters(),
        "precision": "bf16 weights under bf16 autocast" if settings.bf16 else "fp32",
        "decoding": f"greedy; every row makes exactly {settings.new_tokens} new tokens (no EOS stop)",
        "timing_protocol": {"warmup_excluded": "one full call per path before the timed one",
                            "sync_boundaries": "torch.cuda.synchronize before and after the timed call"
                            if device.type == "cuda" else "host timer (CPU: synchronous)",
                            "includes_prefill": True, "runs": 1, "tokens_counted": "new tokens"},
    }
    with scratch_folder(out / "work") as work:  # the bundles and eval shard the paths load, hidden in `out`
        graph = device.type == "cuda"
        reference = section(record, "decoder", lambda: decoder_path(model, prompts, settings, device, graph), out)
        release_memory(device)
        if graph:
            eager = section(record, "decoder_eager",
                            lambda: decoder_path(model, prompts, settings, device, cuda_graph=False), out)
            if reference and eager:
                record["decoder"]["graph_matches_eager"] = reference["tokens"] == eager["tokens"]
            release_memory(device)
        no_cache = section(record, "no_cache", lambda: no_cache_path(model, prompts, settings, device), out)
        release_memory(device)
        transformers_paths = transformers_generate_paths(record, master, config, prompts, settings, device, work,
                                                         dtype, out)
        if reference:
            for name, other in (("no_cache", no_cache), *transformers_paths.items()):
                if other and name != "hf_llama" and name != "hf_llama_static":
                    record[name]["agreement_with_decoder"] = agreement(other["tokens"], reference["tokens"])
        choice = choose_kernels("auto", require_liger=False, device=device)
        use_kernels(model, choice)  # from here on: the fast kernels, as training evaluates on a GPU
        kernels = section(record, "decoder_kernels",
                          lambda: decoder_path(model, prompts, settings, device, graph), out)
        record["decoder_kernels"]["plan"] = choice.describe()
        if reference and kernels:
            record["decoder_kernels"]["agreement_with_decoder"] = agreement(kernels["tokens"], reference["tokens"])
        release_memory(device)
        section(record, "exact_match_pass", lambda: exact_match_pass(model, settings, device, work), out)
        if graph:  # last: inductor's compile takes the longest, and the figures above do not wait for it
            use_kernels(model, KernelChoice(liger=False, custom=False))
            release_memory(device)
            compiled = section(record, "decoder_compiled", lambda: decoder_path(
                model, prompts, settings, device, cuda_graph=True, compile_step=True), out)
            if reference and compiled:
                record["decoder_compiled"]["agreement_with_decoder"] = agreement(compiled["tokens"],
                                                                                 reference["tokens"])
    rates = {name: record[name].get("tokens_per_s") for name in ("decoder", "decoder_eager", "decoder_compiled",
             "decoder_kernels", "no_cache", "hf_bundle", "hf_bundle_static", "hf_llama", "hf_llama_static",
             "exact_match_pass") if name in record}
    record["tokens_per_s"] = rates
    record["targets"] = targets(rates)
    fastest = max((rates[name] for name in ("decoder", "decoder_compiled", "decoder_kernels") if rates.get(name)),
                  default=None)
    record["speedup_of_the_faster_decoder"] = {
        f"vs_{name}": fastest / rates[name] for name in ("no_cache", "hf_bundle", "hf_bundle_static", "hf_llama",
                                                          "hf_llama_static")
        if fastest and rates.get(name)}
    for part in record.values():  # the token lists served the comparisons; the record keeps the figures
        if isinstance(part, dict):
            part.pop("tokens", None)
    write_json_atomic(out / "record.json", record)
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cflib.bench.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for record.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU in seconds (fp32)")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="default: cuda when there is one; cpu with --smoke")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else DecodeBench()
    with one_line_errors("python -m cflib.bench.decode"):
        device = resolve_device(args.device or ("cpu" if args.smoke else "auto"))
        record = run_bench(settings, Path(args.out), device)
    for name, rate in record["tokens_per_s"].items():
        part = record[name]
        rate_text = f"{rate:12,.0f} new tokens/s" if rate is not None else f"{part['status']}: {part.get('reason', '')}"
        print(f"{name:18s} {rate_text}")
    for cache, target in record["targets"].items():
        print(f"bundle / llama, {cache} cache: {target['bundle_vs_llama']:.2f}x (target >= {target['target']:.1f}x)")
    return record


if __name__ == "__main__":
    main()
