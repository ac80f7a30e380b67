"""BF16 copies of the weights cflib's fused GEMMs read, written once per optimizer step instead of cast per forward.

Under autocast every forward casts each FP32 master weight to BF16, and the fused GEMMs (q|k|v, and the TR-MoE
block's gate|up and down) first concatenate their pieces in FP32; backward casts each gradient back and splits
it. `WeightCopies` holds each fused weight once, as one BF16 tensor laid out as its GEMM reads it, written in
place from the masters after every optimizer step (by `refresh`, since torch's fused AdamW moves the masters
without bumping their version counters, or by cflib's AdamW kernel as it updates each master: `targets`) and
before any forward that finds a master's storage or version moved (a load, an in-place edit). The GEMM reads
the copy as it is. Where a GEMM reads its copy through `linear` (q|k|v, o, gate|up), its backward writes the
weight gradient in FP32 on CUDA, straight from the GEMM's FP32 accumulator, and each master's gradient is a
slice of it (rows) or copied from it; through `weight` (the down projection) backward casts the copy's BF16
gradient into each master's in one pass; an op that takes the copy (`tensor`) and its master writes the
master's gradient itself (cflib's fused loss, the head). The forward's numbers are autocast's (the same
round-to-nearest cast of the same masters); the gradients are too where they are cast, and one BF16 rounding
closer to the FP32 product where the GEMM writes them.

The copies are plain tensors beside the model, not its state (checkpoints and state dicts do not change), and
they stay allocated while the model reads them: about 2 bytes per copied parameter. They apply to
full-parameter training under BF16 autocast: a module with adapters reads its masters (the adapters' updates
fold into effective weights per forward), and FSDP reshapes the masters into shards. A step replayed from a
CUDA graph runs no Python, so nothing checks the masters there: the trainer rewrites any stale copy before
each step (`refresh(stale_only=True)`), and every copy is written after it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cflib.ops.gemm import TORCH_GEMMS, Gemms, master_gradients

Region = Callable[[torch.Tensor], torch.Tensor]  # a master's place in its copy: a view of the copy shaped like it


@dataclass
class _Copy:
    masters: tuple[nn.Parameter, ...]
    regions: tuple[Region, ...]
    shape: tuple[int, int]
    tensor: torch.Tensor | None = None
    written_from: tuple = ()  # each master's (storage, version) when the copy was written

    def sources(self) -> tuple:
        return tuple((master.data_ptr(), master._version) for master in self.masters)

    def stale(self) -> bool:
        """Never written, or a master's storage or version moved since."""
        return self.tensor is None or self.sources() != self.written_from


class _FromCopy(torch.autograd.Function):
    """The copy as the GEMM's weight; its gradient becomes each master's FP32 gradient."""

    @staticmethod
    def forward(ctx, copy: torch.Tensor, regions: tuple[Region, ...], *masters: torch.Tensor) -> torch.Tensor:
        ctx.regions = regions
        ctx.masters = [(master.shape, master.dtype, master.device) for master in masters]
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grads = [torch.empty(shape, dtype=dtype, device=device).copy_(region(grad)) if needed else None
                 for (shape, dtype, device), region, needed in zip(ctx.masters, ctx.regions, ctx.needs_input_grad[2:])]
        return None, None, *grads


