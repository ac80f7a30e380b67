"""GEMMs the fast paths share: weight gradients written in FP32, the SwiGLU GEMM with quack's epilogue, and the
step's plain GEMMs on the faster of quack's kernel and cuBLAS.

`gated_gemm` is x @ W.T for a gate|up weight whose rows interleave gate and up (row 2j gate column j, row 2j + 1
its up column) with SwiGLU applied in the GEMM's epilogue: it writes the pre-activation (for backward) and
silu(gate) * up, so no kernel reads the [N, 2C] pre-activation back forward. On CUDA it is quack-kernels'
(quack.gemm_interface.gemm_gated, Hopper); elsewhere the same function in PyTorch. The tests check it through
the block that uses it against its float64 formula.

`Gemms` is how a step computes its other GEMMs (the projections' forward, input and weight gradients, and the
tied head's): through torch, so cuBLAS on a GPU. `RacedGemms` (`quack_gemms`) times quack's GEMM kernel at a
few tile configurations against cuBLAS at the first call of each size class (its kind, sides and layouts), and
runs the fastest from then on. Both accumulate in FP32 over K tile by tile; at the 200M shapes on the H200
their outputs were equal bit for bit (docs/kernels.md).
"""
from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch 2.8+: mm(..., out_dtype=)
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")  # torch 2.8+: addmm(..., out_dtype=)


