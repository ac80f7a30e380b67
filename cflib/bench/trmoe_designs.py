"""Per-layer forward+backward time of the TR-MoE block designs at the 200M shapes (GPU).

Designs, side by side in one run (BF16 autocast, fp32 master weights):
- reference: cflib's PyTorch path (dense over experts, einsum, separate shared SwiGLU);
- gather: tokens gathered by expert, one grouped GEMM per projection
  (torch._grouped_mm where this torch has it, else one GEMM per expert), scattered back;
- fused: cflib.ops.trmoe, one wide SwiGLU over shared + all experts with a Triton
  column-scale kernel;
- gated: the same wide block with SwiGLU in quack's gate|up GEMM epilogue (what the step runs in BF16 on
  Hopper), its weights laid out from the FP32 masters per forward.
The gather design lives here only: it lost at these shapes (see the record).

    python -m cflib.bench.trmoe_designs --out outputs/records/trmoe_designs_h200.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cflib.bench.timing import time_forward_backward, trmoe_bench_inputs
from cflib.jobs import record_header
from cflib.model.config import preset
from cflib.model.decoder import TRMoEEngine
from cflib.model.fast import FusedTRMoEEngine, swap_class
from cflib.ops.liger import LigerSiLUMulFunction
from cflib.ops.trmoe import trmoe_gated_forward


def _grouped(a: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, weights.to(a.dtype), offs=ends)
    return torch.cat([chunk @ w.to(a.dtype) for chunk, w in zip(a.split(counts), weights)])


def gather_forward(engine: TRMoEEngine, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    shared = engine.shared_down(LigerSiLUMulFunction.apply(engine.shared_gate(x), engine.shared_up(x)))
    routes = engine.route_table[:, token_ids]  # [K, N]
    top_k, tokens = routes.shape
    expert_of = routes.reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat(top_k)
    weight_of = torch.tensor(engine.route_weights, device=x.device).repeat_interleave(tokens)
    order = torch.argsort(expert_of, stable=True)
    counts_t = torch.bincount(expert_of, minlength=engine.expert_gate.shape[0])
    ends = torch.cumsum(counts_t, 0).to(torch.int32)
    counts = counts_t.tolist()
    xs = x[token_of[order]].to(shared.dtype)
    hidden = F.silu(_grouped(xs, engine.expert_gate, ends, counts)) * _grouped(xs, engine.expert_up, ends, counts)
    hidden = hidden * (weight_of[order] * engine.routed_output_scale)[:, None].to(hidden.dtype)
    ys = _grouped(hidden, engine.expert_down, ends, counts)
    routed = torch.zeros(tokens, x.shape[1], device=x.device, dtype=ys.dtype).index_add_(0, token_of[order], ys)
    return engine.shared_output_scale * shared + routed


def design_forwards(engine: TRMoEEngine, x: torch.Tensor, ids: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each design's forward of the block on x and token ids ids, by name."""
    def run_engine(backend):
        swap_class(engine, {"torch_dense": TRMoEEngine, "triton_fused": FusedTRMoEEngine}[backend])
        return engine(x, ids)
    return {"reference": lambda: run_engine("torch_dense"),
            "gather": lambda: gather_forward(engine, x, ids),
            "fused": lambda: run_engine("triton_fused"),
            "gated": lambda: trmoe_gated_forward(engine, x, ids)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16 * 2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = preset("tr_hash_200m")
    engine, x, ids, grad = trmoe_bench_inputs(config, args.tokens, device)

    def timed(forward):
        return time_forward_backward(forward, grad, rep_ms=400)

    forwards = design_forwards(engine, x, ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference_out = forwards["reference"]().float()
        errors = {name: ((fn().float() - reference_out).norm() / reference_out.norm()).item()
                  for name, fn in forwards.items() if name != "reference"}
    ms = {name: timed(fn) for name, fn in forwards.items()}
    d, s, w, e, k = (config.hidden_size, config.shared_intermediate_size, config.expert_width, config.num_experts,
                     config.num_experts_per_tok)
    # Forward+backward = 3 x forward GEMM FLOPs; 3 projections of 2*D*width per token. Only gather skips the
    # experts a token is not routed to.
    flops = {name: 3 * 6 * args.tokens * d * (s + (k if name == "gather" else e) * w) for name in ms}
    record = {
        **record_header("trmoe_designs", device),
        "shapes": {"tokens": args.tokens, "hidden": d, "shared": s, "experts": e, "expert_width": w, "top_k": k},
        "precision": "bf16-autocast, fp32 master weights", "timing": "triton.testing.do_bench median, "
        "warmup 50 ms, rep 400 ms, forward+backward of one layer",
        "grouped_gemm": "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "one GEMM per expert",
        "ms_per_layer": ms, "speedup_vs_reference": {n: ms["reference"] / v for n, v in ms.items()},
        "tflops": {n: flops[n] / ms[n] / 1e9 for n in ms}, "forward_rel_error_vs_reference": errors,
    }
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)
    for name in ms:
        print(f"{name:10s} {ms[name]:7.3f} ms/layer  {record['speedup_vs_reference'][name]:5.2f}x  "
              f"{record['tflops'][name]:6.1f} TFLOP/s  err {errors.get(name, 0):.1e}")


if __name__ == "__main__":
    main()
