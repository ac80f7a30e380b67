"""The TR-MoE decoder (model_type "tr_hash_moe") for Hugging Face transformers, with a KV cache.

Self-contained: loaded by `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)` from an exported bundle, it imports torch and
transformers only. Tensor names are the checkpoint's own (`embed_tokens`,
`layers.i.*`, `norm`, no `lm_head`: the head is the input embedding), so the
bundle's `model.safetensors` loads with no key renamed, missing or unexpected.

The block: h += attn(rmsnorm(h)); h += mlp(rmsnorm(h), token_ids). Attention
is GQA with an RMSNorm on each query and key head before rotate-half RoPE.
The MLP (TR-MoE) is shared_output_scale * shared SwiGLU(x) + routed_output_scale
* sum_k w_k * expert[route_table[k, token]](x): routing is a fixed per-layer
table of token ids, so every forward needs input_ids (not inputs_embeds).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tr_hash_moe import TRHashConfig

# Newer transformers name the output's cache field `cache`, older ones `past_key_values`.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_HASH_MULTIPLIERS = (2654435761, 2246822519, 3266489917, 668265263, 374761393)


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


def rope_inv_freq(config: TRHashConfig) -> torch.Tensor:
    hd = config.head_dim
    return (1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))).float()


# --- modules ----------------------------------------------------------------------------------
class TRHashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # half-precision sums of squares drift
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class TRHashRotaryEmbedding(nn.Module):
    """Holds the published `inv_freq` buffer; the angles come from the config in float64, so a
    half-precision copy of the buffer (after model.to(bfloat16)) cannot blur positions."""

    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", torch.zeros(config.head_dim // 2, dtype=torch.float32))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [B, T, head_dim] float32 for [B, T] positions."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=positions.device) / self.head_dim
        inv_freq = (1.0 / self.theta ** exponents).float()
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; rotated in float32."""
    x32 = x.float()
    return (x32 * cos[:, :, None] + _rotate_half(x32) * sin[:, :, None]).to(x.dtype)


class TRHashAttention(nn.Module):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hd, d = config.head_dim, config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = TRHashRMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()
        self.k_norm = TRHashRMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()
        self.rotary_emb = TRHashRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, -1, self.head_dim)
        cos, sin = self.rotary_emb(positions)
        q = _apply_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k = _apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        routes = self.route_table[:, token_ids.reshape(-1)]  # [top_k, N]
        coeff = torch.zeros(x.shape[0], self.expert_gate.shape[0], dtype=x.dtype, device=x.device)
        for k, weight in enumerate(self.route_weights):  # a token routed twice to one expert gets both weights
            coeff.scatter_add_(1, routes[k][:, None], torch.full_like(coeff[:, :1], weight))
        # Every expert on every token, weighted by coeff (0 off-route): few narrow experts make this cheap and exact.
        gate = torch.einsum("nd,edw->new", x, self.expert_gate)
        up = torch.einsum("nd,edw->new", x, self.expert_up)
        routed = torch.einsum("new,ewd->nd", F.silu(gate) * up * coeff[:, :, None], self.expert_down)
        return (self.shared_output_scale * shared + self.routed_output_scale * routed).reshape(shape)


class TRHashDecoderLayer(nn.Module):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = TRHashAttention(config, layer_idx)
        self.post_attention_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = nn.ModuleDict({"engine": TRHashMoEEngine(config)})  # tensor names read `mlp.engine.*`

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, mask, cache)
        return h + self.mlp["engine"](self.post_attention_layernorm(h), token_ids)


def attention_mask_4d(attention_mask: torch.Tensor | None, batch: int, query_len: int, past: int,
                      device: torch.device) -> torch.Tensor | None:
    """Boolean [B, 1, q, past + q]: causal, without padded keys; None where plain causal attention is exact."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask  # already expanded by the caller
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None
    if attention_mask is None and (past == 0 or query_len == 1):
        return None  # is_causal (or, for one query, every cached key)
    total = past + query_len
    query_at = torch.arange(past, total, device=device)[:, None]
    key_at = torch.arange(total, device=device)[None, :]
    allowed = (key_at <= query_at)[None].expand(batch, -1, -1)
    if attention_mask is not None:
        if attention_mask.shape[-1] != total:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, but the cache holds "
                             f"{past} and the input {query_len}: it must cover all {total}")
        # A padding query still sees itself, so no softmax row is empty (its output is never used).
        allowed = (allowed & attention_mask.bool()[:, None, :]) | (key_at == query_at)
    return allowed[:, None]


class TRHashPreTrainedModel(PreTrainedModel):
    config_class = TRHashConfig
    base_model_prefix = "tr_hash"  # no submodule has this name: checkpoint names are the model's own
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TRHashDecoderLayer"]
    _supports_sdpa = True

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


class TRHashForCausalLM(TRHashPreTrainedModel, GenerationMixin):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TRHashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> None:
        return None  # the head is embed_tokens itself (logits = h @ embed_tokens.weight.T)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if input_ids is None:
            raise ValueError("TR-MoE routes each token by its id: pass input_ids (inputs_embeds alone cannot route)")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            cache = None
        elif cache is None:
            cache = DynamicCache()
        batch, seq = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                # Left padding: each row's real tokens count from 0.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq:]
            else:
                position_ids = torch.arange(past, past + seq, device=input_ids.device)[None]
        positions = position_ids.expand(batch, seq)
        mask = attention_mask_4d(attention_mask, batch, seq, past, input_ids.device)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            h = layer(h, input_ids, positions, mask, cache)
        h = self.norm(h)
        if isinstance(logits_to_keep, int):
            kept = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            kept = h[:, logits_to_keep]
        logits = F.linear(kept, self.embed_tokens.weight)
        loss = None
        if labels is not None:  # labels are the input ids: position t predicts t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