def weight_gradient(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_out [N, out] and x [N, in] -> the FP32 weight gradient [out, in]. On CUDA the GEMM writes FP32 from
    its FP32 accumulator; elsewhere (no such GEMM) it is the half-precision product cast, as autocast's."""
    if grad_out.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(grad_out.t(), x, out_dtype=torch.float32)
    return (grad_out.t() @ x).float()


def accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b. Half-precision operands on a GPU accumulate straight into total in fp32 (cuBLAS
    with an fp32 output, torch 2.8+), without a head-sized product in their dtype cast and added per chunk."""
    if total.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _ADDMM_OUT_DTYPE:
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += (a @ b).float()


def master_gradients(full: Callable[[], torch.Tensor], regions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                     needed: Sequence[bool]) -> list[torch.Tensor | None]:
    """Each master's gradient, its region of the FP32 weight gradient `full()` (computed only if one is needed):
    a slice of rows as it is, contiguous; any other view copied out."""
    if not any(needed):
        return [None] * len(regions)
    whole = full()
    return [region(whole).contiguous() if need else None for region, need in zip(regions, needed)]


def gated_gemm(x: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] and an interleaved gate|up weight [2C, D] (one 16-bit dtype) -> (pre-activation [N, 2C],
    silu(gate) * up [N, C]); on CUDA the activation comes from the FP32 accumulator, rounded once."""
    if x.is_cuda:
        from quack.gemm_interface import gemm_gated
        return gemm_gated(x, gate_up.t(), activation="swiglu", tuned=False)
    preact = F.linear(x, gate_up)
    gate, up = preact.float().unflatten(1, (-1, 2)).unbind(2)
    return preact, (F.silu(gate) * up).to(x.dtype)


class Gemms:
    """A training step's plain GEMMs, through torch (cuBLAS on a GPU)."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight [N, K].T."""
        return F.linear(x, weight)

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """a [..., K] @ b [K, N] (into `out` [M, N], a 2-D, if given)."""
        return a @ b if out is None else torch.mm(a, b, out=out)

    def weight_gradient(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return weight_gradient(grad_out, x)

    def accumulate(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        accumulate_product(total, a, b)

    def describe(self) -> str:
        return self.name


TORCH_GEMMS = Gemms()

# quack's tile configurations a RacedGemms tries beside cuBLAS, per kind of GEMM: (tile_m, tile_n, cluster_m,
# cluster_n, pingpong, swap_ab). Each was quack's autotuner's choice for one of the 200M step's GEMMs on the H200
# (outputs/records/h200_session_2026-12-03_c); trying two instead of its forty-four keeps the first step's
# compilation to seconds.
QUACK_TILES = {
    "linear": ((128, 160, 1, 2, True, True), (128, 192, 2, 1, True, False)),
    "matmul": ((128, 128, 1, 2, True, True), (192, 128, 1, 2, True, False)),
    "weight_gradient": ((256, 192, 2, 1, False, False), (128, 192, 1, 2, True, False)),
    "accumulate": ((128, 192, 2, 1, True, False), (256, 192, 2, 1, False, False)),
}
RACE_MIN_DIM = 128  # a GEMM with a smaller side stays on cuBLAS, untimed
RACE_MARGIN = 0.01  # quack must beat cuBLAS by this fraction: a tie keeps cuBLAS
# The race times its candidates where a step runs them: at the board's power limit, where the clocks follow each
# kernel's energy, not its cycles. cuBLAS's GEMM first runs RACE_HEAT_MS back to back, then each candidate a window
# of RACE_WINDOW_MS, the candidates interleaved over RACE_ROUNDS rounds and each one's median kept
# (docs/kernels.md, the GEMMs on quack or cuBLAS).
RACE_HEAT_MS = 100.0
RACE_WINDOW_MS = 20.0
RACE_ROUNDS = 3


def _quack_aligned(t: torch.Tensor) -> bool:
    """Whether quack's TMA loads can read t: 2-D, one unit stride, the other and the start 16-byte aligned."""
    if t.dim() != 2 or 1 not in t.stride() or t.data_ptr() % 16:
        return False
    return all(stride * t.element_size() % 16 == 0 for stride in t.stride() if stride != 1)


def _event_time(run: Callable[[], None], calls: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


class RacedGemms(Gemms):
    """Each GEMM of a new size class and layout timed through cuBLAS and quack's kernel at QUACK_TILES'
    configurations (into a scratch output) at the power limit, the fastest kept for every later call of that
    class. A class first met while a CUDA graph is being captured, and operands quack cannot read, run on
    cuBLAS."""

    name = "quack_or_cublas"

    def __init__(self) -> None:
        self.chosen: dict[tuple, tuple | None] = {}  # key -> a QUACK_TILES entry, or None for cuBLAS

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return super().linear(x, weight)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        self._run("linear", rows, weight.t(), out, lambda o: torch.mm(rows, weight.t(), out=o))
        return out.view(*x.shape[:-1], weight.shape[0])

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not a.is_cuda:
            return super().matmul(a, b, out)
        rows = a.reshape(-1, a.shape[-1])
        found = out if out is not None else torch.empty(rows.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        self._run("matmul", rows, b, found, lambda o: torch.mm(rows, b, out=o))
        return found if out is not None else found.view(*a.shape[:-1], b.shape[1])

    def weight_gradient(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda or not _MM_OUT_DTYPE:
            return super().weight_gradient(grad_out, x)
        out = torch.empty(grad_out.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        self._run("weight_gradient", grad_out.t(), x, out,
                  lambda o: torch.mm(grad_out.t(), x, out_dtype=torch.float32, out=o))
        return out

    def accumulate(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if not total.is_cuda or not _ADDMM_OUT_DTYPE:
            return super().accumulate(total, a, b)
        self._run("accumulate", a, b, total, lambda o: accumulate_product(o, a, b))

    def describe(self) -> str:
        quack = sum(tile is not None for tile in self.chosen.values())
        return f"{self.name} (quack on {quack} of {len(self.chosen)} GEMM size classes)"

    def _run(self, kind: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             cublas: Callable[[torch.Tensor], None]) -> None:
        # A shape goes by its size class (each side's bit length) and layouts: the rows that change from batch to
        # batch (packed windows' supervised rows, the loss's last chunk) reuse one timing
        sides = tuple(side.bit_length() for side in (a.shape[0], a.shape[1], b.shape[1]))
        key = (kind, sides, *(t.stride(-1) == 1 for t in (a, b, out)), a.dtype, out.dtype)
        if key not in self.chosen:
            if torch.cuda.is_current_stream_capturing():
                return cublas(out)
            eligible = (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
                        and min(*a.shape, b.shape[1]) >= RACE_MIN_DIM and all(map(_quack_aligned, (a, b, out))))
            self.chosen[key] = self._race(kind, a, b, out, cublas) if eligible else None
        tile = self.chosen[key]
        # asked again at every quack call: within a class a start or a stride may move
        if tile is None or not all(map(_quack_aligned, (a, b, out))):
            cublas(out)
        else:
            _quack_gemm(a, b, out, tile, kind == "accumulate")

    def _race(self, kind: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
              cublas: Callable[[torch.Tensor], None]) -> tuple | None:
        scratch = torch.empty_like(out)
        runs: dict[tuple | None, Callable[[], None]] = {None: lambda: cublas(scratch)}
        for tile in QUACK_TILES[kind]:
            runs[tile] = functools.partial(_quack_gemm, a, b, scratch, tile, kind == "accumulate")
        calls = {}
        for tile, run in runs.items():
            try:
                run()  # compiles quack's kernel at its first use
            except Exception:  # noqa: BLE001  (a configuration quack refuses for this shape is not a candidate)
                continue
            calls[tile] = max(2, math.ceil(RACE_WINDOW_MS / max(_event_time(run, 1), 1e-3)))
        _event_time(runs[None], math.ceil(calls[None] * RACE_HEAT_MS / RACE_WINDOW_MS))
        rounds = {tile: [] for tile in calls}
        for _ in range(RACE_ROUNDS):
            for tile, count in calls.items():
                rounds[tile].append(_event_time(runs[tile], count))
        times = {tile: statistics.median(found) for tile, found in rounds.items()}
        best = min(times, key=times.get)
        return best if best is not None and times[best] < (1 - RACE_MARGIN) * times[None] else None


@functools.cache
def _quack_config(tile: tuple):
    from quack.gemm_config import GemmConfig
    tile_m, tile_n, cluster_m, cluster_n, pingpong, swap_ab = tile
    return GemmConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n, pingpong=pingpong,
                      swap_ab=swap_ab, is_dynamic_persistent=False, device_capacity=9)


def _quack_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tile: tuple, accumulate: bool) -> None:
    """out (+)= a @ b through quack's GEMM at one tile configuration (its untuned entry, which takes one)."""
    from quack.gemm_interface import gemm_tuned
    gemm_tuned.fn(a, b, out, None, add_to_output=accumulate, config=_quack_config(tile))


_RACED: RacedGemms | None = None


def step_gemms(quack: bool) -> Gemms:
    """The GEMMs of a run's steps: one RacedGemms for the process (its choices hold for every model it runs), or
    torch's."""
    global _RACED
    if not quack:
        return TORCH_GEMMS
    if _RACED is None:
        _RACED = RacedGemms()
    return _RACED
