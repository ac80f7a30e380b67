"""The tiles of cflib's memory-bound kernels that do not tune themselves, swept at a model's shapes (GPU).

    python benchmarks/tiles.py --out FILE [--preset tr_hash_200m] [--micro-batch 16] [--seq-len 2048]
        [--kernels NAME ...]

For each kernel, every candidate tile is launched on the same inputs, its outputs checked against the default
tile's (bitwise, except sums whose order the tile sets: within FP32 rounding), and timed
(`triton.testing.do_bench` median, µs):
- qk_norm_rope_forward / qk_norm_rope_backward (cflib.ops.qk_norm_rope; backward as the decoder runs it, from
  q and k, with its partials' sum): rows per program (per block backward, and blocks per program), warps;
- add_rms_norm_forward (cflib.ops.add_rms_norm; its backward tunes itself): rows per program, warps;
- adamw (cflib.ops.adamw): elements per program, warps, over the model's parameters with BF16 copies of its
  2-D weights;
- scaled_swiglu_backward / scaled_swiglu_backward_interleaved (cflib.ops.trmoe, in place; the TR-MoE block's
  gate|up split in halves, or interleaved pairs as the SwiGLU epilogue's GEMM writes them) and expert_scale
  (the epilogue path's route weights on the experts' columns): rows and columns per program, warps.
The record names the default and the fastest tile of each; the defaults in the kernels' modules are what an
H200 chose at the 200M shapes.
"""
from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cflib.atomic import write_json_atomic
from cflib.bench.timing import trmoe_bench_inputs
from cflib.jobs import record_header
from cflib.model.config import PRESETS, ModelConfig, preset
from cflib.model.decoder import TRMoEModel
from cflib.ops import adamw, add_rms_norm, qk_norm_rope, trmoe


Launch = Callable[[], tuple[torch.Tensor, ...]]


@dataclass
class Sweep:
    """One kernel: its candidate tiles, the default among them, and for a tile its launch (what it needs built
    beforehand, outside the timing), which returns the kernel's outputs."""

    name: str
    tiles: list[tuple[int, ...]]
    default: tuple[int, ...]
    prepare: Callable[[tuple[int, ...]], Launch]
    exact: tuple[bool, ...]  # per output: bitwise across tiles, or within FP32 rounding
    reset: Callable[[], None] = lambda: None  # the inputs as they were, before each checked launch


