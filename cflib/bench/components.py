"""The kernel components validate_kernels checks.

For each: random inputs at a shape, the float64 truth and the fast path as training runs it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cflib.data.shards import IGNORE_INDEX
from cflib.model.config import ModelConfig, preset
from cflib.model.decoder import RMSNorm, TRMoEEngine, apply_rope, kernels_of, rope_cos_sin
from cflib.model.fast import AddRMSNorm, EpilogueSwiGLUEngine, FusedTRMoEEngine, LigerRMSNorm
from cflib.model.rope import rope_inv_freq
from cflib.ops.attention import BACKENDS, attend, attention_batch, backend_problem, pack_documents
from cflib.ops.dispatch import KernelChoice, quack_problem
from cflib.ops.sft_loss import DFTLoss, SFTLoss

# bf16 operands land between 1e-3 and 1e-2 against a float64 truth; fp32 far under 1e-3
# (docs/formats.md#numerical-tolerances).
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
    unavailable: Callable[[torch.device, str, Shape], str | None] | None = None  # why not here (device, dtype)


def _randn(shape, generator, device, scale=1.0, shift=0.0):
    return torch.randn(shape, generator=generator, device=device) * scale + shift


def _rms_inputs(shape, gen, device):
    return {"x": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "weight": _randn((shape.config.hidden_size,), gen, device, 0.1, 1.0)}


def _rms_module(inputs: dict, cls: type[RMSNorm] = RMSNorm) -> RMSNorm:
    norm = cls(inputs["weight"].shape[0], 1e-6).to(inputs["weight"].device)  # the preset's norm_eps
    norm.weight = inputs["weight"]
    return norm


def _rms_fast(inputs):
    norm = _rms_module(inputs, LigerRMSNorm)
    return norm(inputs["x"]), kernels_of(norm)["rmsnorm"]


def _add_norm_inputs(shape, gen, device):
    return {"h": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "delta": _randn((shape.batch * shape.seq_len, shape.config.hidden_size), gen, device),
            "weight": _randn((shape.config.hidden_size,), gen, device, 0.1, 1.0)}


def _add_norm_reference(inputs):
    total = inputs["h"] + inputs["delta"]
    return torch.cat([total.flatten(), _rms_module(inputs)(total).flatten().to(total.dtype)])


def _add_norm_fast(inputs):
    norm = _rms_module(inputs, AddRMSNorm)
    total, normed = norm.add_norm(inputs["h"], inputs["delta"])
    return torch.cat([total.flatten(), normed.flatten().to(total.dtype)]), kernels_of(norm)["rmsnorm"]


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
    from cflib.ops.liger import LigerRopeFunction
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
    q = apply_rope(_rms_module({"weight": inputs["q_weight"]})(q), cos, sin)
    k = apply_rope(_rms_module({"weight": inputs["k_weight"]})(k), cos, sin)
    return torch.cat([q.flatten(), k.flatten(), v.flatten()])


def _qk_fast(inputs):
    from cflib.ops.qk_norm_rope import qkv_norm_rope
    shape, c = inputs["shape"], inputs["shape"].config
    cos, sin = rope_cos_sin(rope_inv_freq(c.head_dim, c.rope_theta), shape.seq_len, inputs["qkv"].device)
    q, k, v = qkv_norm_rope(inputs["qkv"], inputs["q_weight"], inputs["k_weight"], cos, sin, shape.batch,
                            shape.seq_len, c.num_attention_heads, c.num_key_value_heads, 1e-6,
                            normed_from_output=True)  # as the decoder runs it (cflib.model.fast.FusedAttention)
    return torch.cat([q.flatten(), k.flatten(), v.flatten()]), "cflib_qk_norm_rope"


def _swiglu_inputs(shape, gen, device):
    width = shape.config.shared_intermediate_size
    return {"gate": _randn((shape.batch * shape.seq_len, width), gen, device),
            "up": _randn((shape.batch * shape.seq_len, width), gen, device)}


def _swiglu_fast(inputs):
    from cflib.ops.liger import LigerSiLUMulFunction
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


def _engine(inputs: dict, cls: type[TRMoEEngine] = TRMoEEngine, keep_activation: bool = False) -> TRMoEEngine:
    engine = cls(inputs["config"], build_routes=False).to(inputs["x"].device)
    engine.keep_activation = keep_activation
    for name in ENGINE_WEIGHTS:
        module_name, _, attr = name.rpartition(".")
        owner = engine.get_submodule(module_name) if module_name else engine
        setattr(owner, attr, inputs[name])
    engine.route_table.copy_(inputs["route_table"])
    return engine


def _moe_reference(inputs):
    return _engine(inputs)(inputs["x"], inputs["token_ids"])


def _moe_fast(cls: type[FusedTRMoEEngine], kernel: str, keep_activation: bool):
    """The block as training runs it, the activation kept from forward to backward or recomputed there; the
    backend read back names the activation's handling when it is kept."""
    def fast(inputs):
        engine = _engine(inputs, cls, keep_activation)
        out = engine(inputs["x"], inputs["token_ids"])
        ran = kernels_of(engine)
        return out, f"{ran[kernel]}, activation {ran['swiglu_activation']}" if keep_activation else ran[kernel]
    return fast


