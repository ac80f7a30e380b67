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
  epilogue design, not yet the routed block;
- quack_shared_cflib_routed: the routed block split in two, as it could run: the shared columns (output
  scale 1) through quack's MLP, the experts' columns through cflib's kernels, the two outputs added.
Each variant runs guarded: one that fails records its error and the others still run. Errors are norm-relative
against an FP32 computation of the same function.

    python -m cflib.bench.swiglu_epilogue --out outputs/records/swiglu_epilogue_h200.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cflib.bench.timing import error_line, trmoe_bench_inputs
from cflib.model.config import preset
from cflib.ops.trmoe import ScaledSwiGLUDown, fused_weights, trmoe_forward
from cflib.train.records import device_info, framework_versions


def _timed(step: Callable[[], None], rep_ms: int) -> float:
    from triton.testing import do_bench
    return do_bench(step, warmup=50, rep=rep_ms, return_mode="median")


def _rel(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found.float() - expected.float()).norm() / expected.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16 * 2048)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = preset("tr_hash_200m")
    engine, x32, ids, grad = trmoe_bench_inputs(config, args.tokens, device)
    with torch.no_grad():
        gate_up32, down32 = fused_weights(engine)
    shared_columns = config.shared_intermediate_size
    columns = down32.shape[1]
    x = x32.detach().bfloat16().requires_grad_(True)
    gate_up = gate_up32.detach().bfloat16().requires_grad_(True)
    down = down32.detach().bfloat16().contiguous().requires_grad_(True)
    gate_up_interleaved = torch.stack(gate_up.detach().chunk(2), 1).reshape_as(gate_up).requires_grad_(True)
    layout = (shared_columns, engine.expert_gate.shape[2], config.vocab_size, float(engine.shared_output_scale),
              float(engine.routed_output_scale), float(engine.route_weights[0]), float(engine.route_weights[-1]))

    def plain_reference() -> torch.Tensor:
        g, u = (x.detach().float() @ gate_up32.detach().t()).chunk(2, dim=1)
        return (F.silu(g) * u) @ down32.detach().t()

    def scaled_reference() -> torch.Tensor:
        g, u = (x.detach().float() @ gate_up32.detach().t()).chunk(2, dim=1)
        scale = torch.full((args.tokens, columns), float(engine.shared_output_scale), device=device)
        coeff = engine.expert_coefficients(ids, torch.float32) * float(engine.routed_output_scale)
        scale[:, shared_columns:] = coeff.repeat_interleave(engine.expert_gate.shape[2], dim=1)
        return (F.silu(g) * u * scale) @ down32.detach().t()

    def cflib_block() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trmoe_forward(engine, x32, ids)

    def cflib_bf16_weights() -> torch.Tensor:
        return ScaledSwiGLUDown.apply(x @ gate_up.t(), ids, engine.route_table, down, layout)

    def cublas_liger() -> torch.Tensor:
        from cflib.ops.liger import LigerSiLUMulFunction
        g, u = (x @ gate_up.t()).chunk(2, dim=1)
        return LigerSiLUMulFunction.apply(g, u) @ down.t()

    def quack_concat() -> torch.Tensor:
        from quack.mlp import mlp_func
        return mlp_func(x, gate_up, down, "swiglu", concat_layout=True)

    def quack_interleaved() -> torch.Tensor:
        from quack.mlp import mlp_func
        return mlp_func(x, gate_up_interleaved, down, "swiglu")

    routed_layout = (0, *layout[1:])
    gate_rows = gate_up.detach().chunk(2)
    shared_gate_up = torch.cat([half[:shared_columns] for half in gate_rows]).requires_grad_(True)
    routed_gate_up = torch.cat([half[shared_columns:] for half in gate_rows]).requires_grad_(True)
    shared_down = down.detach()[:, :shared_columns].contiguous().requires_grad_(True)
    routed_down = down.detach()[:, shared_columns:].contiguous().requires_grad_(True)

    def quack_shared_cflib_routed() -> torch.Tensor:
        from quack.mlp import mlp_func
        if float(engine.shared_output_scale) != 1.0:
            raise ValueError("the split needs shared_output_scale 1")
        shared = mlp_func(x, shared_gate_up, shared_down, "swiglu", concat_layout=True)
        return shared + ScaledSwiGLUDown.apply(x @ routed_gate_up.t(), ids, engine.route_table, routed_down,
                                               routed_layout)

    variants = {"cflib_block": (cflib_block, "scaled"), "cflib_bf16_weights": (cflib_bf16_weights, "scaled"),
                "cublas_liger": (cublas_liger, "plain"), "quack_concat": (quack_concat, "plain"),
                "quack_interleaved": (quack_interleaved, "plain"),
                "quack_shared_cflib_routed": (quack_shared_cflib_routed, "scaled")}
    references = {"scaled": scaled_reference(), "plain": plain_reference()}
    leaves = (x32, x, gate_up, down, gate_up_interleaved, shared_gate_up, routed_gate_up, shared_down, routed_down,
              *engine.parameters())
    results: dict[str, dict] = {}
    for name, (forward, kind) in variants.items():
        try:
            for leaf in leaves:
                leaf.grad = None
            out = forward()
            out.backward(grad)
            torch.cuda.synchronize()
            entry: dict = {"function": kind, "forward_rel_error": _rel(out, references[kind]),
                           "finite_grads": all(leaf.grad is None or bool(torch.isfinite(leaf.grad).all())
                                               for leaf in leaves)}

            def step(forward=forward) -> None:
                forward().backward(grad)

            entry["ms_forward_backward"] = _timed(step, args.rep_ms)
            with torch.no_grad():
                entry["ms_forward"] = _timed(lambda forward=forward: forward(), args.rep_ms)
        except Exception as err:  # noqa: BLE001  (a variant that cannot run is a finding, not a stop)
            entry = {"function": kind, "error": error_line(err)}
        results[name] = entry
        print(f"{name:20s} " + (f"fwd+bwd {entry['ms_forward_backward']:7.3f} ms  fwd {entry['ms_forward']:7.3f} ms"
                                f"  err {entry['forward_rel_error']:.1e}" if "error" not in entry
                                else entry["error"]), flush=True)
    gemm_flops = 3 * 2 * args.tokens * config.hidden_size * 3 * columns  # fwd + 2x bwd, three projections
    record = {
        "job": "swiglu_epilogue", "framework": framework_versions(), "device": device_info(device, count=1),
        "shapes": {"tokens": args.tokens, "hidden": config.hidden_size, "columns": columns,
                   "shared_columns": shared_columns},
        "precision": "bf16 (cflib_block: bf16 autocast over fp32 master weights)",
        "timing": f"triton.testing.do_bench median, warmup 50 ms, rep {args.rep_ms} ms, one layer",
        "gemm_flops_forward_backward": gemm_flops, "variants": results,
    }
    try:
        import quack
        record["framework"]["quack"] = getattr(quack, "__version__", "unknown")
        import cutlass
        record["framework"]["nvidia_cutlass_dsl"] = getattr(cutlass, "__version__", "unknown")
    except Exception as err:  # noqa: BLE001
        record["framework"]["quack"] = error_line(err)
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)


if __name__ == "__main__":
    main()
