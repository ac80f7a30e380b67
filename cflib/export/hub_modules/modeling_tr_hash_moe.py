"""The TR-MoE decoder (model_type "tr_hash_moe") for Hugging Face transformers.

Self-contained: loaded by `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)` from an exported bundle, it imports torch and
transformers only. Tensor names are the checkpoint's own (`embed_tokens`,
`layers.i.*`, `norm`, no `lm_head`: the head is the input embedding), so the
bundle's `model.safetensors` loads with no key renamed, missing or unexpected.

The block: h += attn(rmsnorm(h)); h += mlp(rmsnorm(h), token_ids). Attention
is GQA with an RMSNorm on each query and key head before rotate-half RoPE
(plain, or scaled as the config's rope_scaling says: linear, yarn or llama3).
The MLP (TR-MoE) is shared_output_scale * shared SwiGLU(x) + routed_output_scale
* sum_k w_k * expert[route_table[k, token]](x): routing is a fixed per-layer
table of token ids, so every forward needs input_ids (not inputs_embeds).

As a transformers model it takes transformers' caches (DynamicCache,
StaticCache: `generate(cache_implementation="static")` and torch.compile with
fullgraph), the attention implementation transformers selects (`sdpa`, here
with GQA and never a repeated KV head; `eager`; `flash_attention_*` through
transformers' attention interface), padding-free
packed rows (position_ids restarting per example: each example attends only
to itself), gradient checkpointing, and the loss of `labels` through
transformers' causal-LM loss (`num_items_in_batch` honoured, so gradient
accumulation gives the loss of the whole batch).
"""
from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_tr_hash_moe import TRHashConfig

# Newer transformers name the output's cache field `cache`, older ones `past_key_values`.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_HASH_MULTIPLIERS = (2654435761, 2246822519, 3266489917, 668265263, 374761393)
# create_causal_mask took the cache as `past_key_values` before `cache`: passed by the name this version reads.
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


# --- route tables and their derived buffers --------------------------------------------------
def _permuting_hash(token_ids: torch.Tensor, vocab_size: int, salt: int) -> torch.Tensor:
    """a * t + b mod V with gcd(a, V) = 1: a permutation of the vocabulary."""
    multiplier = _HASH_MULTIPLIERS[salt % len(_HASH_MULTIPLIERS)] % vocab_size or 1
    while math.gcd(multiplier, vocab_size) != 1:
        multiplier += 1
    return (token_ids * multiplier + 7919 * (salt + 1)) % vocab_size


def build_route_table(config: TRHashConfig) -> torch.Tensor:
    """The int64 [top_k, vocab_size] table of a new model; a loaded checkpoint's table replaces it."""
    vocab, experts, top_k = config.vocab_size, config.num_experts, config.num_experts_per_tok
    tokens = torch.arange(vocab, dtype=torch.int64)
    if config.routing_strategy == "modulo_cyclic":
        return torch.stack([(tokens + k) % experts for k in range(top_k)])
    if config.routing_strategy != "token_id_multi_hash":
        raise ValueError(f"routing_strategy {config.routing_strategy!r} cannot build a new route table; "
                         "load a checkpoint that carries its tables")
    chosen = [_permuting_hash(tokens, vocab, 0) % experts]
    for k in range(1, top_k):
        pick = _permuting_hash(tokens, vocab, k % config.route_hash_count + k) % (experts - k)
        taken = torch.stack(chosen)
        expert, free_seen = torch.full_like(tokens, -1), torch.zeros_like(tokens)
        for candidate in range(experts):  # the pick-th expert not yet chosen for the token
            is_free = (taken != candidate).all(dim=0)
            expert = torch.where(is_free & (free_seen == pick) & (expert < 0), candidate, expert)
            free_seen = free_seen + is_free.long()
        chosen.append(expert)
    return torch.stack(chosen)