def _epilogue_unavailable(device: torch.device, dtype_name: str, shape: Shape) -> str | None:
    if problem := quack_problem(device):
        return problem
    return None if dtype_name == "bfloat16" else "quack's SwiGLU GEMMs write 16-bit outputs: checked in bfloat16"


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


def _loss_reference(inputs, dft: bool = False):
    # Full logits, no chunking: independent of every chunked path. DFT as TRL writes it: -log p times p detached.
    logits = inputs["hidden"] @ inputs["head_weight"].t()
    losses = F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, inputs["labels"],
                             ignore_index=IGNORE_INDEX, reduction="none")
    if dft:
        losses = losses * torch.exp(-losses).detach()
    weights = inputs.get("token_weights")
    return (losses * weights if weights is not None else losses).sum()


def _loss_fast(kernels: KernelChoice, cls: type[SFTLoss] = SFTLoss):
    def run(inputs):
        loss = cls(kernels)
        out, _ = loss(inputs["hidden"], inputs["head_weight"], inputs["labels"], 1024, False,
                      token_weights=inputs.get("token_weights"))
        return out, loss.last_backend
    return run


def _attention_inputs(packed: bool):
    def inputs(shape, gen, device):
        c = shape.config
        found = {name: _randn((shape.batch, heads, shape.seq_len, c.head_dim), gen, device)
                 for name, heads in (("q", c.num_attention_heads), ("k", c.num_key_value_heads),
                                     ("v", c.num_key_value_heads))}
        if packed:  # each row cut into documents at random places: a few at tiny shapes, one per ~300 tokens
            cuts = max(2, shape.seq_len // 300)
            ids = torch.zeros(shape.batch, shape.seq_len, dtype=torch.int64)
            for row in range(shape.batch):
                starts = torch.randperm(shape.seq_len - 1, generator=torch.Generator().manual_seed(row))[:cuts] + 1
                ids[row, starts] = 1
            found["documents"] = pack_documents(ids.cumsum(1)).moved(lambda t: t.to(device))
        return found
    return inputs


def _attention_reference(inputs):
    """Causal SDPA of each row, or, packed, of each document alone: the outputs side by side."""
    q, k, v, documents = inputs["q"], inputs["k"], inputs["v"], inputs.get("documents")
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    seq, pieces = q.shape[2], []
    bounds = documents.cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        row, first = divmod(start, seq)
        part = slice(first, first + stop - start)
        pieces.append(F.scaled_dot_product_attention(q[row:row + 1, :, part], k[row:row + 1, :, part],
                                                     v[row:row + 1, :, part], is_causal=True, enable_gqa=True))
    return torch.cat(pieces, dim=2).transpose(1, 2).reshape(q.shape[0], seq, *q.shape[1:2], -1).transpose(1, 2)


def _attention_fast(backend: str):
    def run(inputs):
        q = inputs["q"]
        batch = attention_batch(backend, q.device, q.dtype, q.shape[-1], inputs.get("documents"))
        return attend(q, inputs["k"], inputs["v"], batch), batch.kernel
    return run


def _attention_unavailable(backend: str, packed: bool):
    def why(device: torch.device, dtype_name: str, shape: Shape) -> str | None:
        problem = backend_problem(backend, device, shape.config.head_dim, packed=packed)
        kernel = BACKENDS[backend].packed if packed else BACKENDS[backend].dense
        if problem is None and kernel.half_only and dtype_name != "bfloat16":
            return f"{BACKENDS[backend].what} computes in bfloat16/float16: checked in bfloat16"
        return problem
    return why


def _attention(name: str, backend: str, kernel: str, packed: bool) -> Component:
    return Component(name, kernel, _attention_inputs(packed), (), _attention_reference, _attention_fast(backend),
                     unavailable=_attention_unavailable(backend, packed))


def _attention_components() -> list[Component]:
    """A component for every attention kernel a backend names for validation (cflib.ops.attention.BACKENDS)."""
    return [_attention(kernel.component, backend.name, kernel.name, packed) for backend in BACKENDS.values()
            for packed, kernel in ((False, backend.dense), (True, backend.packed)) if kernel and kernel.component]


COMPONENTS = [
    Component("rmsnorm", "liger", _rms_inputs, ("weight",), lambda i: _rms_module(i)(i["x"]), _rms_fast),
    # h is the fp32 residual stream in every run, like a weight: listed with them.
    Component("add_rmsnorm", "cflib_add_rmsnorm", _add_norm_inputs, ("h", "weight"), _add_norm_reference,
              _add_norm_fast),
    Component("qk_norm_rope", "cflib_qk_norm_rope", _qk_inputs, ("q_weight", "k_weight"), _qk_reference, _qk_fast),
    Component("rope", "liger", _rope_inputs, (), _rope_reference, _rope_fast),
    Component("swiglu", "liger", _swiglu_inputs, (), lambda i: F.silu(i["gate"]) * i["up"], _swiglu_fast,
              bf16_arithmetic=True),
    Component("trmoe", "triton_fused", _moe_inputs, ENGINE_WEIGHTS, _moe_reference,
              _moe_fast(FusedTRMoEEngine, "moe", False)),
    Component("trmoe_kept_activation", "triton_fused, activation kept", _moe_inputs, ENGINE_WEIGHTS,
              _moe_reference, _moe_fast(FusedTRMoEEngine, "moe", True)),
    Component("trmoe_epilogue_swiglu", "quack_gemm_swiglu", _moe_inputs, ENGINE_WEIGHTS, _moe_reference,
              _moe_fast(EpilogueSwiGLUEngine, "swiglu", False), unavailable=_epilogue_unavailable),
    # The default training step's block: quack's SwiGLU GEMMs with the activation kept for backward.
    Component("trmoe_epilogue_swiglu_kept_activation", "quack_gemm_swiglu, activation kept", _moe_inputs,
              ENGINE_WEIGHTS, _moe_reference, _moe_fast(EpilogueSwiGLUEngine, "swiglu", True),
              unavailable=_epilogue_unavailable),
    Component("loss", "liger_fused_linear_ce", lambda s, g, d: _loss_inputs(s, g, d, False), ("head_weight",),
              _loss_reference, _loss_fast(KernelChoice(liger=True, custom=False))),
    Component("weighted_loss", "cflib_triton_fused_linear_ce_weighted", lambda s, g, d: _loss_inputs(s, g, d, True),
              ("head_weight",), _loss_reference, _loss_fast(KernelChoice(liger=False, custom=True))),
    # The production unweighted loss (cflib.ops.sft_loss.SFTLoss: cflib's kernels take it from Liger's).
    Component("cflib_loss", "cflib_triton_fused_linear_ce", lambda s, g, d: _loss_inputs(s, g, d, False),
              ("head_weight",), _loss_reference, _loss_fast(KernelChoice(liger=True, custom=True))),
    # loss_type dft (cflib.ops.sft_loss.DFTLoss) on cflib's kernel, unweighted and under 2-D weighting.
    Component("dft_loss", "cflib_triton_fused_linear_dft", lambda s, g, d: _loss_inputs(s, g, d, False),
              ("head_weight",), lambda i: _loss_reference(i, dft=True),
              _loss_fast(KernelChoice(liger=True, custom=True), DFTLoss)),
    Component("weighted_dft_loss", "cflib_triton_fused_linear_dft_weighted",
              lambda s, g, d: _loss_inputs(s, g, d, True), ("head_weight",), lambda i: _loss_reference(i, dft=True),
              _loss_fast(KernelChoice(liger=True, custom=True), DFTLoss)),
    *_attention_components(),
]


def components() -> list[Component]:
    """COMPONENTS, and the kernels of any attention backend registered since this module was imported."""
    known = {c.name for c in COMPONENTS}
    return COMPONENTS + [c for c in _attention_components() if c.name not in known]