def _qk_inputs(config: ModelConfig, tokens: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    q_heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    width = (q_heads + 2 * kv_heads) * head_dim
    seq = min(tokens, config.max_position_embeddings)
    found = {"qkv": torch.randn(tokens, width, generator=gen, device=device).to(torch.bfloat16),
             "q_weight": torch.rand(head_dim, generator=gen, device=device) + 0.5,
             "k_weight": torch.rand(head_dim, generator=gen, device=device) + 0.5,
             "cos": torch.randn(seq, head_dim, generator=gen, device=device),
             "sin": torch.randn(seq, head_dim, generator=gen, device=device),
             "positions": (torch.arange(tokens, device=device) % seq).to(torch.int32)}
    found["grads"] = [torch.randn(tokens, heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
                      for heads in (q_heads, kv_heads, kv_heads)]
    return found


def qk_sweeps(config: ModelConfig, tokens: int, device: torch.device, small: bool = False) -> list[Sweep]:
    i = _qk_inputs(config, tokens, device)
    heads, eps = (config.num_attention_heads, config.num_key_value_heads), config.norm_eps
    tensors = (i["qkv"], i["q_weight"], i["k_weight"], i["cos"], i["sin"], i["positions"])
    q, k, _, rstd = qk_norm_rope.qk_norm_rope_forward(*tensors, *heads, eps)

    def forward(tile):
        return lambda: qk_norm_rope.qk_norm_rope_forward(*tensors, *heads, eps, tile=tile)

    def backward(tile):
        return lambda: qk_norm_rope.qk_norm_rope_backward(*i["grads"], (q, k), *tensors[1:], rstd, *heads, tile=tile)

    rows, warps = ((16, 64), (2, 4)) if small else ((16, 32, 64, 128, 256), (1, 2, 4, 8))
    blocks = (1, 8) if small else (1, 2, 4, 8)
    forward_tiles = _with(itertools.product(rows, warps), qk_norm_rope.FORWARD_TILE)
    backward_tiles = _with(itertools.product(rows[:4], blocks, warps[1:]), qk_norm_rope.BACKWARD_TILE)
    return [Sweep("qk_norm_rope_forward", forward_tiles, qk_norm_rope.FORWARD_TILE, forward, (True,) * 4),
            Sweep("qk_norm_rope_backward", backward_tiles, qk_norm_rope.BACKWARD_TILE, backward, (True, False))]


def _with(candidates, default: tuple[int, ...]) -> list[tuple[int, ...]]:
    return sorted(set(candidates) | {default})


def add_norm_sweep(config: ModelConfig, tokens: int, device: torch.device, small: bool = False) -> Sweep:
    gen = torch.Generator(device=device).manual_seed(2)
    dim = config.hidden_size
    h = torch.randn(tokens, dim, generator=gen, device=device)
    delta = torch.randn(tokens, dim, generator=gen, device=device).to(torch.bfloat16)
    weight = torch.rand(dim, generator=gen, device=device) + 0.5
    default = add_rms_norm.forward_tile(dim)
    rows, warps = ((1, 4), (4, 8)) if small else ((1, 2, 4, 8, 16), (2, 4, 8, 16))
    return Sweep("add_rms_norm_forward", _with(itertools.product(rows, warps), default), default,
                 lambda tile: lambda: add_rms_norm.add_rms_norm_forward(h, delta, weight, config.norm_eps,
                                                                        torch.bfloat16, tile, keep_sum=False),
                 (True,) * 4)


def adamw_sweep(config: ModelConfig, device: torch.device, small: bool = False) -> Sweep:
    params = [p.data for p in TRMoEModel(config).to(device).parameters()]
    gen = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.normal_(0.0, 0.02, generator=gen)
    grads = [torch.randn(p.shape, generator=gen, device=device) * 1e-3 for p in params]
    start = [p.clone() for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) if p.dim() == 2 else None for p in params]
    coefficients = adamw.step_coefficients(torch.ones(len(params), device=device), 1e-4, (0.9, 0.95))

    def reset():  # each tile's checked launch updates the same values
        for p, s in zip(params, start):
            p.copy_(s)
        for moment in state:
            for m in moment:
                m.zero_()

    def prepare(tile):
        tables = adamw.adamw_tables(params, grads, *state, copies, block=tile[0], num_warps=tile[1])

        def launch():
            adamw.adamw_step_(tables, coefficients, 1e-4, 0.1, (0.9, 0.95), 1e-8)
            return (*params, *state[0], *state[1], *(c for c in copies if c is not None))
        return launch

    blocks, warps = ((256, 512), (4, 8)) if small else ((1024, 2048, 4096, 8192), (4, 8, 16))
    default = (adamw.BLOCK, adamw.NUM_WARPS)
    outputs = 3 * len(params) + sum(c is not None for c in copies)
    return Sweep("adamw", _with(itertools.product(blocks, warps), default), default, prepare, (True,) * outputs,
                 reset)


def swiglu_sweeps(config: ModelConfig, tokens: int, device: torch.device, small: bool = False) -> list[Sweep]:
    engine, _, ids, _ = trmoe_bench_inputs(config, tokens, device)
    layout, table = trmoe.kernel_layout(engine), engine.route_table.contiguous()
    gen = torch.Generator(device=device).manual_seed(3)
    columns = config.shared_intermediate_size + config.intermediate_size
    start = {"gate_up": torch.randn(tokens, 2 * columns, generator=gen, device=device).to(torch.bfloat16),
             "grad": torch.randn(tokens, columns, generator=gen, device=device).to(torch.bfloat16)}
    work = {name: tensor.clone() for name, tensor in start.items()}

    def reset():  # the kernels work in place: each checked launch starts from the same values
        for name, tensor in work.items():
            tensor.copy_(start[name])

    def backward(interleaved: bool):
        gate_up = work["gate_up"].view(torch.int32) if interleaved else work["gate_up"]

        def prepare(tile):
            def launch():
                trmoe.scaled_swiglu_backward_(work["grad"], gate_up, ids, table, layout, interleaved, tile)
                return work["gate_up"], work["grad"]
            return launch
        return prepare

    def scale(tile):
        def launch():
            trmoe.scale_columns_(work["grad"], ids, table, layout, tile)
            return (work["grad"],)
        return launch

    rows, cols, warps = ((8, 16), (128, 256), (4,)) if small else ((8, 16, 32, 64), (128, 256, 512), (4, 8))
    candidates = [tile for tile in itertools.product(rows, cols, warps) if tile[0] * tile[1] <= 16384]
    return [Sweep("scaled_swiglu_backward", _with(candidates, trmoe.BACKWARD_TILE), trmoe.BACKWARD_TILE,
                  backward(False), (True, True), reset),
            Sweep("scaled_swiglu_backward_interleaved", _with(candidates, trmoe.BACKWARD_TILE), trmoe.BACKWARD_TILE,
                  backward(True), (True, True), reset),
            Sweep("expert_scale", _with(candidates, trmoe.SCALE_TILE), trmoe.SCALE_TILE, scale, (True,), reset)]


def _same(found: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], exact: tuple[bool, ...]) -> bool:
    return all(torch.equal(a, b) if bitwise else torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
               for a, b, bitwise in zip(found, expected, exact))


