"""The wide TR-MoE SwiGLU block with its activation in the GEMM epilogue or beside it (GPU, one layer).

Side by side in one run, forward + backward of one layer at the 200M shapes
(16 x 2,048 tokens, 896 -> 2 x 3,328 -> 896, BF16):
- cflib_block: cflib.ops.trmoe as the model runs it (FP32 master weights cast and concatenated per forward);
- cflib_bf16_weights: the same kernels on weights already held as one BF16 gate|up and one down matrix,
  which isolates what the per-forward cast and concatenation cost;
- cublas_liger: two cuBLAS GEMMs around Liger's SwiGLU, as the transformers + Liger peer runs an FFN;
- quack_concat / quack_interleaved: quack's MLP (`quack.mlp.mlp_func`), whose GEMMs apply SwiGLU in the
  epilogue forward (gemm_gated) and its derivative backward (gemm_dgated), with gate and up concatenated
  or interleaved. quack has no per-token column scale, so these compute a plain SwiGLU: the time of the
  epilogue design without the routed scales;
- cflib_weight_copies: the whole block reading BF16 copies of its fused weights (cflib.model.weight_copies), as
  the model runs it with bf16_weight_copies, its gradients written back to the FP32 masters;
- cflib_gated / cflib_gated_copies: the routed block with its forward SwiGLU in quack's gate|up GEMM epilogue and
  the experts' per-token scales applied beside it, backward cuBLAS + cflib's kernel
  (cflib.ops.trmoe.GatedSwiGLUDown), over the FP32 masters cast and interleaved per forward, or reading
  interleaved BF16 copies as the model runs it with epilogue_swiglu.
Each variant is timed launched from the host and replayed from a CUDA graph (as the training step runs it), each
guarded: one that fails records its error and the others still run. Errors are norm-relative against an FP32
computation of the same function.

    python -m cflib.bench.swiglu_epilogue --out outputs/records/swiglu_epilogue_h200.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cflib.bench.timing import trmoe_bench_inputs
from cflib.jobs import error_line, record_header
from cflib.model.config import preset
from cflib.model.fast import EpilogueSwiGLUEngine, FusedTRMoEEngine, swap_class
from cflib.model.generate import capture_graph
from cflib.model.weight_copies import WeightCopies
from cflib.ops.trmoe import ScaledSwiGLUDown, fused_weights, kernel_layout, trmoe_forward, trmoe_gated_forward


def _timed(step: Callable[[], None], rep_ms: int) -> float:
    from triton.testing import do_bench
    return do_bench(step, warmup=50, rep=rep_ms, return_mode="median")


def _graphed(step: Callable[[], None]) -> Callable[[], None]:
    """`step` captured as a CUDA graph after three warm-up runs (tuning included): its replay."""
    return capture_graph(step, torch.device("cuda"), warmups=3).replay


def _rel(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found.float() - expected.float()).norm() / expected.float().norm()).item()


class _Layer:
    """One layer's inputs and weights, held once, and every variant as a method computing its output."""

    def __init__(self, tokens: int, device: torch.device) -> None:
        self.config = config = preset("tr_hash_200m")
        self.engine, self.x32, self.ids, self.grad = trmoe_bench_inputs(config, tokens, device)
        with torch.no_grad():
            self.gate_up32, self.down32 = fused_weights(self.engine)
        engine, self.shared_columns, self.tokens = self.engine, config.shared_intermediate_size, tokens
        leaf = lambda t: t.detach().contiguous().requires_grad_(True)  # noqa: E731
        self.x, self.gate_up, self.down = leaf(self.x32.bfloat16()), leaf(self.gate_up32.bfloat16()), leaf(
            self.down32.bfloat16())
        self.gate_up_interleaved = leaf(torch.stack(self.gate_up.detach().chunk(2), 1).reshape_as(self.gate_up))
        self.layout = kernel_layout(engine)
        self.copies, self.gated_copies = WeightCopies(), WeightCopies()
        swap_class(engine, EpilogueSwiGLUEngine)
        engine.copy_weights(self.gated_copies, "gated")
        swap_class(engine, FusedTRMoEEngine)
        engine.copy_weights(self.copies, "mlp")
        self.leaves = (self.x32, self.x, self.gate_up, self.down, self.gate_up_interleaved, *engine.parameters())

    def reference(self, scaled: bool) -> torch.Tensor:
        """FP32 truth: the routed block's function (scaled) or a plain SwiGLU over the same weights."""
        g, u = (self.x.detach().float() @ self.gate_up32.detach().t()).chunk(2, dim=1)
        hidden = F.silu(g) * u
        if scaled:
            engine = self.engine
            scale = torch.full_like(hidden, float(engine.shared_output_scale))
            coeff = engine.expert_coefficients(self.ids, torch.float32) * float(engine.routed_output_scale)
            scale[:, self.shared_columns:] = coeff.repeat_interleave(engine.expert_gate.shape[2], dim=1)
            hidden = hidden * scale
        return hidden @ self.down32.detach().t()

    def cflib_block(self) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trmoe_forward(self.engine, self.x32, self.ids)

    def cflib_weight_copies(self) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trmoe_forward(self.engine, self.x32, self.ids, fused=(self.copies.weight("mlp.gate_up"),
                                                                         self.copies.weight("mlp.down")))

    def cflib_bf16_weights(self) -> torch.Tensor:
        return ScaledSwiGLUDown.apply(self.x @ self.gate_up.t(), self.ids, self.engine.route_table, self.down,
                                      self.layout)

    def cublas_liger(self) -> torch.Tensor:
        from cflib.ops.liger import LigerSiLUMulFunction
        g, u = (self.x @ self.gate_up.t()).chunk(2, dim=1)
        return LigerSiLUMulFunction.apply(g, u) @ self.down.t()

    def quack_concat(self) -> torch.Tensor:
        from quack.mlp import mlp_func
        return mlp_func(self.x, self.gate_up, self.down, "swiglu", concat_layout=True)

    def quack_interleaved(self) -> torch.Tensor:
        from quack.mlp import mlp_func
        return mlp_func(self.x, self.gate_up_interleaved, self.down, "swiglu")

    def cflib_gated(self) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trmoe_gated_forward(self.engine, self.x32, self.ids)

    def cflib_gated_copies(self) -> torch.Tensor:
        copies = self.gated_copies
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trmoe_gated_forward(self.engine, self.x32, self.ids,
                                       (copies.parts("gated.gate_up"), copies.parts("gated.down")))


