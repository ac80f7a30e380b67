"""The step's plain GEMMs (cflib.ops.gemm): torch's, and RacedGemms, which runs each shape on quack's kernel or
cuBLAS, whichever it timed faster, beside torch's products.

quack's GEMMs need a Hopper GPU with quack-kernels installed: those tests run there (make test-gpu) and are
skipped elsewhere; on a CPU RacedGemms is torch's.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.ops.dispatch import quack_problem
from cflib.ops.gemm import QUACK_TILES, TORCH_GEMMS, RacedGemms, _quack_gemm

QUACK = quack_problem(KERNEL_DEVICE)
needs_quack = pytest.mark.skipif(QUACK is not None, reason=f"quack's GEMMs cannot run here: {QUACK}")
M, K, N = 512, 384, 640  # above RACE_MIN_DIM, not multiples of every tile: partial tiles run too


def _operands(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    made = {"x": torch.randn(M, K, generator=gen), "weight": torch.randn(N, K, generator=gen),
            "grad_out": torch.randn(M, N, generator=gen), "total": torch.randn(N, K, generator=gen)}
    return {name: value.to(KERNEL_DEVICE, torch.float32 if name == "total" else dtype) for name, value in made.items()}


def _each_kind(gemms, o: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every kind of GEMM a step runs, through `gemms`: x @ W.T, grad_out @ W, the FP32 weight gradient, and an
    FP32 accumulation (into a copy of `total`)."""
    total = o["total"].clone()
    gemms.accumulate(total, o["grad_out"].t(), o["x"])
    return {"linear": gemms.linear(o["x"], o["weight"]), "matmul": gemms.matmul(o["grad_out"], o["weight"]),
            "weight_gradient": gemms.weight_gradient(o["grad_out"], o["x"]), "accumulate": total}


def _truth(o: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x, w, g = (o[name].double() for name in ("x", "weight", "grad_out"))
    return {"linear": x @ w.t(), "matmul": g @ w, "weight_gradient": g.t() @ x,
            "accumulate": o["total"].double() + g.t() @ x}


def _assert_close(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    for kind, value in got.items():
        # FP32 accumulation over K = 384 (512 for the weight gradients), rounded once to the output's dtype
        rtol = 1e-2 if value.dtype == torch.bfloat16 else 1e-4
        scale = truth[kind].abs().max().item()
        torch.testing.assert_close(value.double(), truth[kind].to(value.device), rtol=rtol, atol=rtol * scale,
                                   msg=lambda text, kind=kind: f"{kind}: {text}")


def test_torchs_gemms_compute_each_product():
    o = _operands(torch.float32)
    got = _each_kind(TORCH_GEMMS, o)
    assert got["weight_gradient"].dtype == torch.float32 and got["accumulate"].dtype == torch.float32
    _assert_close(got, _truth(o))


def test_the_raced_gemms_are_torchs_on_a_cpu():
    o = {name: value.cpu() for name, value in _operands(torch.float32).items()}
    raced = RacedGemms()
    for kind, value in _each_kind(raced, o).items():
        assert torch.equal(value, _each_kind(TORCH_GEMMS, o)[kind]), kind
    assert raced.chosen == {}


@needs_quack
@pytest.mark.parametrize("kind", sorted(QUACK_TILES))
def test_every_quack_tile_computes_its_kind_of_gemm(kind):
    """Each configuration RacedGemms may pick, forced, against the float64 product: a configuration quack
    refused would be dropped from the race, so here it must run."""
    o = _operands()
    operands = {"linear": (o["x"], o["weight"].t()), "matmul": (o["grad_out"], o["weight"]),
                "weight_gradient": (o["grad_out"].t(), o["x"]), "accumulate": (o["grad_out"].t(), o["x"])}[kind]
    for tile in QUACK_TILES[kind]:
        if kind == "accumulate":
            out = o["total"].clone()
        else:
            shape = (operands[0].shape[0], operands[1].shape[1])
            out = torch.empty(shape, dtype=torch.float32 if kind == "weight_gradient" else torch.bfloat16,
                              device=KERNEL_DEVICE)
        _quack_gemm(*operands, out, tile, kind == "accumulate")
        _assert_close({kind: out}, _truth(o))


@needs_quack
def test_the_race_keeps_one_choice_per_size_class_and_computes_the_same_products():
    o = _operands()
    raced = RacedGemms()
    first = _each_kind(raced, o)
    assert len(raced.chosen) == 4  # one choice per kind of GEMM at these shapes
    choices = dict(raced.chosen)
    again = _each_kind(raced, o)
    more_rows = torch.cat([o["x"], o["x"][:128]])  # 640 rows: the size class of 512 (ten bits)
    torch.testing.assert_close(raced.linear(more_rows, o["weight"]), more_rows @ o["weight"].t())
    assert raced.chosen == choices  # no new timing
    for kind in first:  # the same kernel again: bit for bit
        assert torch.equal(first[kind], again[kind]), kind
    _assert_close(first, _truth(o))
    assert raced.describe().startswith("quack_or_cublas (quack on ")


@needs_quack
def test_a_shape_first_met_in_a_graph_capture_runs_on_cublas_untimed():
    o = _operands()
    raced, x = RacedGemms(), o["x"][: M // 2]
    raced.linear(x, o["weight"])  # warm: cuBLAS' workspace before the capture
    raced.chosen.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = raced.linear(x, o["weight"])
    graph.replay()
    assert raced.chosen == {}
    torch.testing.assert_close(out, x @ o["weight"].t())
