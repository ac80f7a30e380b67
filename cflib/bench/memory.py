"""Peak memory of training steps, measured, under an enforced budget.

CUDA: the caching allocator's own statistics. The budget is enforced with
`torch.cuda.set_per_process_memory_fraction`, so a step that needs more than
the budget raises a real `torch.OutOfMemoryError`. The peak that decides is
`max_memory_reserved`: the bytes the allocator took from the device (live
tensors plus the cached, fragmented blocks around them), which is what a
budget must hold; `max_memory_allocated` (live tensors alone) is kept beside it.

CPU: no allocator statistics exist, so `TensorMemory` counts the bytes of
live tensor storage op by op (a TorchDispatchMode; a storage counts from the
op that produced it until it is freed) and raises `torch.OutOfMemoryError`
when a cap is crossed, the way the CUDA allocator does at its budget. It
sees tensors, not kernel scratch space or Python objects: the figures prove
the tuner's plumbing on CPU, not a CPU's memory needs.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from typing import Callable, Iterable, Iterator, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorMemory(TorchDispatchMode):
    """Live tensor-storage bytes while active, their peak, and an optional cap."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, tuple[weakref.ref, int]] = {}

    def track(self, tensors: Iterable) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.device.type != "meta":
                self._track(tensor.untyped_storage())

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _track(self, storage: torch.UntypedStorage) -> None:
        # torch keeps one Python object per live storage, so its id names the storage until it dies.
        key, nbytes = id(storage), storage.nbytes()
        seen = self._storages.get(key)
        if seen is None:
            self._storages[key] = (weakref.ref(storage, functools.partial(self._release, key)), nbytes)
            self._grow(nbytes)
        elif seen[1] != nbytes:  # resized in place
            self._storages[key] = (seen[0], nbytes)
            self._grow(nbytes - seen[1])

    def _release(self, key: int, _ref: weakref.ref) -> None:
        self.live_bytes -= self._storages.pop(key)[1]

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(f"live tensor memory {self.live_bytes:,} bytes exceeds the budget cap "
                                         f"of {self.limit_bytes:,} bytes (CPU probe)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Inputs too: tensors made before the mode (parameters, the batch) count from their first use.
        self.track(_tensors_in((args, kwargs, out)))
        return out


def _tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors of an op's arguments and results (lists, tuples and dicts of them), without pytree's cost."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class PeakMemory:
    """Measure the peak bytes of a stretch of work on one device, under a cap.

    Usage: `with meter.capped(): ...warm-up...; meter.reset(); ...measured...; meter.peak()`.
    """

    def __init__(self, device: torch.device, cap_bytes: int) -> None:
        self.device, self.cap_bytes = device, cap_bytes
        self._tensors: TensorMemory | None = None

    @contextlib.contextmanager
    def capped(self, tensors: Iterable = ()) -> Iterator["PeakMemory"]:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(self.cap_bytes / total, 1.0), self.device)
            try:
                yield self
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        else:
            self._tensors = TensorMemory(self.cap_bytes)
            self._tensors.track(tensors)
            try:
                with self._tensors:
                    yield self
            finally:
                self._tensors = None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tensors.reset_peak()

    def peak(self) -> dict[str, int]:
        """`decides`: the bytes the budget must hold; CUDA adds reserved and allocated."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            return {"decides": reserved, "reserved": reserved,
                    "allocated": torch.cuda.max_memory_allocated(self.device)}
        return {"decides": self._tensors.peak_bytes, "tensors": self._tensors.peak_bytes}


Output = TypeVar("Output")


def saved_for_backward(module: torch.nn.Module, forward: Callable[[], Output]) -> tuple[int, Output]:
    """The bytes autograd keeps from `forward()` for its backward, less what `module`'s parameters already hold (a
    storage counted once however often it is saved), and forward's output."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    owned = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(size for ptr, size in saved.items() if ptr not in owned), out


def free_device_memory(device: torch.device) -> None:
    """Collect what a finished or failed probe left (cycles through tracebacks included) and empty the cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_name(device: torch.device) -> str:
    return ("torch.cuda.max_memory_reserved (caching allocator, budget enforced by "
            "set_per_process_memory_fraction)" if device.type == "cuda"
            else "live tensor storage bytes per op (cflib.bench.memory.TensorMemory, budget enforced as a cap)")