def fused_shapes(config: TRHashConfig) -> tuple[tuple[int], tuple[int, int]]:
    """Shapes of fused_route_codes and fused_expert_pairs: defined for top-2 over 2..8 experts, else empty."""
    experts = config.num_experts
    if config.num_experts_per_tok == 2 and 2 <= experts <= 8:
        return (config.vocab_size,), (experts * (experts - 1) // 2, 2)
    return (0,), (0, 2)


def fused_route_buffers(route_table: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [V], pairs int32 [P, 2]): code = index of the token's pair {r0, r1}, plus 8 (32 when
    P > 8) when r0 is the larger expert; pairs a < b in torch.combinations order."""
    pairs = torch.combinations(torch.arange(num_experts), r=2)
    index = torch.zeros(num_experts, num_experts, dtype=torch.int64)
    index[pairs[:, 0], pairs[:, 1]] = index[pairs[:, 1], pairs[:, 0]] = torch.arange(len(pairs))
    first, second = route_table.to("cpu", torch.int64)
    codes = index[first, second] | (first > second).long() * (8 if len(pairs) <= 8 else 32)
    return codes.to(torch.uint8), pairs.to(torch.int32)


# --- RoPE: plain, or scaled as transformers' ROPE_INIT_FUNCTIONS scale it, in float64 as cflib computes it ---
def _linear(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    return inv_freq / scaling["factor"]


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """High frequencies kept, low ones divided by factor, a ramp between beta_fast and beta_slow rotations."""
    original = scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32.0), dimension(scaling.get("beta_slow") or 1.0)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Long wavelengths divided by factor, short ones kept, a smooth blend between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


_SCALED_INV_FREQ = {"linear": _linear, "yarn": _yarn, "llama3": _llama3}


def rope_inv_freq(config: TRHashConfig) -> torch.Tensor:
    hd, theta, scaling = config.head_dim, config.rope_theta, config.rope_scaling_dict()
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if scaling is not None:
        inv_freq = _SCALED_INV_FREQ[scaling["rope_type"]](inv_freq, hd, theta, scaling)
    return inv_freq.float()


def rope_attention_factor(config: TRHashConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, 1 for every other RoPE."""
    scaling = config.rope_scaling_dict()
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0