def run_sweep(sweep: Sweep, time_it: bool) -> dict:
    """Each tile checked against the default's outputs and, on a GPU, timed; a tile that fails to launch or
    computes otherwise is recorded as such."""
    sweep.reset()
    expected = [t.clone() for t in sweep.prepare(sweep.default)()]
    results: dict[str, dict] = {}
    for tile in sweep.tiles:
        entry: dict = {}
        try:
            launch = sweep.prepare(tile)
            sweep.reset()
            entry["same_outputs"] = _same(launch(), tuple(expected), sweep.exact)
            if time_it and entry["same_outputs"]:
                from triton.testing import do_bench
                entry["us"] = round(1000 * do_bench(launch, warmup=25, rep=100), 2)
        except Exception as err:  # noqa: BLE001  (a tile that cannot run is a finding, not a stop)
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        results["x".join(map(str, tile))] = entry
    timed = {name: e["us"] for name, e in results.items() if "us" in e}
    return {"default": "x".join(map(str, sweep.default)), "fastest": min(timed, key=timed.get) if timed else None,
            "tiles": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/tiles.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="tr_hash_200m", choices=sorted(PRESETS))
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--kernels", nargs="+", metavar="NAME", help="sweep only these kernels (as the record "
                        "names them)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, tokens = preset(args.preset), args.micro_batch * args.seq_len
    small = device.type == "cpu"  # the interpreter: the outputs' check over a few tiles, nothing timed
    record = {**record_header("tiles", device), "shapes": {"preset": args.preset, "tokens": tokens},
              "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms, us; not timed off a GPU",
              "kernels": {}}
    families = {("qk_norm_rope_forward", "qk_norm_rope_backward"): lambda: qk_sweeps(config, tokens, device, small),
                ("add_rms_norm_forward",): lambda: [add_norm_sweep(config, tokens, device, small)],
                ("adamw",): lambda: [adamw_sweep(config, device, small)],
                ("scaled_swiglu_backward", "scaled_swiglu_backward_interleaved", "expert_scale"):
                    lambda: swiglu_sweeps(config, tokens, device, small)}
    known = [name for names in families for name in names]
    if unknown := sorted(set(args.kernels or ()) - set(known)):
        parser.error(f"--kernels: no such kernel {', '.join(unknown)} (known: {', '.join(known)})")
    wanted = set(args.kernels or known)
    sweeps = [sweep for names, build in families.items() if wanted & set(names) for sweep in build()
              if not args.kernels or sweep.name in wanted]
    for sweep in sweeps:
        record["kernels"][sweep.name] = found = run_sweep(sweep, time_it=device.type == "cuda")
        fastest = found["fastest"]
        print(f"{sweep.name}: default {found['default']}"
              + (f" {found['tiles'][found['default']].get('us')} us, fastest {fastest} "
                 f"{found['tiles'][fastest]['us']} us" if fastest else ""), flush=True)
        write_json_atomic(args.out, record)


if __name__ == "__main__":
    main()