# variant -> whether it computes the routed block (scaled) or a plain SwiGLU
VARIANTS = {"cflib_block": True, "cflib_weight_copies": True, "cflib_bf16_weights": True, "cublas_liger": False,
            "quack_concat": False, "quack_interleaved": False, "cflib_gated": True, "cflib_gated_copies": True}


def measure_variant(layer: _Layer, name: str, reference: torch.Tensor, rep_ms: int) -> dict:
    forward, scaled = getattr(layer, name), VARIANTS[name]
    entry: dict = {"function": "scaled" if scaled else "plain"}
    try:
        for leaf in layer.leaves:
            leaf.grad = None
        out = forward()
        out.backward(layer.grad)
        torch.cuda.synchronize()
        entry["forward_rel_error"] = _rel(out, reference)
        entry["finite_grads"] = all(leaf.grad is None or bool(torch.isfinite(leaf.grad).all()) for leaf in layer.leaves)
        entry["ms_forward_backward"] = _timed(lambda: forward().backward(layer.grad), rep_ms)
        with torch.no_grad():
            entry["ms_forward"] = _timed(forward, rep_ms)
    except Exception as err:  # noqa: BLE001  (a variant that cannot run is a finding, not a stop)
        entry["error"] = error_line(err)
        return entry
    try:
        entry["ms_forward_backward_graphed"] = _timed(_graphed(lambda: forward().backward(layer.grad)), rep_ms)
    except Exception as err:  # noqa: BLE001  (captured or not, the eager figures stand)
        entry["graphed_error"] = error_line(err)
    return entry


def _versions() -> dict:
    found = {}
    try:
        import quack
        found["quack"] = getattr(quack, "__version__", "unknown")
        import cutlass
        found["nvidia_cutlass_dsl"] = getattr(cutlass, "__version__", "unknown")
    except Exception as err:  # noqa: BLE001
        found["quack"] = error_line(err)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16 * 2048)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = _Layer(args.tokens, device)
    references = {scaled: layer.reference(scaled) for scaled in (True, False)}
    results = {}
    for name, scaled in VARIANTS.items():
        results[name] = entry = measure_variant(layer, name, references[scaled], args.rep_ms)
        graphed = entry.get("ms_forward_backward_graphed")
        print(f"{name:26s} " + (entry["error"] if "error" in entry else
                                f"fwd+bwd {entry['ms_forward_backward']:7.3f} ms  fwd {entry['ms_forward']:7.3f} ms"
                                f"  graphed fwd+bwd {graphed if graphed is None else round(graphed, 3)} ms"
                                f"  err {entry['forward_rel_error']:.1e}"), flush=True)
    config, columns = layer.config, layer.down32.shape[1]
    record = {
        **record_header("swiglu_epilogue", device),
        "shapes": {"tokens": args.tokens, "hidden": config.hidden_size, "columns": columns,
                   "shared_columns": layer.shared_columns},
        "precision": "bf16 (cflib_block: bf16 autocast over fp32 master weights)",
        "timing": f"triton.testing.do_bench median, warmup 50 ms, rep {args.rep_ms} ms, one layer; launched from "
                  "the host, and replayed from a CUDA graph ('ms_forward_backward_graphed')",
        "gemm_flops_forward_backward": 3 * 2 * args.tokens * config.hidden_size * 3 * columns,
        "variants": results,
    }
    record["framework"].update(_versions())
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)


if __name__ == "__main__":
    main()