# --- modules ---
def derived(owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...], dtype: torch.dtype,
            build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A tensor derived from `sources` (owner._derived: a plain attribute, so no checkpoint or load sees it), built
    at a call's prefill (TRHashForCausalLM.hidden_states empties every owner's store there) and reused by the
    decode steps after it; rebuilt when a source, its device or the dtype changes in between. Emptied at each
    prefill because an edit through `.data` (PEFT's merge does `weight.data += delta`) changes neither a tensor's
    pointer nor its version."""
    entry = owner._derived.get(name)
    if torch.compiler.is_compiling():  # a compiled graph reads what the eager prefill built
        return entry[1] if entry is not None and entry[1].dtype == dtype else build().to(dtype)
    key = tuple((t.data_ptr(), t._version, t.device) for t in sources) + (dtype,)
    if entry is None or entry[0] != key:
        entry = (key, build().to(dtype))
        owner._derived[name] = entry
    return entry[1]


def frozen(linears: tuple[nn.Module, ...], weights: tuple[torch.Tensor, ...]) -> bool:
    """No gradient can reach `weights`, and `linears` are plain Linears (not ones an adapter wraps): the weights
    may then be read as derived matrices, side by side."""
    return (not torch.is_grad_enabled() or not any(weight.requires_grad for weight in weights)) and all(
        type(linear) is nn.Linear for linear in linears)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class TRHashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == x.dtype:
            # One fused kernel on CUDA (fp32 statistics for half inputs): four norms a layer are otherwise a
            # large share of a decode step's launches. Elsewhere rms_norm is composite and slower than this:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.dtype == self.weight.dtype == torch.float32:  # no casts to dispatch: the same arithmetic
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        x32 = x.float()  # half-precision sums of squares drift
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class TRHashRotaryEmbedding(nn.Module):
    """Holds the published `inv_freq` buffer; the angles come from the config in float64, so a
    half-precision copy of the buffer (after model.to(bfloat16)) cannot blur positions. A YaRN scaling's
    attention factor multiplies cos and sin, as transformers' rotary embeddings apply it."""

    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_factor = rope_attention_factor(config)
        self.register_buffer("inv_freq", torch.zeros(config.head_dim // 2, dtype=torch.float32))
        self._exact_inv_freq: torch.Tensor | None = None  # fp32 from the config, on the last device asked for

    def exact_inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._exact_inv_freq
        if cached is None or cached.device != device:
            cached = rope_inv_freq(self.config).to(device)
            if not torch.compiler.is_compiling():  # a compiled graph reads the cache the eager prefill filled
                self._exact_inv_freq = cached
        return cached

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [B, T, head_dim] float32 for [B, T] positions."""
        freqs = positions.float()[..., None] * self.exact_inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; cos, sin: [B, T, hd] in x's dtype (cast once per forward, not per layer)."""
    return x * cos[:, :, None] + _rotate_half(x) * sin[:, :, None]


def sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """torch's SDPA over [B, H, T, hd] queries and [B, KV, S, hd] keys: GQA without repeating a KV head.
    Returns [B, T, H, hd]."""
    batch, heads, seq, head_dim = query.shape
    groups = module.num_key_value_groups
    if seq == 1 and groups > 1 and (attention_mask is None or attention_mask.shape[1] == 1):
        # One query per row (decoding): the heads that share a KV head become that head's rows of queries,
        # which every SDPA kernel takes; the mask [B, 1, 1, S] is the same for all of them.
        grouped = query.view(batch, heads // groups, groups, head_dim)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling)
        return out.view(batch, 1, heads, head_dim), None
    is_causal = attention_mask is None and seq > 1
    if is_causal and key.shape[2] > seq:  # a static cache's full buffer on a first chunk: only its first keys exist
        key, value = key[:, :, :seq], value[:, :, :seq]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=is_causal, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: scores, mask, softmax in fp32, weights returned. [B, T, H, hd]."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[..., :key.shape[-2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    elif query.shape[2] > 1:
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores.float(), dim=-1).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


_OWN_ATTENTION = {"sdpa": sdpa_attention, "eager": eager_attention}


class TRHashAttention(nn.Module):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True  # what transformers' kernels read
        hd, d = config.head_dim, config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = hd ** -0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = TRHashRMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()
        self.k_norm = TRHashRMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()
        self.rotary_emb = TRHashRotaryEmbedding(config)
        self._derived: dict[str, tuple[tuple, torch.Tensor]] = {}  # the fused projection of frozen weights

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values as [B, T, heads, hd]; frozen weights as one GEMM (a decode step is bound by
        the kernels it launches)."""
        shape = (*x.shape[:2], -1, self.head_dim)
        linears = (self.q_proj, self.k_proj, self.v_proj)
        weights = tuple(linear.weight for linear in linears)
        if not frozen(linears, weights):
            return tuple(linear(x).view(shape) for linear in linears)
        fused = derived(self, "qkv", weights, compute_dtype(x), lambda: torch.cat(weights))
        return F.linear(x, fused).view(shape).split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Cache | None = None, **kwargs) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = position_embeddings
        q, k, v = self.projections(x)
        # Query and key heads side by side: one rotation for both (half the launches of two).
        qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        if cos.dtype != qk.dtype:  # under autocast; otherwise the model cast them once for every layer
            cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)
        q, k = _apply_rope(qk, cos, sin).transpose(1, 2).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        implementation = self.config._attn_implementation or "sdpa"
        # sdpa and eager are this module's own; flash_attention_* and kernels users register come from transformers.
        attend: Callable = _OWN_ATTENTION.get(implementation) or ALL_ATTENTION_FUNCTIONS[implementation]
        out, _ = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                        scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


def route_coefficients(route_table: torch.Tensor, num_experts: int, weights: list[float]) -> torch.Tensor:
    """[V, E] float32: each token's route weight on each expert (0 off its routes; a token routed twice to
    one expert gets both weights)."""
    table = torch.zeros(route_table.shape[1], num_experts, dtype=torch.float32, device=route_table.device)
    for k, weight in enumerate(weights):
        table.scatter_add_(1, route_table[k][:, None], torch.full_like(table[:, :1], weight))
    return table


class TRHashMoEEngine(nn.Module):
    """Shared SwiGLU plus SwiGLU experts chosen per token by a fixed table; no router, no aux loss."""

    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        d, s, e, w = config.hidden_size, config.shared_intermediate_size, config.num_experts, config.expert_width
        self.shared_gate = nn.Linear(d, s, bias=False)
        self.shared_up = nn.Linear(d, s, bias=False)
        self.shared_down = nn.Linear(s, d, bias=False)
        self.expert_gate = nn.Parameter(torch.empty(e, d, w))
        self.expert_up = nn.Parameter(torch.empty(e, d, w))
        self.expert_down = nn.Parameter(torch.empty(e, w, d))
        codes_shape, pairs_shape = fused_shapes(config)
        # Filled by _init_weights for a new model, by the checkpoint otherwise (the loaded table is authoritative).
        self.register_buffer("route_table", torch.zeros(config.num_experts_per_tok, config.vocab_size,
                                                        dtype=torch.int64))
        # Carried for the published layout; the dense computation below needs neither.
        self.register_buffer("fused_route_codes", torch.zeros(codes_shape, dtype=torch.uint8))
        self.register_buffer("fused_expert_pairs", torch.zeros(pairs_shape, dtype=torch.int32))
        self.route_weights = config.route_weights()
        self.shared_output_scale, self.routed_output_scale = config.shared_output_scale, config.routed_output_scale
        # Derived once, not every step (plain attributes: no checkpoint or load sees them), rebuilt when their
        # sources, device or dtype change: the route table's [V, E] coefficients, and in inference the four input
        # projections side by side as one matrix and the two output projections as another (inference_block).
        self._derived: dict[str, tuple[tuple, torch.Tensor]] = {}

    def coefficients(self, dtype: torch.dtype) -> torch.Tensor:
        return derived(self, "coefficients", (self.route_table,), dtype, lambda: route_coefficients(
            self.route_table, self.expert_gate.shape[0], self.route_weights))

    def experts_in(self) -> torch.Tensor:
        """[D, 2 E W]: every expert's gate projection, then every expert's up projection."""
        return torch.cat([self.expert_gate.transpose(0, 1).flatten(1), self.expert_up.transpose(0, 1).flatten(1)],
                         dim=1)

    def frozen(self) -> bool:
        return frozen((self.shared_gate, self.shared_up, self.shared_down), tuple(self.parameters()))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        dtype = compute_dtype(x)
        if self.frozen():
            return self.inference_block(x, token_ids, dtype).reshape(shape)
        shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        gate, up = (x @ self.experts_in().to(dtype)).chunk(2, dim=1)
        # Every expert on every token, weighted by its coefficient (0 off-route): few narrow experts make this
        # cheap, exact and gather-free.
        coeff = F.embedding(token_ids.reshape(-1), self.coefficients(gate.dtype))  # [N, E]
        hidden = (F.silu(gate) * up).view(x.shape[0], coeff.shape[1], -1) * coeff[:, :, None]
        out = torch.addmm(shared, hidden.flatten(1), self.expert_down.flatten(0, 1).to(hidden.dtype),
                          beta=self.shared_output_scale, alpha=self.routed_output_scale)
        return out.reshape(shape)

    def inference_block(self, x: torch.Tensor, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The same function as two GEMMs in all (shared and expert columns side by side, derived once): a decode
        step of a model this size is bound by the kernels it launches, not by their FLOPs."""
        def weights_in() -> torch.Tensor:  # [D, 2 (S + E W)]: the gate columns, then the up columns
            return torch.cat([self.shared_gate.weight.t(), self.expert_gate.transpose(0, 1).flatten(1),
                              self.shared_up.weight.t(), self.expert_up.transpose(0, 1).flatten(1)], dim=1)

        def weights_out() -> torch.Tensor:  # [S + E W, D]
            return torch.cat([self.shared_down.weight.t(), self.expert_down.flatten(0, 1)])

        def routed_coefficients() -> torch.Tensor:  # the routed scale folded into each token's weights
            return route_coefficients(self.route_table, self.expert_gate.shape[0],
                                      self.route_weights) * self.routed_output_scale

        sources_in = (self.shared_gate.weight, self.expert_gate, self.shared_up.weight, self.expert_up)
        gate, up = (x @ derived(self, "mlp_in", sources_in, dtype, weights_in)).chunk(2, dim=1)
        hidden = F.silu(gate) * up  # [N, S + E W]
        shared_columns = self.shared_gate.weight.shape[0]
        coeff = F.embedding(token_ids.reshape(-1), derived(self, "routed_coefficients", (self.route_table,),
                                                              hidden.dtype, routed_coefficients))
        hidden[:, shared_columns:].view(x.shape[0], coeff.shape[1], -1).mul_(coeff[:, :, None])
        if self.shared_output_scale != 1.0:
            hidden[:, :shared_columns].mul_(self.shared_output_scale)
        return hidden @ derived(self, "mlp_out", (self.shared_down.weight, self.expert_down), dtype, weights_out)


class TRHashDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = TRHashAttention(config, layer_idx)
        self.post_attention_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = nn.ModuleDict({"engine": TRHashMoEEngine(config)})  # tensor names read `mlp.engine.*`

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None, **kwargs) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), position_embeddings, attention_mask, cache=cache, **kwargs)
        return h + self.mlp["engine"](self.post_attention_layernorm(h), token_ids)


