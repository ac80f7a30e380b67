"""Every fast path against the PyTorch reference: forward outputs and every gradient, per dtype.

Truth is the reference computed in float64 from the same inputs. Each fast path
runs as training runs it (fp32; or BF16 activations with fp32 weights under
autocast), and its error is the normwise relative error against that truth
(METHOD: ||out - ref|| / ||ref||); the reference path's own error in the same
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
import torch.nn.functional as F

from .config import ModelConfig, preset
from .kernels import KernelPlan, KernelUnavailable, SFTLoss, liger_problem, triton_problem
from .loss import IGNORE_INDEX
from .ops.interpreter import bf16_arithmetic_broken
from .model import RMSNorm, TRMoEEngine, apply_rope, rope_cos_sin, rope_inv_freq

# bf16 operands land between 1e-3 and 1e-2 against a float64 truth; fp32 far under 1e-3 (METHOD.md).
TOLERANCES = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Shape:
    name: str
    config: ModelConfig
    batch: int
    seq_len: int


def shapes_for(device: torch.device) -> list[Shape]:
    """Tiny shapes everywhere (the interpreter on CPU is slow); the 200M shapes on a GPU."""
    tiny = ModelConfig(**{**preset("smoke").to_dict(), "vocab_size": 300, "hidden_size": 64,
                          "shared_intermediate_size": 96, "intermediate_size": 32})
    found = [Shape("tiny", tiny, batch=2, seq_len=12)]
    if device.type == "cuda":
        found.append(Shape("200m", preset("tr_hash_200m"), batch=2, seq_len=2048))
    return found


@dataclass
class Component:
    name: str
    backend: str  # what the fast path is; checked against what the modules report
    inputs: Callable[[Shape, torch.Generator, torch.device], dict[str, torch.Tensor]]
    params: tuple[str, ...]  # inputs that are weights: fp32 masters under autocast
    reference: Callable[[dict], torch.Tensor]
    fast: Callable[[dict], tuple[torch.Tensor, str]]  # output, backend read back
    bf16_arithmetic: bool = False  # the kernel multiplies bf16 values (not fp32 then a bf16 store)


def _randn(shape, generator, device, scale=1.0, shift=0.0):
    return torch.randn(shape, generator=generator, device=device) * scale + shift


def _rms_inputs(shape, gen, device):
    return {"x": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "weight": _randn((shape.config.hidden_size,), gen, device, 0.1, 1.0)}


def _rms_module(inputs: dict, backend: str) -> RMSNorm:
    norm = RMSNorm(inputs["weight"].shape[0], 1e-6).to(inputs["weight"].device)  # the preset's norm_eps
    norm.weight = inputs["weight"]
    norm.backend = backend
    return norm


def _rms_fast(inputs):
    norm = _rms_module(inputs, "liger")
    return norm(inputs["x"]), norm.last_backend


def _add_norm_inputs(shape, gen, device):
    return {"h": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "delta": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "weight": _randn((shape.config.hidden_size,), gen, device, 0.1, 1.0)}


def _add_norm_reference(inputs):
    total = inputs["h"] + inputs["delta"]
    return torch.cat([total.flatten(), _rms_module(inputs, "torch")(total).flatten().to(total.dtype)])


def _add_norm_fast(inputs):
    norm = _rms_module(inputs, "cflib_add_rmsnorm")
    total, normed = norm.add_norm(inputs["h"], inputs["delta"])
    return torch.cat([total.flatten(), normed.flatten().to(total.dtype)]), norm.last_backend


def _rope_inputs(shape, gen, device):
    c = shape.config
    return {"q": _randn((shape.batch, shape.seq_len, c.num_attention_heads, c.head_dim), gen, device),
            "k": _randn((shape.batch, shape.seq_len, c.num_key_value_heads, c.head_dim), gen, device)}


def _cos_sin(inputs):
    q = inputs["q"]
    return rope_cos_sin(rope_inv_freq(q.shape[-1], 10000.0), q.shape[1], q.device)


def _rope_reference(inputs):
    cos, sin = _cos_sin(inputs)
    if inputs["q"].dtype == torch.float64:
        cos, sin = cos.double(), sin.double()
    return torch.cat([apply_rope(inputs["q"], cos, sin).flatten(), apply_rope(inputs["k"], cos, sin).flatten()])


def _rope_fast(inputs):
    from .ops.liger import LigerRopeFunction
    cos, sin = _cos_sin(inputs)
    q, k = LigerRopeFunction.apply(inputs["q"].transpose(1, 2), inputs["k"].transpose(1, 2), cos, sin)
    return torch.cat([q.transpose(1, 2).flatten(), k.transpose(1, 2).flatten()]), "liger"


def _qk_inputs(shape, gen, device):
    c = shape.config
    width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return {"qkv": _randn((shape.batch * shape.seq_len, width), gen, device),
            "q_weight": _randn((c.head_dim,), gen, device, 0.1, 1.0),
            "k_weight": _randn((c.head_dim,), gen, device, 0.1, 1.0), "shape": shape}


def _qk_reference(inputs):
    shape, qkv = inputs["shape"], inputs["qkv"]
    c = shape.config
    q, k, v = qkv.view(shape.batch, shape.seq_len, -1, c.head_dim).split(
        [c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads], dim=2)
    cos, sin = rope_cos_sin(rope_inv_freq(c.head_dim, c.rope_theta), shape.seq_len, qkv.device)
    if qkv.dtype == torch.float64:
        cos, sin = cos.double(), sin.double()
    q = apply_rope(_rms_module({"weight": inputs["q_weight"]}, "torch")(q), cos, sin)
    k = apply_rope(_rms_module({"weight": inputs["k_weight"]}, "torch")(k), cos, sin)
    return torch.cat([q.flatten(), k.flatten(), v.flatten()])


def _qk_fast(inputs):
    from .ops.qk_norm_rope import qkv_norm_rope
    shape, c = inputs["shape"], inputs["shape"].config
    cos, sin = rope_cos_sin(rope_inv_freq(c.head_dim, c.rope_theta), shape.seq_len, inputs["qkv"].device)
    q, k, v = qkv_norm_rope(inputs["qkv"], inputs["q_weight"], inputs["k_weight"], cos, sin, shape.batch,
                            shape.seq_len, c.num_attention_heads, c.num_key_value_heads, 1e-6)
    return torch.cat([q.flatten(), k.flatten(), v.flatten()]), "cflib_qk_norm_rope"


def _swiglu_inputs(shape, gen, device):
    width = shape.config.shared_intermediate_size
    return {"gate": _randn((shape.batch * shape.seq_len, width), gen, device),
            "up": _randn((shape.batch * shape.seq_len, width), gen, device)}


def _swiglu_fast(inputs):
    from .ops.liger import LigerSiLUMulFunction
    return LigerSiLUMulFunction.apply(inputs["gate"], inputs["up"]), "liger"


ENGINE_WEIGHTS = ("shared_gate.weight", "shared_up.weight", "shared_down.weight",
                  "expert_gate", "expert_up", "expert_down")


def _moe_inputs(shape, gen, device):
    c = shape.config
    engine = TRMoEEngine(c).to(device)
    tokens = shape.batch * shape.seq_len
    found = {"x": _randn((tokens, c.hidden_size), gen, device)}
    for name, param in engine.named_parameters():
        found[name] = _randn(param.shape, gen, device, 0.02 * 2)
    found["token_ids"] = torch.randint(0, c.vocab_size, (tokens,), generator=gen, device=device)
    found["route_table"] = engine.route_table
    found["config"] = c
    return found


def _engine(inputs: dict, backend: str) -> TRMoEEngine:
    engine = TRMoEEngine(inputs["config"], build_routes=False).to(inputs["x"].device)
    for name in ENGINE_WEIGHTS:
        module_name, _, attr = name.rpartition(".")
        owner = engine.get_submodule(module_name) if module_name else engine
        setattr(owner, attr, inputs[name])
    engine.route_table.copy_(inputs["route_table"])
    engine.backend = backend
    return engine


def _moe_reference(inputs):
    return _engine(inputs, "torch_dense")(inputs["x"], inputs["token_ids"])


def _moe_fast(inputs):
    engine = _engine(inputs, "triton_fused")
    return engine(inputs["x"], inputs["token_ids"]), engine.last_backend


def _loss_inputs(shape, gen, device, weighted: bool):
    c = shape.config
    tokens = shape.batch * shape.seq_len
    labels = torch.randint(0, c.vocab_size, (tokens,), generator=gen, device=device)
    labels[torch.rand(tokens, generator=gen, device=device) < 1 / 3] = IGNORE_INDEX
    found = {"hidden": _randn((tokens, c.hidden_size), gen, device),
             "head_weight": _randn((c.vocab_size, c.hidden_size), gen, device, 0.02 * 2),
             "labels": labels}
    if weighted:
        found["token_weights"] = torch.rand(tokens, generator=gen, device=device) * 3
    return found


def _loss_reference(inputs):
    # Full logits, no chunking: independent of every chunked path.
    logits = inputs["hidden"] @ inputs["head_weight"].t()
    losses = F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, inputs["labels"],
                             ignore_index=IGNORE_INDEX, reduction="none")
    weights = inputs.get("token_weights")
    return (losses * weights if weights is not None else losses).sum()


def _loss_fast(plan: KernelPlan):
    def run(inputs):
        loss = SFTLoss(plan)
        out, _ = loss(inputs["hidden"], inputs["head_weight"], inputs["labels"], 1024, False,
                      token_weights=inputs.get("token_weights"))
        return out, loss.last_backend
    return run


COMPONENTS = [
    Component("rmsnorm", "liger", _rms_inputs, ("weight",), lambda i: _rms_module(i, "torch")(i["x"]), _rms_fast),
    # h is the fp32 residual stream in every run, like a weight: listed with them.
    Component("add_rmsnorm", "cflib_add_rmsnorm", _add_norm_inputs, ("h", "weight"), _add_norm_reference,
              _add_norm_fast),
    Component("qk_norm_rope", "cflib_qk_norm_rope", _qk_inputs, ("q_weight", "k_weight"), _qk_reference, _qk_fast),
    Component("rope", "liger", _rope_inputs, (), _rope_reference, _rope_fast),
    Component("swiglu", "liger", _swiglu_inputs, (), lambda i: F.silu(i["gate"]) * i["up"], _swiglu_fast,
              bf16_arithmetic=True),
    Component("trmoe", "triton_fused", _moe_inputs, ENGINE_WEIGHTS, _moe_reference, _moe_fast),
    Component("loss", "liger_fused_linear_ce", lambda s, g, d: _loss_inputs(s, g, d, False), ("head_weight",),
              _loss_reference, _loss_fast(KernelPlan(liger=True, custom=False))),
    Component("weighted_loss", "cflib_triton_fused_linear_ce_weighted", lambda s, g, d: _loss_inputs(s, g, d, True),
              ("head_weight",), _loss_reference, _loss_fast(KernelPlan(liger=False, custom=True))),
]


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
    grid = [(c, s, d) for s in shapes for d in dtypes for c in (components or COMPONENTS)]
    skip_bf16_arithmetic = device.type == "cpu" and bf16_arithmetic_broken()
    rows: list[dict] = []
    for component, shape, dtype_name in (progress(grid) if progress else grid):
        if skip_bf16_arithmetic and component.bf16_arithmetic and dtype_name == "bfloat16":
            skipped.append({"component": component.name, "shape": shape.name, "dtype": dtype_name,
                            "reason": "Triton's interpreter multiplies bfloat16 values as raw bits; "
                                      "checked on the GPU"})
            continue
        rows.extend(compare(component, shape, dtype_name, device))
    return rows, skipped


def trmoe_bench_inputs(config: ModelConfig, tokens: int, device: torch.device
                       ) -> tuple[TRMoEEngine, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What TR-MoE layer timings run on: an engine with real weights, its input, token ids, an output gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    engine = TRMoEEngine(config).to(device)
    with torch.no_grad():  # TRMoEEngine leaves its weights uninitialised; time on real values
        for param in engine.parameters():
            param.normal_(0.0, 0.02)
    x = torch.randn(tokens, config.hidden_size, generator=gen, device=device, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=gen, device=device)
    grad = torch.randn(tokens, config.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
    return engine, x, ids, grad


def time_forward_backward(forward: Callable[[], torch.Tensor], grad: torch.Tensor, rep_ms: int = 300) -> float:
    """Median ms of forward (under BF16 autocast) plus backward from `grad` (triton.testing.do_bench)."""
    from triton.testing import do_bench

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward()
        out.backward(grad)
    return do_bench(step, warmup=50, rep=rep_ms, return_mode="median")


def time_trmoe(config: ModelConfig, tokens: int, device: torch.device) -> dict[str, float]:
    """Forward+backward ms of one TR-MoE layer (BF16 autocast), reference vs the fused Triton block."""
    engine, x, ids, grad = trmoe_bench_inputs(config, tokens, device)
    found = {}
    for backend in ("torch_dense", "triton_fused"):
        engine.backend = backend
        found[backend] = time_forward_backward(lambda: engine(x, ids), grad)
    return found


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


def run_job(out_dir: str | None = None, dtypes: str = "float32,bfloat16", shapes: str = "auto",
            time_layers: bool = True, progress: bool = True) -> dict:
    """The validate_kernels notebook's job: every comparison, the TR-MoE layer timing on a GPU, one record.

    Writes out_dir/record.json (and never over another run's record) before any tolerance is judged,
    so a failing run still leaves its evidence.
    """
    from datetime import datetime

    from tqdm.auto import tqdm

    from .atomic import write_json_atomic
    from .paths import resolve_path
    from .records import device_info, framework_versions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wanted, chosen = resolve_grid(dtypes, shapes, device)
    target = resolve_path(out_dir or f"outputs/runs/{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}-validate_kernels")
    if (target / "record.json").exists():
        raise ValueError(f"out_dir {target} already holds a record; choose another out_dir")
    rows, skipped = validate(device, tuple(wanted), chosen,
                             progress=(lambda grid: tqdm(grid, desc="comparisons")) if progress else None)
    record = {
        "job": "validate_kernels", "created_utc": datetime.now().astimezone().isoformat(timespec="seconds"),
        "framework": framework_versions(), "device": device_info(device),
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
    record["out_dir"] = str(target)
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


def plot_error_heatmap(rows: list[dict], save_to=None):
    """log10(error / tolerance) per tensor and shape/dtype: below 0 passes."""
    import matplotlib.pyplot as plt
    row_keys, col_keys, cells = error_grid(rows)
    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(col_keys), 0.8 + 0.28 * len(row_keys)))
    image = ax.imshow(cells, cmap="RdYlGn_r", vmin=-4, vmax=1, aspect="auto")
    ax.set_xticks(range(len(col_keys)), col_keys, rotation=30, ha="right")
    ax.set_yticks(range(len(row_keys)), row_keys, fontsize=8)
    fig.colorbar(image, ax=ax, label="log10(error / tolerance)")
    ax.set_title("fast paths vs float64 truth (> 0 fails)")
    fig.tight_layout()
    if save_to is not None:
        fig.savefig(save_to, dpi=110)
    return fig
