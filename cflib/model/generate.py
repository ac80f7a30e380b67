"""Fast autoregressive decoding of a TRMoEModel: one prefill, then one token per row per step.

    tokens = generate(model, prompts, max_new_tokens=64, eos_token_id=0)            # greedy
    decoder = Decoder(model, autocast_dtype=torch.bfloat16)                           # keeps caches and graphs
    tokens = decoder.generate(prompts, 64, eos_token_id=0, temperature=0.7, top_p=0.9, seed=1)

Prompts of different lengths share a batch right-padded, each row at its own
positions (RoPE sees exactly the unpadded prompt) with its own stop: EOS or
its `max_new_tokens`. The model's own modules (and whichever fast kernels
cflib.model.fast.use_kernels chose) run every step through a static KV cache
(cflib.model.kv_cache). At the 200M size a decode step is hundreds of small
kernels (over a thousand on the reference modules), so the host's launch
time, not the GPU, bounds an eager loop; on CUDA each decode step is
therefore captured once as a CUDA graph and replayed (static inputs,
positions and outputs; the way gpt-fast and vLLM decode), optionally
compiled first (compile_step) to fuse the small kernels. The token choice
(greedy argmax, or temperature, top-k and top-p sampling) runs inside the
step; sampling draws exponential noise from a seeded torch.Generator outside
it (argmax of p / noise is a draw from p), so a seed repeats a run and the
graph and eager paths choose alike.

A Decoder holds the model's tensors by address: build a new one after moving,
casting or re-pointing the model at other kernels (cflib.model.fast.use_kernels).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from cflib.model.decoder import TRMoEModel
from cflib.model.kv_cache import KVCache

# Steps between checks that every row has stopped (each check waits for the device).
STOP_CHECK_EVERY = 8
MIN_CACHE_LENGTH = 64
# Shapes kept at once (each a cache and a graph); the least recently used goes first. Prompts sorted by
# length visit each cache length in turn, so a few suffice.
MAX_SLOTS = 4


class GenerationError(ValueError):
    """Decoding input that cannot run; the message names the prompt or setting at fault."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0 <= self.temperature < math.inf:  # NaN and inf would make every answer's scores NaN
            raise GenerationError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def choose(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """[B, V] logits -> [B] token ids, with static shapes throughout (no host sync)."""
        if self.greedy:
            return logits.argmax(-1)
        scores = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:  # the smallest set of most likely tokens holding top_p of the mass
            ranked, order = probs.sort(dim=-1, descending=True)
            ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked > self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, ranked)
        return (probs / noise).argmax(-1)  # noise ~ Exp(1): the index of the smallest noise / p is a draw from p


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def capture_graph(step: Callable[[], None], device: torch.device, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """`step` recorded as a CUDA graph after `warmups` runs on a side stream, where lazy initialisation, Triton
    autotuning and cuBLAS workspaces happen, never inside the capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


class _Slot:
    """The static state of one (batch, cache length, sampling) shape: cache, buffers and its CUDA graph."""

    def __init__(self, model: TRMoEModel, batch: int, length: int, sampling: Sampling, dtype: torch.dtype,
                 compile_backend: str | None = None) -> None:
        device = model.embed_tokens.weight.device
        self.model, self.sampling, self.batch, self.length = model, sampling, batch, length
        self.cache = KVCache(model.config, batch, length, device, dtype)
        long = dict(device=device, dtype=torch.long)
        self.tokens = torch.zeros(batch, 1, **long)  # fed at the next step
        self.positions = torch.zeros(batch, 1, **long)  # of those tokens
        self.generated = torch.zeros(batch, length, **long)  # column i: each row's i-th new token
        self.counts = torch.zeros(batch, **long)  # new tokens per row so far
        self.budgets = torch.zeros(batch, **long)
        self.step = torch.zeros(1, **long)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos = torch.zeros(1, **long)  # -1: no EOS stop
        self.pad = torch.zeros(1, **long)
        self.noise = None if sampling.greedy else torch.ones(batch, model.config.vocab_size, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # Compiled once per slot (its shapes are static); the warm-up steps before a capture compile it.
        self.advance = self.decode_step if compile_backend is None else torch.compile(
            self.decode_step, backend=compile_backend, dynamic=False)

    def choose(self, hidden: torch.Tensor) -> None:
        """Pick each row's next token from its last hidden state [B, D] and do the bookkeeping."""
        logits = hidden @ self.model.head_weight.t().to(hidden.dtype)
        token = torch.where(self.finished, self.pad, self.sampling.choose(logits, self.noise))
        self.generated.scatter_(1, self.step.view(1, 1).expand(self.batch, 1), token[:, None])
        self.counts += (~self.finished).long()
        self.finished |= (token == self.eos) | (self.counts >= self.budgets)
        self.tokens.copy_(token[:, None])
        self.step += 1

    def decode_step(self) -> None:
        """One token per row through the model and the cache: what the CUDA graph replays."""
        self.cache.decode_at(self.positions)
        hidden = self.model(self.tokens, kv=self.cache)[:, -1]
        # A finished row steps on with the others; held at the last slot, it writes only its own row there.
        self.positions.add_(1).clamp_(max=self.length - 1)
        self.choose(hidden)

    def capture(self) -> None:
        """Record decode_step as a CUDA graph, after warm-up steps on a side stream (lazy initialisation,
        Triton autotuning and cuBLAS workspaces happen there, never inside the capture)."""
        self.positions.zero_()
        self.step.zero_()
        self.budgets.fill_(self.length)
        self.finished.zero_()
        self.graph = capture_graph(self.advance, self.positions.device)

    def run(self, prompts: list[list[int]], budgets: list[int], eos_token_id: int | None,
            generator: torch.Generator | None, stream: Callable[[int, int], None] | None) -> list[list[int]]:
        """Decode up to `batch` prompts (missing rows are idle fillers); each row's new tokens."""
        device, rows = self.tokens.device, len(prompts)
        pad = 0 if eos_token_id is None else eos_token_id
        width = max(len(p) for p in prompts)
        filled = [p + [pad] * (width - len(p)) for p in prompts] + [[pad] * width] * (self.batch - rows)
        lengths = torch.tensor([len(p) for p in prompts] + [1] * (self.batch - rows), device=device)
        self.budgets.copy_(torch.tensor(budgets + [0] * (self.batch - rows)))
        self.finished.copy_(self.budgets <= 0)
        self.counts.zero_()
        self.step.zero_()
        self.eos.fill_(-1 if eos_token_id is None else eos_token_id)
        self.pad.fill_(pad)
        self.cache.decode_at(None)
        hidden = self.model(torch.tensor(filled, device=device), kv=self.cache)
        self.positions.copy_(lengths[:, None])
        self._draw(generator)
        self.choose(hidden[torch.arange(self.batch, device=device), lengths - 1])
        emitted = [0] * rows
        self._stream(stream, 0, emitted)
        for index in range(1, max(budgets)):
            self._draw(generator)
            if self.graph is not None:
                self.graph.replay()
            else:
                self.advance()
            if stream is not None:
                self._stream(stream, index, emitted)
            elif index % STOP_CHECK_EVERY == 0 and bool(self.finished.all()):
                break
        counts = self.counts[:rows].tolist()
        generated = self.generated[:rows, :max(counts)].tolist()
        return [row[:count] for row, count in zip(generated, counts)]

    def _draw(self, generator: torch.Generator | None) -> None:
        if self.noise is not None:
            self.noise.exponential_(generator=generator)

    def _stream(self, stream: Callable[[int, int], None] | None, index: int, emitted: list[int]) -> None:
        """Hand each row's new token (if it made one at this step) to `stream(row, token)`."""
        if stream is None:
            return
        counts, column = self.counts[:len(emitted)].tolist(), self.generated[:len(emitted), index].tolist()
        for row, (count, token) in enumerate(zip(counts, column)):
            if count > emitted[row]:
                emitted[row] = count
                stream(row, token)


class Decoder:
    """Decodes batches of prompts with a model; keeps its caches and CUDA graphs between calls.

    autocast_dtype: run under autocast (e.g. torch.bfloat16), as training evaluates; None: the
    model's own dtype. cuda_graph: None replays each decode step as a CUDA graph wherever the
    model is on a CUDA device and not sharded (falling back to eager, with a warning, if the
    capture fails); True requires it; False runs eagerly. compile_step: torch.compile the decode step
    (True: inductor, or a backend's name) before capturing it, which fuses the reference modules'
    elementwise chains into fewer kernels; each new (batch, cache length) shape compiles again.
    """

    def __init__(self, model: TRMoEModel, *, max_batch: int = 64, autocast_dtype: torch.dtype | None = None,
                 cuda_graph: bool | None = None, compile_step: bool | str = False) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise GenerationError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.model, self.max_batch, self.autocast_dtype = model, max_batch, autocast_dtype
        self.compile_backend = None if not compile_step else "inductor" if compile_step is True else compile_step
        self.device = model.embed_tokens.weight.device
        sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
        if cuda_graph and (self.device.type != "cuda" or sharded):
            raise GenerationError(f"cuda_graph=True needs an unsharded model on a CUDA device (it is on "
                                  f"{self.device}{', sharded' if sharded else ''})")
        self.cuda_graph = self.device.type == "cuda" and not sharded if cuda_graph is None else cuda_graph
        self._graph_required = bool(cuda_graph)
        self.graph_failure: str | None = None
        self._slots: OrderedDict[tuple, _Slot] = OrderedDict()
        self.graphs_captured = 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.model.embed_tokens.weight.dtype

    def path(self) -> dict:
        """How this decoder ran: CUDA graphs or eager, the shapes it holds, and the model's kernels read back."""
        return {"cuda_graph": self.cuda_graph and self.graph_failure is None, "graph_failure": self.graph_failure,
                "compiled": self.compile_backend or False,
                "graphs_captured": self.graphs_captured,
                "shapes_held": [f"batch {b} x length {n} ({'greedy' if s.greedy else 'sampling'})"
                                for b, n, s in self._slots],
                "kv_cache_bytes": sum(slot.cache.nbytes() for slot in self._slots.values()),
                "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "kernel_path": self.model.kernel_path()}

    def release(self) -> None:
        """Free every cache and graph (a later call builds them again)."""
        self._slots.clear()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int | Sequence[int],
                 eos_token_id: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stream: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Each prompt's new tokens (with the EOS that stopped it, if one did), in the prompts' order.

        max_new_tokens: one budget for all, or one per prompt. stream(prompt_index, token) is called
        for every new token as it is made (one device read per step: slower). All input is checked
        before anything runs."""
        rows = self._check_prompts(prompts)
        budgets = self._check_budgets(max_new_tokens, rows)
        config = self.model.config
        if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < config.vocab_size):
            raise GenerationError(f"eos_token_id {eos_token_id!r} is not a token id below vocab_size "
                                  f"{config.vocab_size} (None: no EOS stop)")
        sampling = Sampling(temperature, top_p, top_k)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a batch
        results: list[list[int]] = [[] for _ in rows]
        with self._running():
            for start in range(0, len(order), self.max_batch):
                chunk = order[start:start + self.max_batch]
                needed = max(len(rows[i]) + budgets[i] for i in chunk)
                length = min(_next_power_of_two(max(needed, MIN_CACHE_LENGTH)), config.max_position_embeddings)
                slot = self._slot(min(_next_power_of_two(len(chunk)), self.max_batch), length, sampling)
                tell = None if stream is None else (lambda row, token, chunk=chunk: stream(chunk[row], token))
                answers = slot.run([rows[i] for i in chunk], [budgets[i] for i in chunk], eos_token_id,
                                   generator, tell)
                for index, answer in zip(chunk, answers):
                    results[index] = answer
        return results

    @contextlib.contextmanager
    def _running(self):
        was_training = self.model.training
        self.model.eval()
        # No autocast weight cache: casts made while capturing would live in the graph's memory.
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        try:
            with autocast:
                yield
        finally:
            self.model.train(was_training)

    def _slot(self, batch: int, length: int, sampling: Sampling) -> _Slot:
        key = (batch, length, sampling)
        if key in self._slots:
            self._slots.move_to_end(key)
        else:
            while len(self._slots) >= MAX_SLOTS:
                self._slots.popitem(last=False)
            slot = _Slot(self.model, batch, length, sampling, self.compute_dtype, self.compile_backend)
            if self.cuda_graph and self.graph_failure is None:
                try:
                    slot.capture()
                except RuntimeError as err:
                    if self._graph_required:
                        raise GenerationError(f"capturing the decode step as a CUDA graph failed: {err}") from err
                    self.graph_failure = f"{type(err).__name__}: {err}"
                    warnings.warn(f"decoding eagerly: the CUDA graph capture failed ({self.graph_failure})",
                                  stacklevel=3)
                    slot.graph = None
                self.graphs_captured += slot.graph is not None
            self._slots[key] = slot
        return self._slots[key]

    def _check_prompts(self, prompts: Sequence[Sequence[int] | torch.Tensor]) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or not prompts:
            raise GenerationError("prompts must be a non-empty list of token-id lists or 1-D tensors")
        vocab = self.model.config.vocab_size
        rows = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, torch.Tensor):
                if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                    raise GenerationError(f"prompt {index}: a 1-D integer tensor, got {prompt.dtype} "
                                          f"{list(prompt.shape)}")
                prompt = prompt.tolist()
            prompt = list(prompt)
            if not prompt:
                raise GenerationError(f"prompt {index} is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise GenerationError(f"prompt {index}: token ids must be integers")
            if min(prompt) < 0 or max(prompt) >= vocab:
                bad = next(t for t in prompt if not 0 <= t < vocab)
                raise GenerationError(f"prompt {index}: token id {bad} is outside the model's vocabulary "
                                      f"[0, {vocab})")
            rows.append(prompt)
        return rows

    def _check_budgets(self, max_new_tokens: int | Sequence[int], rows: list[list[int]]) -> list[int]:
        budgets = [max_new_tokens] * len(rows) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(rows):
            raise GenerationError(f"max_new_tokens: {len(budgets)} budgets for {len(rows)} prompts")
        limit = self.model.config.max_position_embeddings
        for index, (prompt, budget) in enumerate(zip(rows, budgets)):
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise GenerationError(f"max_new_tokens must be a positive integer, got {budget!r}"
                                      + (f" for prompt {index}" if not isinstance(max_new_tokens, int) else ""))
            if len(prompt) + budget > limit:
                raise GenerationError(f"prompt {index}: {len(prompt)} tokens + max_new_tokens {budget} = "
                                      f"{len(prompt) + budget} exceeds the model's max_position_embeddings "
                                      f"{limit}")
        return budgets


def generate(model: TRMoEModel, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int | Sequence[int],
             eos_token_id: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, stream: Callable[[int, int], None] | None = None, *, max_batch: int = 64,
             autocast_dtype: torch.dtype | None = None, cuda_graph: bool | None = None,
             compile_step: bool | str = False) -> list[list[int]]:
    """One call's worth of Decoder(model, ...).generate(...): each prompt's new tokens."""
    decoder = Decoder(model, max_batch=max_batch, autocast_dtype=autocast_dtype, cuda_graph=cuda_graph,
                      compile_step=compile_step)
    return decoder.generate(prompts, max_new_tokens, eos_token_id, temperature, top_p, top_k, seed, stream)