class TRHashPreTrainedModel(PreTrainedModel):
    config_class = TRHashConfig
    base_model_prefix = "tr_hash"  # no submodule has this name: checkpoint names are the model's own
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TRHashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # StaticCache + torch.compile(fullgraph=True): no graph break, no host sync
    _supports_static_cache = True  # the name transformers before 5 read

    def save_pretrained(self, *args, **kwargs):
        """transformers' save, refused while an adapter layer is left in the model: its weights would be saved
        under the adapter's names (`...base_layer.weight`, `lora_A`), which a reload skips and initialises anew.
        PEFT's merge_and_unload leaves the shared-expert layers wrapped when the adapters also target the expert
        tensors (the engine's wrapper hides them from it)."""
        wrapped = next((name for name, module in self.named_modules() if hasattr(module, "base_layer")), None)
        if wrapped is not None:
            raise ValueError(
                f"{wrapped} is still an adapter layer ({type(self.get_submodule(wrapped)).__name__}); saving would "
                "write weights a reload cannot find. Merge every layer first: for each module of the model that is "
                "a peft.tuners.tuners_utils.BaseTunerLayer, call module.merge() and put module.get_base_layer() in "
                "its place; or merge with `python -m cflib.export merge` and export that checkpoint")
        return super().save_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, TRHashRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, TRHashRotaryEmbedding):
            module.inv_freq.copy_(rope_inv_freq(self.config))
        elif isinstance(module, TRHashMoEEngine):
            for param in (module.expert_gate, module.expert_up, module.expert_down):
                nn.init.normal_(param, mean=0.0, std=std)
            table = build_route_table(self.config)
            module.route_table.copy_(table)
            if module.fused_route_codes.numel():
                codes, pairs = fused_route_buffers(table, self.config.num_experts)
                module.fused_route_codes.copy_(codes)
                module.fused_expert_pairs.copy_(pairs)


