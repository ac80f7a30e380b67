"""Attention backends and the production step, A/B on one GPU: `python benchmarks/attention_ab.py --out DIR`.

Three parts, each run guarded (a failure is recorded with its reason and the
rest go on) and the record rewritten after each, so a run cut short keeps
what it measured:

1. kernels: forward + backward of every attention kernel at the model's
   shapes (micro-batch x seq_len, the model's heads, BF16), on dense rows and
   on packed windows of the same documents, median ms (CUDA events), the
   time to build what each needs per forward (a mask, or nothing), and the
   output's max error against an fp32 SDPA (per document when packed);
2. loss: the tied-head fused linear cross-entropy, Liger's against cflib's, fed
   as the production step feeds it (the first third of each row unsupervised);
3. steps: the production step (cflib and Liger kernels, BF16) with each attention
   backend, on dense random-token rows and on packed windows of realistic
   lengths: tokens/s, supervised tokens/s, peak memory, the kernel path read
   back, then a profile of a few more steps: GPU busy time per step against
   wall time (the gap is the GPU waiting on the host) and the top operators.

Realistic lengths are those of the throughput measurement (cflib.bench.synthetic
and feeding: log-normal, median 300 tokens, the first third of each example
unsupervised), packed by the project's own plan into windows in a seeded order.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cflib.atomic import check_writable_folder, write_json_atomic
from cflib.bench.feeding import examples_to_fill, realistic_stream
from cflib.bench.synthetic import LENGTH_SIGMA, write_random_token_shard, write_realistic_shard
from cflib.bench.timing import peak_memory_gib, profile_steps, release_memory, sync, time_steps
from cflib.data.packing import collate_packed
from cflib.data.shards import IGNORE_INDEX, open_shard
from cflib.errors import ParamError
from cflib.jobs import guarded, one_line_errors, record_header, refuse_existing
from cflib.model.config import PRESETS, ModelConfig
from cflib.ops.attention import (
    DENSE_SDPA,
    PackedDocuments,
    attend,
    attention_batch,
    backend_problem,
    kernels_of,
    pack_documents,
)
from cflib.ops.dispatch import KernelChoice
from cflib.ops.sft_loss import SFTLoss
from cflib.ops.loss import supervised_positions
from cflib.train.params import TrainParams
from cflib.train.run import prepare, resolve_device
from cflib.train.trainer import Trainer


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 20) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


# --- 1. the attention kernels -------------------------------------------------------------------------------

def _reference_out(q, k, v, documents) -> torch.Tensor:
    q, k, v = q.float(), k.float(), v.float()
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    seq, pieces, bounds = q.shape[2], [], documents.cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        row, first = divmod(start, seq)
        part = slice(first, first + stop - start)
        pieces.append(F.scaled_dot_product_attention(q[row:row + 1, :, part], k[row:row + 1, :, part],
                                                     v[row:row + 1, :, part], is_causal=True, enable_gqa=True))
    return torch.cat(pieces, dim=2).transpose(1, 2).reshape(q.shape[0], seq, q.shape[1], -1).transpose(1, 2)


def time_kernels(config: ModelConfig, micro: int, seq_len: int, documents: PackedDocuments, device: torch.device,
                 dtype: torch.dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    head_dim = config.head_dim
    q, k, v = (torch.randn(micro, heads, seq_len, head_dim, generator=gen, device=device, dtype=dtype)
               .requires_grad_() for heads in (config.num_attention_heads, config.num_key_value_heads,
                                                config.num_key_value_heads))
    grad = torch.randn(micro, config.num_attention_heads, seq_len, head_dim, generator=gen, device=device,
                       dtype=dtype)
    lengths = documents.cu_seqlens.diff().double().cpu()
    pairs = {"dense": micro * seq_len * (seq_len + 1) / 2, "packed": float((lengths * (lengths + 1) / 2).sum())}
    results = {"documents": {"count": len(lengths), "mean_length": float(lengths.mean()),
                             "max_length": documents.max_seqlen,
                             "useful_pairs_vs_dense": pairs["packed"] / pairs["dense"]}, "rows": []}
    with torch.no_grad():
        truth = {"dense": _reference_out(q, k, v, None), "packed": _reference_out(q, k, v, documents)}
    for kind, kernels in (("dense", kernels_of(packed=False)), ("packed", kernels_of(packed=True))):
        for kernel, requested in kernels.items():
            row = {"kind": kind, "kernel": kernel}
            problem = backend_problem(requested, device, head_dim, dtype, kind == "packed") if requested else None
            if problem:
                results["rows"].append({**row, "status": "skipped", "reason": problem})
                continue

            def measure(kind=kind, requested=requested):
                docs = documents if kind == "packed" else None

                def build():  # what the model builds once per forward for every layer (a mask, or nothing)
                    return attention_batch(requested, device, dtype, head_dim, docs) if requested else DENSE_SDPA

                def step():
                    torch.autograd.grad(attend(q, k, v, batch), (q, k, v), grad)
                started = time.perf_counter()
                batch = build()
                step()
                sync(device)
                first_call_s = time.perf_counter() - started  # the first call compiles (FA4, FlexAttention)
                ms = median_ms(step, device)
                flops = 4 * pairs[kind] * config.num_attention_heads * head_dim * 3.5  # fwd + bwd = 3.5 x fwd
                with torch.no_grad():
                    error = (attend(q, k, v, batch).float() - truth[kind]).abs().max().item()
                return {"kernel_ran": batch.kernel, "first_call_s": first_call_s, "fwd_bwd_ms": ms,
                        "prepare_ms": median_ms(build, device, warmup=1, repeats=5),
                        "useful_tflops_per_s": flops / ms / 1e9, "max_abs_error_vs_fp32": error}
            results["rows"].append({**row, **guarded(measure)})
    return results


# --- 2. the loss ----------------------------------------------------------------------------------------------

def time_losses(config: ModelConfig, micro: int, seq_len: int, device: torch.device, bf16: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(micro, seq_len, config.hidden_size, generator=gen, device=device).requires_grad_()
    head = torch.nn.Parameter(torch.randn(config.vocab_size, config.hidden_size, generator=gen, device=device) * 0.02)
    labels = torch.randint(0, config.vocab_size, (micro, seq_len), device=device, generator=gen)
    labels[:, :seq_len // 3] = IGNORE_INDEX
    supervised = supervised_positions(labels.cpu()).to(device)
    rows = []
    for name, kernels in (("liger", KernelChoice(liger=True, custom=False)),
                          ("cflib", KernelChoice(liger=True, custom=True))):
        loss = SFTLoss(kernels)

        def step(loss=loss):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                total, _ = loss(hidden, head, labels, 1024, False, supervised=supervised)
            total.backward()
            hidden.grad = head.grad = None
        rows.append({"path": name, **guarded(lambda step=step, loss=loss: {
            "fwd_bwd_ms": median_ms(step, device), "backend": loss.last_backend})})
    return {"supervised_tokens": int(supervised.numel()), "rows": rows}


# --- 3. the production step ------------------------------------------------------------------------------------

def time_step(args: argparse.Namespace, kind: str, backend: str, data_root: Path, device: torch.device,
              order: np.ndarray | None) -> dict:
    steps = args.warmup_steps + args.timed_steps + args.profile_steps
    release_memory(device)
    production = args.kernels == "production"
    params = TrainParams.from_dict({
        "model": args.model, "data": str(data_root), "out_dir": str(args.out / "runs" / f"{kind}-{backend}"),
        "seed": 0, "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch,
        "global_batch": args.micro_batch, "max_steps": steps, "lr": 2e-5, "bf16": device.type == "cuda",
        "fp32_loss": False, "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False,
        "use_custom_kernels": "true" if production else "false", "require_liger": production,
        "attention_backend": backend, "pack_sequences": kind == "packed", "device": device.type})
    with warnings.catch_warnings():  # the generated shards are not release shards: the preflight says so
        warnings.simplefilter("ignore", UserWarning)
        trainer = Trainer(prepare(params), progress=False)
    units = order if order is not None else np.arange(args.micro_batch * steps)
    batches = [units[i * args.micro_batch:(i + 1) * args.micro_batch] for i in range(steps)]
    timed = args.warmup_steps + args.timed_steps
    timing = time_steps(trainer.train_step, batches[:timed], args.warmup_steps, device)
    found = {"tokens_per_s": timing["tokens_per_s"], "supervised_tokens_per_s": timing["supervised_tokens_per_s"],
             "step_ms": [s * 1e3 for s in timing["step_seconds"]], "losses": timing["losses"],
             "peak_memory_gib": peak_memory_gib(device),
             "kernel_path": {**trainer.model.kernel_path(), "loss": trainer.training_step.loss.last_backend}}
    if args.profile_steps:
        found["profile"] = guarded(lambda: profile_steps(
            trainer.train_step, batches[timed:], device, args.out / "profiles" / f"{kind}-{backend}.txt"))
    return found


# --- the run -----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    device = resolve_device(args.device)
    args.out = Path(args.out)
    refuse_existing(args.out, ("record.json",), "a record", hint="choose another --out", label="--out")
    check_writable_folder(args.out, "--out", ParamError)
    config = PRESETS[args.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps = args.warmup_steps + args.timed_steps + args.profile_steps
    record: dict[str, Any] = {
        **record_header("attention_ab", device, args.out, packages=("flash-attn-4",)),
        "model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "dtype": str(dtype).removeprefix("torch."), "kernels": args.kernels,
        "protocol": {"kernel_timing": "median of 20 forward+backward calls (CUDA events) after 3 warm-up",
                     "steps": f"{args.warmup_steps} warm-up + {args.timed_steps} timed optimizer steps, each "
                              "bounded by device syncs; then the profiled steps",
                     "realistic_lengths": f"log-normal, median {args.median_length}, sigma {LENGTH_SIGMA:.3f}, "
                                          "first third unsupervised, packed by cflib.data.packing, shuffled"}}
    started = time.perf_counter()
    examples = examples_to_fill(args.micro_batch * steps, args.seq_len, args.median_length, seed=0)
    realistic = write_realistic_shard(args.out / "realistic", config.vocab_size, args.seq_len, args.median_length,
                                      examples, 8, seed=0)
    # The windows of the plan prepare() makes of the same shard, in a seeded order: the steps train them so.
    stream = realistic_stream(open_shard(realistic, "train"), args.seq_len, args.micro_batch, steps, 0, seed=0)
    order = stream.order
    _, _, document_ids, _ = collate_packed(stream.data, stream.plan, order[:args.micro_batch])  # the first step's
    documents = pack_documents(document_ids).moved(lambda t: t.to(device))
    parts = set(args.parts.split(","))
    if "kernels" in parts:
        log("attention kernels ...")
        record["attention_kernels"] = guarded(lambda: time_kernels(config, args.micro_batch, args.seq_len,
                                                                   documents, device, dtype))
        write_json_atomic(args.out / "record.json", record)
    if "loss" in parts:
        log("fused linear cross-entropy ...")
        record["loss"] = guarded(lambda: time_losses(config, args.micro_batch, args.seq_len, device,
                                                     device.type == "cuda"))
        write_json_atomic(args.out / "record.json", record)
    if "steps" in parts:
        random_rows = write_random_token_shard(args.out / "random_tokens", config.vocab_size, args.seq_len,
                                               args.micro_batch * steps, 8, seed=0)
        record["steps"] = []
        for kind, backends, root, units in (("dense", args.dense, random_rows, None),
                                            ("packed", args.packed, realistic, order)):
            for backend in filter(None, backends.split(",")):
                log(f"production step, {kind} rows, attention_backend {backend} ...")
                record["steps"].append({"kind": kind, "attention_backend": backend, **guarded(
                    lambda: time_step(args, kind, backend, root, device, units))})
                write_json_atomic(args.out / "record.json", record)
    release_memory(device)
    record["wall_s"] = time.perf_counter() - started
    write_json_atomic(args.out / "record.json", record)
    log(summary(record))
    return record


def summary(record: dict) -> str:
    lines = []
    for row in record.get("attention_kernels", {}).get("rows", []):
        lines.append(f"{row['kind']:6s} {row['kernel']:15s} " + (
            f"{row['fwd_bwd_ms']:7.3f} ms  prepare {row['prepare_ms']:6.3f} ms  err {row['max_abs_error_vs_fp32']:.1e}"
            if row["status"] == "ok" else f"{row['status']}: {row['reason']}"))
    for row in record.get("loss", {}).get("rows", []):
        lines.append(f"loss   {row['path']:15s} " + (f"{row['fwd_bwd_ms']:7.3f} ms ({row['backend']})"
                                                     if row["status"] == "ok" else f"{row['status']}: {row['reason']}"))
    for row in record.get("steps", []):
        head = f"step   {row['kind']:6s} {row['attention_backend']:13s}"
        if row["status"] != "ok":
            lines.append(f"{head} {row['status']}: {row['reason']}")
            continue
        profile = row.get("profile", {})
        timeline = profile.get("timeline")
        idle = f"  GPU idle {timeline['gpu_idle_ms_per_step']:.1f} of {timeline['wall_ms_per_step']:.1f} ms" if (
            timeline) else ""
        memory = f"  peak {row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else ""
        lines.append(f"{head} {row['tokens_per_s']:>10,.0f} tokens/s  {row['supervised_tokens_per_s']:>10,.0f} "
                     f"supervised/s{memory}{idle}  attention {row['kernel_path']['attention']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/attention_ab.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for record.json, profiles and the generated shards")
    parser.add_argument("--model", default="tr_hash_200m", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--median-length", type=int, default=300, help="of the realistic examples (log-normal lengths)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=2, help="0: no profile")
    parser.add_argument("--parts", default="kernels,loss,steps")
    parser.add_argument("--dense", default="fa4,cudnn_sdpa", help="attention backends of the dense-row steps")
    parser.add_argument("--packed", default="fa4,torch_varlen,flex", help="attention backends of the packed steps")
    parser.add_argument("--kernels", default="production", choices=("production", "reference"),
                        help="the step's other kernels: cflib + Liger (production) or PyTorch (reference)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with one_line_errors("benchmarks/attention_ab.py"):
        return run(args)


if __name__ == "__main__":
    main()
