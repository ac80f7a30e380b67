"""The training micro-step replayed from CUDA graphs: the host launches one graph instead of ~2,000 kernels.

The eager step's host work (Python, autograd, FlashAttention-4's launch path) is about as long as its GPU work
at the 200M size, so the GPU waits wherever the host falls behind (on one H200, graphs give 1-3% more tokens/s
at micro-batch 16 and nothing at 48, where kernels are long enough to hide the host). A CUDA graph records the
forward, the loss and the backward of one micro-batch once per static shape and replays them: the batch is
copied into fixed buffers, and the gradients land in the tensors the capture allocated, which each parameter's
`.grad` points to again after a replay. The optimizer step stays eager (a few fused kernels).

Shapes are made static by padding, which changes no value:
- dense rows to a multiple of SEQ_MULTIPLE tokens (pads after every real token, unseen under the causal mask,
  unsupervised);
- the supervised positions to a multiple of SUPERVISED_ROWS: padding rows repeat a supervised position, masked
  to weight 0, adding nothing to the loss or to any gradient;
- a packed batch's document table (cu_seqlens) to a multiple of DOCUMENTS, with empty documents at its end.
A shape runs eagerly the first time (its kernels are chosen and compiled), is captured the second, and is
replayed from then on; every shape's graphs share one memory pool.

It runs where every kernel of the step can be captured and nothing reads the device back mid-step: one CUDA
process, the built-in SFT loss on cflib's fused kernel, an attention kernel that takes its documents from
tensors, no activation checkpointing. Elsewhere the step runs eagerly; `why_eager` says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cflib.ops.attention import PackedDocuments
from cflib.train.batch import MicroBatch

SEQ_MULTIPLE = 256
SUPERVISED_ROWS = 512
DOCUMENTS = 64
MAX_SHAPES = 8  # shapes beyond these run eagerly: each costs a capture and grows the pool a little


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


@dataclass(frozen=True)
class StaticShape:
    rows: int
    seq: int
    supervised: int  # padded count of supervised positions
    documents: int | None  # padded document count of a packed batch
    weighted: bool


def static_shape(batch: MicroBatch, seq_len: int) -> StaticShape | None:
    """The padded shape a host micro-batch is replayed at; None: nothing to capture (no supervised position)."""
    supervised = int(batch.supervised.numel())
    if supervised == 0:
        return None
    rows, seq = batch.input_ids.shape
    documents = None
    if batch.documents is not None:  # packed windows are seq_len long already
        documents = _round_up(batch.documents.cu_seqlens.numel() - 1, DOCUMENTS)
    else:
        seq = min(_round_up(seq, SEQ_MULTIPLE), max(seq_len, seq))
    return StaticShape(rows, seq, _round_up(supervised, SUPERVISED_ROWS), documents,
                       batch.token_weights is not None)


def padded(batch: MicroBatch, shape: StaticShape, pad_token_id: int) -> MicroBatch:
    """The host batch at its static shape, with the same loss and gradients (see the module docstring)."""
    seq = batch.input_ids.shape[1]
    input_ids, labels, token_weights = batch.input_ids, batch.labels, batch.token_weights
    lengths = batch.example_lengths
    if shape.seq > seq:
        extra = (0, shape.seq - seq)
        input_ids = torch.nn.functional.pad(input_ids, extra, value=pad_token_id)
        labels = torch.nn.functional.pad(labels, extra, value=-100)
        token_weights = None if token_weights is None else torch.nn.functional.pad(token_weights, extra)
        # NEFTune's L is each example's own count: the pads get one too (their noise reaches no real token)
        lengths = None if lengths is None else torch.nn.functional.pad(lengths, extra, value=shape.seq)
    # Positions are flat indices into [B, T]: re-based on the padded row length.
    supervised = batch.supervised // seq * shape.seq + batch.supervised % seq
    fill = shape.supervised - supervised.numel()
    supervised = torch.cat([supervised, supervised[:1].expand(fill)])
    row_mask = torch.cat([torch.ones(batch.supervised.numel()), torch.zeros(fill)])
    documents = batch.documents
    if documents is not None:
        cu = documents.cu_seqlens
        tail = cu.new_full((shape.documents + 1 - cu.numel(),), int(cu[-1]))
        documents = PackedDocuments(documents.document_ids, documents.positions, torch.cat([cu, tail]), seq)
    return MicroBatch(input_ids, labels, documents, token_weights, supervised, row_mask, lengths)


class _Buffers:
    """The device tensors one static shape's graphs read: filled from each host batch before a replay."""

    def __init__(self, like: MicroBatch, device: torch.device) -> None:
        def empty(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(t, device=device)

        documents = like.documents
        if documents is not None:
            documents = PackedDocuments(empty(documents.document_ids), empty(documents.positions),
                                        empty(documents.cu_seqlens), documents.max_seqlen)
        self.batch = MicroBatch(empty(like.input_ids), empty(like.labels), documents,
                                None if like.token_weights is None else empty(like.token_weights),
                                empty(like.supervised), empty(like.row_mask),
                                None if like.example_lengths is None else empty(like.example_lengths))

    def fill(self, host: MicroBatch) -> MicroBatch:
        pairs = [(self.batch.input_ids, host.input_ids), (self.batch.labels, host.labels),
                 (self.batch.supervised, host.supervised), (self.batch.row_mask, host.row_mask)]
        if host.token_weights is not None:
            pairs.append((self.batch.token_weights, host.token_weights))
        if host.example_lengths is not None:
            pairs.append((self.batch.example_lengths, host.example_lengths))
        if host.documents is not None:
            mine, theirs = self.batch.documents, host.documents
            pairs += [(mine.document_ids, theirs.document_ids), (mine.positions, theirs.positions),
                      (mine.cu_seqlens, theirs.cu_seqlens)]
        for target, source in pairs:
            target.copy_(source.pin_memory(), non_blocking=True)
        return self.batch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    loss_sum: torch.Tensor  # the replay's summed loss, overwritten by the next replay
    grads: list[torch.Tensor | None] | None  # a first micro-batch's graph: the gradients it writes


class GraphedMicroSteps:
    """forward_backward(batch, scale, capturing) -> summed loss, run eagerly or replayed from a CUDA graph.

    The first micro-batch of a step writes the gradients (its graph was captured with every .grad unset); the
    others add to them (captured with .grad bound to the first's tensors)."""

    def __init__(self, forward_backward: Callable[[MicroBatch, torch.Tensor, bool], torch.Tensor],
                 parameters: list[torch.nn.Parameter], device: torch.device, seq_len: int, pad_token_id: int,
                 generators: tuple[torch.Generator, ...] = ()) -> None:
        self.forward_backward, self.device = forward_backward, device
        # Generators of the step's own besides the default one (NEFTune's): registered with every capture, so that
        # each replay draws from them afresh and advances them as an eager step would.
        self.generators = generators
        self.parameters = [p for p in parameters if p.requires_grad]
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, _Graph] = {}
        self.buffers: dict[StaticShape, _Buffers] = {}
        self.first_shape: StaticShape | None = None
        self.first_replayed = False  # this step's first micro-batch ran from its graph
        self.counts = {"replayed": 0, "eager": 0, "captured": 0}
        self.failure: str | None = None

    def summary(self) -> dict:
        return {"cuda_graphs": True, **self.counts, "shapes": len(self.buffers), "capture_failure": self.failure}

    def stage(self, host: MicroBatch) -> MicroBatch:
        """The host batch as a replay copies it in, padded to its static shape and pinned, built ahead of its
        step; as it is where it has no static shape."""
        shape = static_shape(host, self.seq_len) if self.failure is None and host.row_mask is None else None
        return host if shape is None else padded(host, shape, self.pad_token_id).pinned()

    def __call__(self, host: MicroBatch, scale: float, accumulate: bool) -> torch.Tensor:
        """host: a collated micro-batch, or one `stage` padded already (its row_mask set)."""
        shape = static_shape(host, self.seq_len) if self.failure is None else None
        if not accumulate:
            self.first_shape, self.first_replayed = shape, False
        key = (shape, self.first_shape if accumulate else None)
        # A later micro-batch's graph adds into the gradients of its step's first graph: only after a replay of it.
        if shape is None or (accumulate and not self.first_replayed) or (
                shape not in self.buffers and len(self.buffers) >= MAX_SHAPES):
            return self._eager(host.to(self.device), scale)
        batch = host if host.row_mask is not None else padded(host, shape, self.pad_token_id)
        if key in self.graphs:
            return self._replay(self.graphs[key], shape, batch, scale)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:  # the shape's kernels are chosen and compiled eagerly, off the capture
            return self._eager(batch.to(self.device), scale, side_stream=True)
        try:
            graph = self._capture(shape, batch, accumulate)
        except Exception as err:  # noqa: BLE001 - an uncapturable step trains eagerly, and the record says why
            self.failure = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            if not accumulate:
                for parameter in self.parameters:
                    parameter.grad = None  # assigned by the aborted capture, never computed
            return self._eager(host.to(self.device), scale)
        self.graphs[key] = graph
        return self._replay(graph, shape, batch, scale)

    def _eager(self, batch: MicroBatch, scale: float, side_stream: bool = False) -> torch.Tensor:
        self.counts["eager"] += 1
        self.scale.fill_(scale)
        if not side_stream:
            return self.forward_backward(batch, self.scale, False)
        # On the stream the capture will use, so its libraries' per-stream state (cuBLAS workspaces) exists.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            loss_sum = self.forward_backward(batch, self.scale, False)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return loss_sum

    def _capture(self, shape: StaticShape, batch: MicroBatch, accumulate: bool) -> _Graph:
        if shape not in self.buffers:
            self.buffers[shape] = _Buffers(batch, self.device)
        static = self.buffers[shape].batch
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            loss_sum = self.forward_backward(static, self.scale, True)
        self.pool = graph.pool()
        self.counts["captured"] += 1
        grads = None if accumulate else [p.grad for p in self.parameters]
        return _Graph(graph, loss_sum, grads)

    def _replay(self, graph: _Graph, shape: StaticShape, batch: MicroBatch, scale: float) -> torch.Tensor:
        self.buffers[shape].fill(batch)
        self.scale.fill_(scale)
        graph.graph.replay()
        if graph.grads is not None:
            for parameter, grad in zip(self.parameters, graph.grads):
                parameter.grad = grad
            self.first_replayed = True
        self.counts["replayed"] += 1
        return graph.loss_sum


def why_eager(device: torch.device, strategy: str, grad_ckpt: bool, fused_loss: bool,
              attention_capturable: bool) -> str | None:
    """Why a run's micro-steps cannot be replayed from CUDA graphs, or None."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if strategy != "single":
        return f"strategy {strategy}: the gradients' collectives run from the host"
    if grad_ckpt:
        return "grad_ckpt: activation checkpointing saves and restores the RNG from the host"
    if not fused_loss:
        return "the loss is not the built-in SFT cross-entropy on cflib's fused kernel (use_custom_kernels)"
    if not attention_capturable:
        return "the attention kernel builds its mask or reads lengths on the host"
    return None