class TRHashTiedHead:
    """The output head as tools that bring their own loss read it (TRL's fused LM head): `weight` is the input
    embedding's own tensor (tied), no bias. A view, not a module: the checkpoint holds no head of its own."""

    bias = None

    def __init__(self, embedding: nn.Embedding) -> None:
        self._embedding = embedding

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding.weight


class TRHashTrunk:
    """The body (embeddings, layers, final norm) returning hidden states, as `model.base_model`: what tools that
    apply the head themselves call. A view over the model's own modules, so no tensor is renamed."""

    _tp_plan = _pp_plan = None

    def __init__(self, model: "TRHashForCausalLM") -> None:
        self._model = model

    def __call__(self, input_ids: torch.LongTensor | None = None, **kwargs) -> BaseModelOutputWithPast:
        hidden, cache = self._model.hidden_states(input_ids, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{_CACHE_FIELD: cache})


class TRHashForCausalLM(TRHashPreTrainedModel, GenerationMixin):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TRHashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    @property
    def _derived_stores(self) -> list[dict]:
        return [module._derived for module in self.modules() if isinstance(getattr(module, "_derived", None), dict)]

    @property
    def base_model(self) -> TRHashTrunk:
        return TRHashTrunk(self)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> TRHashTiedHead:
        return TRHashTiedHead(self.embed_tokens)  # logits = h @ embed_tokens.weight.T

    def resize_token_embeddings(self, *args, **kwargs):
        raise ValueError("a TR-MoE's vocabulary is fixed by its route tables (every token id has its experts): "
                         "the token embeddings cannot be resized")

    def hidden_states(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                      inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                      cache: Cache | None = None, keep_cache: bool = True, **kwargs) -> tuple[torch.Tensor, Cache | None]:
        """(final normed hidden states [B, T, D], the cache); kwargs reach transformers' attention kernels."""
        if input_ids is None:
            raise ValueError("TR-MoE routes each token by its id: pass input_ids (inputs_embeds alone cannot route)")
        cache = cache if cache is not None else past_key_values
        given_cache = cache
        if not torch.compiler.is_compiling() and (cache is None or cache.get_seq_length() == 0):
            for store in self._derived_stores:  # a prefill: weights may have changed since the last call
                store.clear()
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            cache = None
        elif cache is None and keep_cache:
            cache = DynamicCache()
        batch, seq = input_ids.shape
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            if attention_mask is not None and attention_mask.dim() == 2:
                # Left padding: each row's real tokens count from 0.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq:]
            else:
                position_ids = torch.arange(seq, device=input_ids.device)[None] + past
        if attention_mask is not None and attention_mask.dim() == 2 and isinstance(cache, DynamicCache):
            total = cache.get_seq_length() + seq
            if attention_mask.shape[-1] != total:
                raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, but the cache holds "
                                 f"{total - seq} and the input {seq}: it must cover all {total}")
        h = self.embed_tokens(input_ids)
        # The cache this call made is empty: the mask is built without it, so position_ids that restart
        # (padding-free packed rows) keep each example attending only to itself.
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                  position_ids=position_ids, **{_MASK_CACHE_ARG: given_cache if use_cache else None})
        cos, sin = self.layers[0].self_attn.rotary_emb(position_ids.expand(batch, seq))
        position_embeddings = (cos.to(h.dtype), sin.to(h.dtype))  # once here, not in every layer
        for layer in self.layers:
            h = layer(h, input_ids, position_embeddings, attention_mask=mask, cache=cache, position_ids=position_ids,
                      **kwargs)
        return self.norm(h), cache

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """kwargs: `num_items_in_batch` (the supervised tokens of the whole accumulated batch: the loss is their
        mean), and what transformers' attention kernels read (cu_seq_lens_*, max_length_* of padding-free rows)."""
        h, cache = self.hidden_states(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                      use_cache, cache, keep_cache=labels is None, **kwargs)  # a loss keeps no cache
        if isinstance(logits_to_keep, int):
            kept = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            kept = h[:, logits_to_keep]
        logits = F.linear(kept, self.embed_tokens.weight)
        loss = None
        if labels is not None:  # labels are the input ids: position t predicts t + 1 (shifted by the loss)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
