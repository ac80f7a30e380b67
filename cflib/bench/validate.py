"""Every fast path against the PyTorch reference: forward outputs and every gradient, per dtype.

Truth is the reference computed in float64 from the same inputs. Each fast path
runs as training runs it (fp32; or BF16 activations with fp32 weights under
autocast), and its error is the normwise relative error against that truth
(docs/formats.md#numerical-tolerances: ||out - ref|| / ||ref||); the reference path's own error in the same
dtype is shown beside it. Max absolute and max relative (to the largest
reference magnitude) errors are reported too. Pass: normwise error within the
dtype's tolerance.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cflib.atomic import write_json_atomic
from cflib.bench.components import DTYPES, TOLERANCES, Component, Shape, shapes_for
from cflib.bench.components import components as all_components
from cflib.bench.timing import time_trmoe
from cflib.errors import ParamError
from cflib.jobs import job_out_dir, record_header
from cflib.ops.dispatch import KernelUnavailable, liger_problem, triton_problem
from cflib.ops.interpreter import bf16_arithmetic_broken
from cflib.progress import tqdm
from cflib.schema import Params


def _prepare(inputs: dict, params: tuple[str, ...], dtype: torch.dtype) -> dict:
    """Leaves in the run's dtypes: weights stay fp32 masters under BF16, as in training."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and name != "token_weights":
            cast = torch.float32 if (name in params and dtype != torch.float64) else dtype
            # Parameters, so modules can hold them as they are and their gradients land here.
            out[name] = torch.nn.Parameter(value.detach().to(cast))
        else:
            out[name] = value
    return out


def _forward_backward(fn: Callable, inputs: dict, grad_seed: int, dtype: torch.dtype):
    autocast = (torch.autocast(next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device.type,
                               dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext())
    with autocast:
        result = fn(inputs)
    out, backend = result if isinstance(result, tuple) else (result, None)
    gen = torch.Generator(device=out.device).manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32).to(out.dtype)
    out.backward(grad_out)
    tensors = {"out": out.detach()}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            tensors[f"d_{name}"] = value.grad.detach()
    return tensors, backend


