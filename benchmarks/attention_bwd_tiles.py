"""FlashAttention-4's tile configurations on Hopper at the model's attention shapes, and cflib's call around it (GPU).

    python benchmarks/attention_bwd_tiles.py --out FILE [--preset tr_hash_200m] [--micro-batch 16 48]
        [--seq-len 2048] [--forms dense packed] [--repeats 20] [--budget-s 200] [--configs NAME ...]

The model's attention (causal, BF16, its query / key-value heads and head dim) on dense rows
(`flash_attn_func`) and on packed windows of realistic example lengths (`flash_attn_varlen_func` over
`cu_seqlens`, padded with empty documents as the CUDA-graph step pads them), forward and forward + backward,
median ms of CUDA events after warm-up:

1. cflib's path against a bare call: the step's own call (`cflib.model.decoder.attend_rows` with the fa4
   kernels of `cflib.ops.attention`, q / k / v given as the [B, H, T, hd] views of [B, T, H, hd] tensors the
   fused QKV path hands over, the output back as [B, T, H x hd] rows) against FlashAttention-4 called on the
   [B, T, H, hd] tensors directly, with the largest difference of their outputs and gradients (packed: also
   the bare call given the longest document as max_seqlen, which cflib leaves out);
2. the configurations: the one FlashAttention-4 selects here (the default), then each alternative, one
   backward `BwdConfig` or forward `FwdConfig` change on top of what it selects for each call. The public
   functions take a forward config (`config=`) but no backward one, so each alternative replaces the
   selector that `flash_attn.cute.interface` calls (and validates the result with FlashAttention-4's own
   `validate_bwd_config` / `derive_fwd_config`); the call itself goes through the public functions and
   autograd, as in the step. Each alternative's output and gradients are checked against the default's
   (max abs difference within 1% of the default's largest magnitude; the default against itself gives the
   floor its fp32 atomics leave), and a change FlashAttention-4 refuses is recorded with its reason.

Each configuration compiles its kernels on first use (CuTe DSL, seconds each): configurations not started by
--budget-s are recorded as skipped, and the default is timed again at the end to show the clock's drift (an
H100 at its power limit moves by a few percent). The record is rewritten after each configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from cflib.atomic import write_json_atomic
from cflib.bench.synthetic import realistic_lengths
from cflib.jobs import record_header
from cflib.model.config import PRESETS, preset

# One change each on top of the selected SM90 backward config (at head dim 64: 128 x 128 tiles, Q / dO / PdS
# stages 2, SdP_swapAB, atom layouts 1 / 2 / 2, two MMA warp groups; GQA needs those two). Ordered by
# promise: smaller tiles first (a causal problem's diagonal tiles waste less, and a 64-row tile needs half the
# registers and shared memory), then the layouts `sm90_config_search.py` (in flash_attn/cute) ranks next to
# the default by shared-memory traffic per block, then pipeline and register options; each one is feasible
# by FlashAttention-4's own validation at these shapes.
BWD_CHANGES: dict[str, dict[str, Any]] = {
    "bwd tile_m=64": {"tile_m": 64, "AtomLayoutMdQ": 1},
    "bwd tile_n=64": {"tile_n": 64, "SdP_swapAB": False, "AtomLayoutMSdP": 2, "AtomLayoutNdKV": 1},
    "bwd dQ_swapAB": {"dQ_swapAB": True},
    "bwd AtomLayoutMdQ=1": {"AtomLayoutMdQ": 1},
    "bwd PdS_stages=1": {"num_stages_PdS": 1},
    "bwd tile_m=96": {"tile_m": 96, "dQ_swapAB": True},
    "bwd V_in_regs": {"V_in_regs": True},
    "bwd tile_n=96": {"tile_n": 96, "SdP_swapAB": False, "dKV_swapAB": True, "AtomLayoutMSdP": 2},
    "bwd SdP_swapAB=False": {"SdP_swapAB": False, "AtomLayoutMSdP": 2, "num_stages_PdS": 1},
}
# On top of the selected SM90 forward config (head dim 64: 192 x 128, P@V from registers, intra-warp-group
# overlap, query heads packed).
FWD_CHANGES: dict[str, dict[str, Any]] = {
    "fwd pack_gqa=False": {"pack_gqa": False},
    "fwd tile_m=128": {"tile_m": 128},
}
TOLERANCE = 1e-2  # of the default's largest magnitude: 2.5 BF16 ulps there; a wrong kernel is off by O(1)
GRAPH_DOCUMENTS = 64  # the CUDA-graph step pads cu_seqlens to a multiple of this many documents


@dataclasses.dataclass
class Problem:
    """One shape's inputs: q [B, T, Hq, hd], k / v [B, T, Hkv, hd], the output's gradient, and for packed
    windows the documents (cflib's PackedDocuments) and cu_seqlens as the step passes them."""

    form: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    documents: Any = None

    @property
    def name(self) -> str:
        return f"{self.form}_b{self.q.shape[0]}"


def packed_document_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """[B, T] document ids of windows filled with realistic example lengths (the last one cut at the edge)."""
    lengths = iter(realistic_lengths(batch * seq, 300, seq, seed))
    rows = []
    for _ in range(batch):
        row, document = [], 0
        while len(row) < seq:
            row += [document] * int(next(lengths))
            document += 1
        rows.append(row[:seq])
    return torch.tensor(rows)


def make_problem(form: str, batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int,
                 device: torch.device) -> Problem:
    from cflib.ops.attention import PackedDocuments, pack_documents

    gen = torch.Generator(device=device).manual_seed(batch)

    def heads(count: int) -> torch.Tensor:
        return torch.randn(batch, seq, count, head_dim, generator=gen, device=device, dtype=torch.bfloat16)

    q, k, v = (heads(n).requires_grad_() for n in (q_heads, kv_heads, kv_heads))
    documents = None
    if form == "packed":
        found = pack_documents(packed_document_ids(batch, seq, seed=batch))
        cu = found.cu_seqlens
        tail = cu.new_full((-(-(cu.numel() - 1) // GRAPH_DOCUMENTS) * GRAPH_DOCUMENTS + 1 - cu.numel(),), int(cu[-1]))
        documents = PackedDocuments(found.document_ids, found.positions, torch.cat([cu, tail]),
                                    found.max_seqlen).moved(lambda t: t.to(device))
    return Problem(form, q, k, v, heads(q_heads), documents)


# --- the calls -----------------------------------------------------------------------------------------------

def bare_call(fa4, problem: Problem, max_seqlen: int | None = None) -> torch.Tensor:
    """FlashAttention-4 on the [B, T, H, hd] tensors, as cflib's fa4 kernels call it (causal; packed: the same
    cu_seqlens for queries and keys, and no max_seqlen unless given, as the peers' collator gives it)."""
    q, k, v = problem.q, problem.k, problem.v
    if problem.documents is None:
        return fa4.flash_attn_func(q, k, v, causal=True)[0]
    batch, seq = q.shape[:2]
    cu = problem.documents.cu_seqlens
    out = fa4.flash_attn_varlen_func(q.view(batch * seq, *q.shape[2:]), k.view(batch * seq, *k.shape[2:]),
                                     v.view(batch * seq, *v.shape[2:]), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True)[0]
    return out.view(q.shape)


def cflib_call(problem: Problem) -> Callable[[], torch.Tensor]:
    """The step's call: attend_rows with the fa4 kernel cflib picks, on [B, H, T, hd] views; out [B, T, H x hd]."""
    from cflib.model.decoder import attend_rows
    from cflib.ops.attention import attention_batch

    q, k, v = problem.q, problem.k, problem.v
    batch = attention_batch("fa4", q.device, q.dtype, q.shape[-1], problem.documents)

    def run() -> torch.Tensor:
        return attend_rows(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)

    return run


def forward_backward(forward: Callable[[], torch.Tensor], problem: Problem) -> tuple[torch.Tensor, ...]:
    out = forward()
    grads = torch.autograd.grad(out, (problem.q, problem.k, problem.v), problem.grad_out.view(out.shape))
    return (out, *grads)


def median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(forward: Callable[[], torch.Tensor], problem: Problem, warmup: int, repeats: int) -> dict[str, float]:
    with torch.no_grad():
        fwd = median_ms(forward, warmup, repeats)
    both = median_ms(lambda: forward_backward(forward, problem), warmup, repeats)
    return {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4), "bwd_ms": round(both - fwd, 4)}


def max_abs_diffs(found: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Per tensor (out, dq, dk, dv): the largest difference, and whether it is within TOLERANCE of the
    reference's largest magnitude."""
    diffs, within = {}, True
    for name, a, b in zip(("out", "dq", "dk", "dv"), found, reference):
        a, b = a.reshape(b.shape).float(), b.float()
        diff = (a - b).abs().max().item()
        diffs[name] = diff
        within &= bool(diff <= TOLERANCE * b.abs().max().item()) and bool(torch.isfinite(a).all())
    return {"max_abs_diff": diffs, "within_tolerance": within}


# --- the configurations ----------------------------------------------------------------------------------

def changed_bwd(config_module, base, inputs, changes: dict[str, Any]):
    """The selected backward config with `changes`, validated by FlashAttention-4 (ValueError: refused)."""
    config = dataclasses.replace(base, **changes)
    config_module.validate_bwd_config(config, inputs)
    return config


def changed_fwd(config_module, base, inputs, changes: dict[str, Any]):
    """The selected forward config with `changes` and the fields derived from them, validated."""
    return config_module.derive_fwd_config(base, inputs, **changes)


@contextlib.contextmanager
def selecting(interface, config_module, fwd_changes: dict[str, Any], bwd_changes: dict[str, Any],
              seen: dict[str, Any]) -> Iterator[None]:
    """FlashAttention-4's calls select their configs with these changes on top of its own choice; `seen` keeps
    the last config each direction ran with."""
    select_fwd, select_bwd = interface.select_fwd_config, interface.select_bwd_config

    def fwd(inputs):
        config = select_fwd(inputs)
        config = changed_fwd(config_module, config, inputs, fwd_changes) if fwd_changes else config
        seen["fwd"] = dataclasses.asdict(config)
        return config

    def bwd(inputs):
        config = select_bwd(inputs)
        config = changed_bwd(config_module, config, inputs, bwd_changes) if bwd_changes else config
        seen["bwd"] = dataclasses.asdict(config)
        return config

    interface.select_fwd_config, interface.select_bwd_config = fwd, bwd
    try:
        yield
    finally:
        interface.select_fwd_config, interface.select_bwd_config = select_fwd, select_bwd


def sweep_entry(fa4, interface, config_module, problems: list[Problem], fwd_changes: dict, bwd_changes: dict,
                reference: dict[str, tuple[torch.Tensor, ...]] | None, default_ms: dict[str, float] | None,
                warmup: int, repeats: int) -> tuple[dict, dict[str, tuple[torch.Tensor, ...]]]:
    """One configuration on every problem: its configs as they ran, ms, speedup against the default, numerics."""
    entry: dict[str, Any] = {"fwd_changes": fwd_changes, "bwd_changes": bwd_changes, "shapes": {}}
    outputs = {}
    for problem in problems:
        seen: dict[str, Any] = {}
        began = time.perf_counter()
        try:
            with selecting(interface, config_module, fwd_changes, bwd_changes, seen):
                forward = lambda: bare_call(fa4, problem)  # noqa: E731
                found = tuple(t.detach() for t in forward_backward(forward, problem))  # compiles
                torch.cuda.synchronize()
                first_s = time.perf_counter() - began
                shape = timed(forward, problem, warmup, repeats)
        except Exception as err:  # noqa: BLE001  (a refused or failing config is a finding, recorded)
            entry["shapes"][problem.name] = {"error": f"{type(err).__name__}: {err}"[:500]}
            continue
        shape["first_call_s"] = round(first_s, 2)  # compile (first use of the config) + one run
        if reference is not None:
            shape.update(max_abs_diffs(found, reference[problem.name]))
            shape["speedup_vs_default"] = round(default_ms[problem.name] / shape["fwd_bwd_ms"], 4)
        entry["shapes"][problem.name] = shape
        entry.setdefault("configs", {})[problem.form] = seen
        outputs[problem.name] = found
    return entry, outputs


def cflib_against_bare(fa4, problems: list[Problem], reference: dict[str, tuple[torch.Tensor, ...]],
                       warmup: int, repeats: int) -> dict[str, Any]:
    found = {}
    for problem in problems:
        run = cflib_call(problem)
        ours = tuple(t.detach() for t in forward_backward(run, problem))
        bare = timed(lambda: bare_call(fa4, problem), problem, warmup, repeats)
        mine = timed(run, problem, warmup, repeats)
        found[problem.name] = {"bare": bare, "cflib": mine,
                               "cflib_minus_bare_fwd_bwd_ms": round(mine["fwd_bwd_ms"] - bare["fwd_bwd_ms"], 4),
                               **max_abs_diffs(ours, reference[problem.name])}
        if problem.documents is not None:  # the longest document passed on, as HF's flattening collator does
            longest = problem.documents.max_seqlen
            found[problem.name]["bare_with_max_seqlen"] = timed(lambda: bare_call(fa4, problem, longest), problem,
                                                                warmup, repeats)
    return found


def default_floor(fa4, problems: list[Problem], reference: dict[str, tuple[torch.Tensor, ...]]) -> dict:
    """The default config against itself: the run-to-run difference its fp32 atomic accumulation leaves."""
    return {p.name: max_abs_diffs(tuple(t.detach() for t in forward_backward(lambda: bare_call(fa4, p), p)),
                                  reference[p.name])["max_abs_diff"] for p in problems}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    import flash_attn.cute as fa4
    from flash_attn.cute import config as config_module
    from flash_attn.cute import interface

    started = time.perf_counter()
    device = torch.device("cuda")
    model = preset(args.preset)
    record = record_header("attention_bwd_tiles", device, packages=("flash-attn-4", "nvidia-cutlass-dsl"),
                           params={**vars(args), "out": str(args.out)})
    record["card"] = torch.cuda.get_device_name(device)
    record["shape"] = {"seq_len": args.seq_len, "q_heads": model.num_attention_heads,
                       "kv_heads": model.num_key_value_heads, "head_dim": model.head_dim, "causal": True,
                       "dtype": "bfloat16", "micro_batches": args.micro_batch, "forms": args.forms,
                       "tolerance_of_max_magnitude": TOLERANCE}
    problems = [make_problem(form, batch, args.seq_len, model.num_attention_heads, model.num_key_value_heads,
                             model.head_dim, device) for form in args.forms for batch in args.micro_batch]
    record["documents"] = {p.name: {"cu_seqlens": p.documents.cu_seqlens.numel() - 1,
                                    "max_seqlen": p.documents.max_seqlen}
                           for p in problems if p.documents is not None}
    save = lambda: write_json_atomic(args.out, record)  # noqa: E731

    default, reference = sweep_entry(fa4, interface, config_module, problems, {}, {}, None, None,
                                     args.warmup, args.repeats)
    record["default"] = default
    save()
    failed = [name for name, shape in default["shapes"].items() if "error" in shape]
    if failed:
        raise SystemExit(f"FlashAttention-4's default config failed on {failed}: see {args.out}")
    default_ms = {name: shape["fwd_bwd_ms"] for name, shape in default["shapes"].items()}
    record["default_against_itself"] = default_floor(fa4, problems, reference)
    record["cflib_against_bare"] = cflib_against_bare(fa4, problems, reference, args.warmup, args.repeats)
    save()

    changes = {**{name: ({}, bwd) for name, bwd in BWD_CHANGES.items()},
               **{name: (fwd, {}) for name, fwd in FWD_CHANGES.items()}}
    record["alternatives"] = {}
    for name in args.configs:
        fwd, bwd = changes[name]
        if time.perf_counter() - started > args.budget_s:
            record["alternatives"][name] = {"fwd_changes": fwd, "bwd_changes": bwd,
                                            "skipped": f"not started within --budget-s {args.budget_s}"}
            continue
        # Saved before it runs: a config that takes the CUDA context down is named in the record it leaves.
        record["alternatives"][name] = {"fwd_changes": fwd, "bwd_changes": bwd, "running": True}
        save()
        record["alternatives"][name] = sweep_entry(fa4, interface, config_module, problems, fwd, bwd, reference,
                                                   default_ms, args.warmup, args.repeats)[0]
        save()

    again, _ = sweep_entry(fa4, interface, config_module, problems, {}, {}, reference, default_ms,
                           args.warmup, args.repeats)
    record["default_again"] = again["shapes"]
    record["fastest"] = fastest(record)
    record["elapsed_s"] = round(time.perf_counter() - started, 1)
    save()
    return record


def fastest(record: dict[str, Any]) -> dict[str, Any]:
    """Per shape: the alternative within tolerance with the best speedup over the default, or the default."""
    best: dict[str, Any] = {shape: {"config": "default", "speedup": 1.0} for shape in record["default"]["shapes"]}
    for name, entry in record["alternatives"].items():
        for shape, found in entry.get("shapes", {}).items():
            if found.get("within_tolerance") and found["speedup_vs_default"] > best[shape]["speedup"]:
                best[shape] = {"config": name, "speedup": found["speedup_vs_default"],
                               "fwd_bwd_ms": found["fwd_bwd_ms"]}
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    parser.add_argument("--preset", default="tr_hash_200m", choices=sorted(PRESETS),
                        help="the model whose attention heads are measured")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[16, 48])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--forms", nargs="+", choices=("dense", "packed"), default=["dense", "packed"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--configs", nargs="+", choices=(*BWD_CHANGES, *FWD_CHANGES),
                        default=[*BWD_CHANGES, *FWD_CHANGES], metavar="NAME",
                        help="the alternatives tried, in this order (default: all, backward first): "
                             + "; ".join(f"'{n}'" for n in (*BWD_CHANGES, *FWD_CHANGES)))
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="no alternative starts after this many seconds (each compiles for its first call)")
    args = parser.parse_args(argv)
    for name in ("micro_batch", "seq_len", "warmup", "repeats"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {values}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("attention_bwd_tiles.py measures FlashAttention-4's Hopper (SM90) kernels: it needs an "
                         "H100 or H200")
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"flash-attn-4 does not import ({err}); pip install 'flash-attn-4>=4.0.0b40' or cflib[gpu]")
    record = sweep(args)
    print(f"{record['card']}: wrote {args.out} in {record['elapsed_s']} s")
    for shape, found in record["default"]["shapes"].items():
        side = record["cflib_against_bare"][shape]
        print(f"  {shape}: default fwd+bwd {found['fwd_bwd_ms']} ms (cflib path {side['cflib']['fwd_bwd_ms']}, "
              f"bare {side['bare']['fwd_bwd_ms']}); fastest: {record['fastest'].get(shape)}")


if __name__ == "__main__":
    main()