class _CopyLinear(torch.autograd.Function):
    """x @ copy.T, the copy as the GEMM's weight; backward writes the masters' FP32 gradients from one FP32 weight
    gradient (Gemms.weight_gradient), where the GEMM of _FromCopy's path would write BF16 for a cast to read
    back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, copy: torch.Tensor, gemms: Gemms, regions: tuple[Region, ...],
                *masters: torch.Tensor) -> torch.Tensor:
        x = x.to(copy.dtype)
        ctx.save_for_backward(x, copy)
        ctx.regions, ctx.gemms = regions, gemms
        return gemms.linear(x, copy)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, copy = ctx.saved_tensors
        gemms, grad_out = ctx.gemms, grad_out.to(copy.dtype)
        grad_x = gemms.matmul(grad_out, copy) if ctx.needs_input_grad[0] else None
        grads = master_gradients(
            lambda: gemms.weight_gradient(grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])),
            ctx.regions, ctx.needs_input_grad[4:])
        return grad_x, None, None, None, *grads


class WeightCopies:
    """Named BF16 copies, each of one or more FP32 masters (`add`), read by `weight(name)`; `gemms`: how the
    GEMMs that read them run (cflib.ops.gemm)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, gemms: Gemms = TORCH_GEMMS) -> None:
        self.dtype, self.gemms = dtype, gemms
        self.copies: dict[str, _Copy] = {}
        self._targets: dict[nn.Parameter, torch.Tensor] | None = None

    def add(self, name: str, masters: tuple[nn.Parameter, ...], regions: tuple[Region, ...],
            shape: tuple[int, int]) -> None:
        self.copies[name] = _Copy(masters, regions, shape)
        self._targets = None

    def _current(self, name: str) -> _Copy:
        copy = self.copies[name]
        if copy.stale():
            self._write(copy)
        return copy

    def weight(self, name: str) -> torch.Tensor:
        copy = self._current(name)
        return _FromCopy.apply(copy.tensor, copy.regions, *copy.masters)

    def tensor(self, name: str) -> torch.Tensor:
        """The copy itself, outside autograd, for an op that also takes its master and writes the master's FP32
        gradient (cflib's fused loss, the head)."""
        return self._current(name).tensor

    def parts(self, name: str) -> tuple[torch.Tensor, tuple[Region, ...], tuple[nn.Parameter, ...]]:
        """The copy, its regions and its masters, for an op that computes the masters' FP32 gradients itself
        from the copy's (cflib.ops.trmoe.GatedSwiGLUDown)."""
        copy = self._current(name)
        return copy.tensor, copy.regions, copy.masters

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ weight(name).T, its masters' gradients written in FP32 by the GEMM (Gemms.weight_gradient)."""
        copy = self._current(name)
        return _CopyLinear.apply(x, copy.tensor, self.gemms, copy.regions, *copy.masters)

    def targets(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each master's view of its copy, for the copies written so far: where an optimizer that writes the
        copies as it updates the masters (cflib.train.optim.TritonAdamW) puts each one's BF16 value."""
        if self._targets is None:
            views = [(master, region(copy.tensor)) for copy in self.copies.values() if copy.tensor is not None
                     for master, region in zip(copy.masters, copy.regions)]
            self._targets = dict(views)
            if len(self._targets) != len(views):  # one view per master: a second copy would go stale
                raise ValueError("a master weight has more than one copy")
        return self._targets

    @torch.no_grad()
    def refresh(self, stale_only: bool = False) -> None:
        """Every copy of a trained master written anew from its masters (after an optimizer step), or only those whose
        masters' storage or version moved (before a step that may replay a CUDA graph, where no forward checks them).
        A copy of frozen masters alone (requires_grad false) is written once, and again only where it went stale."""
        for copy in self.copies.values():
            if copy.stale() or (not stale_only and any(master.requires_grad for master in copy.masters)):
                self._write(copy)

    @torch.no_grad()
    def _write(self, copy: _Copy) -> None:
        device = copy.masters[0].device
        if copy.tensor is None or copy.tensor.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("weight copies are allocated outside CUDA graph captures: a captured graph "
                                   "would read a tensor the next allocation replaces")
            with torch.inference_mode(False):  # a first write under inference mode must not make it read-only
                copy.tensor = torch.empty(copy.shape, dtype=self.dtype, device=device)
            self._targets = None
        for master, region in zip(copy.masters, copy.regions):
            region(copy.tensor).copy_(master)
        copy.written_from = copy.sources()


def reads_half(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a GEMM on x computes in `dtype`: x is, or autocast casts to it."""
    kind = x.device.type
    return x.dtype == dtype or (torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == dtype)


def rows(start: int, stop: int) -> Region:
    return lambda copy: copy[start:stop]


def columns(start: int, stop: int) -> Region:
    return lambda copy: copy[:, start:stop]