def _errors(got: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    got, truth = got.double(), truth.double()
    diff = (got - truth).abs()
    scale = truth.abs().max().item() or 1.0
    return {"max_abs": diff.max().item(), "max_rel": diff.max().item() / scale,
            "norm_rel": (torch.linalg.vector_norm(got - truth) / (torch.linalg.vector_norm(truth) or 1.0)).item(),
            "finite": bool(torch.isfinite(got).all())}


def compare(component: Component, shape: Shape, dtype_name: str, device: torch.device, seed: int = 0) -> list[dict]:
    """One row per compared tensor (the output and each gradient) of one component, shape and dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = component.inputs(shape, gen, device)
    truth, _ = _forward_backward(component.reference, _prepare(raw, component.params, torch.float64), seed + 1,
                                 torch.float64)
    dtype = DTYPES[dtype_name]
    reference, _ = _forward_backward(component.reference, _prepare(raw, component.params, dtype), seed + 1, dtype)
    fast, backend = _forward_backward(component.fast, _prepare(raw, component.params, dtype), seed + 1, dtype)
    rows = []
    for name, expected in truth.items():
        fast_err, ref_err = _errors(fast[name], expected), _errors(reference[name], expected)
        tolerance = TOLERANCES[dtype_name]
        rows.append({
            "component": component.name, "tensor": name, "shape": shape.name, "dtype": dtype_name,
            "backend": backend, **fast_err, "reference_norm_rel": ref_err["norm_rel"], "tolerance": tolerance,
            "passed": fast_err["finite"] and fast_err["norm_rel"] <= tolerance and backend == component.backend,
        })
    return rows


def validate(device: torch.device, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
             shapes: list[Shape] | None = None, components: list[Component] | None = None,
             progress: Callable | None = None) -> tuple[list[dict], list[dict]]:
    """(rows, skipped): every comparison, and the ones this machine cannot make, with the reason."""
    problem = triton_problem(device, rocm_opt_in=True) or liger_problem()
    if problem:
        raise KernelUnavailable(f"cannot validate the fast paths: {problem}")
    shapes = shapes if shapes is not None else shapes_for(device)
    skipped: list[dict] = []
    grid = [(c, s, d) for s in shapes for d in dtypes for c in (components or all_components())]
    skip_bf16_arithmetic = device.type == "cpu" and bf16_arithmetic_broken()
    rows: list[dict] = []
    for component, shape, dtype_name in (progress(grid) if progress else grid):
        reason = component.unavailable(device, dtype_name, shape) if component.unavailable else None
        if skip_bf16_arithmetic and component.bf16_arithmetic and dtype_name == "bfloat16":
            reason = "Triton's interpreter multiplies bfloat16 values as raw bits; checked on the GPU"
        if reason:
            skipped.append({"component": component.name, "shape": shape.name, "dtype": dtype_name,
                            "reason": reason})
            continue
        rows.extend(compare(component, shape, dtype_name, device))
    return rows, skipped


def summarize(rows: list[dict]) -> dict:
    failed = [r for r in rows if not r["passed"]]
    worst = max(rows, key=lambda r: r["norm_rel"] / r["tolerance"]) if rows else None
    return {"checks": len(rows), "failed": len(failed), "passed": not failed,
            "backends": sorted({f"{r['component']}: {r['backend']}" for r in rows}),
            "worst": {k: worst[k] for k in ("component", "tensor", "shape", "dtype", "norm_rel", "tolerance")}
            if worst else None}


class ToleranceError(AssertionError):
    """A fast path broke its dtype's tolerance (or did not run)."""


def check(rows: list[dict]) -> None:
    failed = [r for r in rows if not r["passed"]]
    if failed:
        lines = [f"{r['component']} {r['tensor']} [{r['shape']}, {r['dtype']}]: backend {r['backend']}, "
                 f"error {r['norm_rel']:.2e} vs tolerance {r['tolerance']:.0e}" for r in failed]
        raise ToleranceError(f"{len(failed)} of {len(rows)} checks failed:\n" + "\n".join(lines))


def error_grid(rows: list[dict]) -> tuple[list[str], list[str], list[list[float]]]:
    """Rows component/tensor, columns shape/dtype, cells log10(error / tolerance) for the heat map."""
    row_keys = list(dict.fromkeys(f"{r['component']}.{r['tensor']}" for r in rows))
    col_keys = list(dict.fromkeys(f"{r['shape']} {r['dtype']}" for r in rows))
    cells = [[math.nan] * len(col_keys) for _ in row_keys]
    for r in rows:
        ratio = max(r["norm_rel"], 1e-12) / r["tolerance"]
        cells[row_keys.index(f"{r['component']}.{r['tensor']}")][col_keys.index(f"{r['shape']} {r['dtype']}")] = \
            math.log10(ratio) if math.isfinite(ratio) else math.inf
    return row_keys, col_keys, cells


def resolve_grid(dtypes: str, shapes: str, device: torch.device) -> tuple[list[str], list[Shape]]:
    """The notebook's comma lists as dtype names and shapes, or ValueError naming the parameter."""
    wanted = [d.strip() for d in str(dtypes).split(",") if d.strip()]
    if not wanted:
        raise ValueError("dtypes: name at least one of " + ", ".join(DTYPES))
    for name in wanted:
        if name not in DTYPES:
            raise ValueError(f"dtypes: unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    available = {s.name: s for s in shapes_for(device)}
    if shapes == "auto":
        return wanted, list(available.values())
    chosen = []
    for name in (s.strip() for s in str(shapes).split(",")):
        if name not in available:
            raise ValueError(f"shapes: {name!r} is not available on {device.type} (available: "
                             f"{', '.join(available)}; the 200m shapes need a GPU)")
        chosen.append(available[name])
    return wanted, chosen


@dataclass(frozen=True)
class ValidateParams(Params):
    """validate_kernels.ipynb's parameters."""

    out_dir: str | None = None  # None: a new outputs/runs/<time>-validate_kernels folder
    dtypes: str = "float32,bfloat16"
    shapes: str = "auto"  # auto: tiny, plus 200m on a GPU; or a comma list of tiny, 200m
    time_layers: bool = True  # GPU only: forward+backward ms of one TR-MoE layer, reference vs fused

    def validate(self) -> None:
        try:
            resolve_grid(self.dtypes, self.shapes, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        except ValueError as err:
            raise ParamError(str(err)) from None


def run_job(params: ValidateParams, progress: bool = True) -> dict:
    """The validate_kernels notebook's job: every comparison, the TR-MoE layer timing on a GPU, one record.

    Writes out_dir/record.json (and never over another run's record) before any tolerance is judged,
    so a failing run still leaves its evidence.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wanted, chosen = resolve_grid(params.dtypes, params.shapes, device)
    time_layers = params.time_layers
    target = job_out_dir(params.out_dir, "runs", ("record.json",), "a record", name="validate_kernels")
    rows, skipped = validate(device, tuple(wanted), chosen,
                             progress=(lambda grid: tqdm(grid, desc="comparisons")) if progress else None)
    record = {
        **record_header("validate_kernels", device, target),
        "triton_interpreter": device.type == "cpu",
        "truth": "PyTorch reference in float64 from the same inputs",
        "error_measure": "normwise relative error ||fast - truth|| / ||truth||; max_abs; max_rel = max|diff| / max|truth|",
        "tolerances": TOLERANCES, "shapes": {s.name: {"batch": s.batch, "seq_len": s.seq_len,
                                                      **s.config.to_dict()} for s in chosen},
        "summary": summarize(rows), "skipped": skipped, "rows": rows,
    }
    if device.type == "cuda" and time_layers:
        config = next((s.config for s in chosen if s.name == "200m"), chosen[-1].config)
        ms = time_trmoe(config, 16 * 2048, device)
        record["trmoe_layer_ms"] = {"tokens": 16 * 2048, "precision": "bf16-autocast",
                                    "timing": "triton.testing.do_bench median, forward+backward of one layer",
                                    **ms, "speedup": ms["torch_dense"] / ms["triton_fused"]}
    write_json_atomic(target / "record.json", record)
    return record


def error_table(rows: list[dict]) -> str:
    header = f"{'component':14s} {'tensor':22s} {'shape':5s} {'dtype':9s} {'backend':38s} " \
             f"{'norm_rel':>9s} {'ref':>9s} {'max_abs':>9s} {'max_rel':>9s} {'tol':>7s}  ok"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['component']:14s} {r['tensor']:22s} {r['shape']:5s} {r['dtype']:9s} {str(r['backend']):38s} "
                     f"{r['norm_rel']:9.2e} {r['reference_norm_rel']:9.2e} {r['max_abs']:9.2e} {r['max_rel']:9.2e} "
                     f"{r['tolerance']:7.0e}  {'yes' if r['passed'] else 'NO'}")
    return "\n".join(lines)


