"""The TR-MoE decoder in plain PyTorch: the numerical reference for every fast path.

Module and parameter names mirror the public checkpoint layout (DESIGN.md), so a
state dict maps one to one onto `model.safetensors`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import DocumentMask, build_document_mask, document_attention, document_positions
from .config import ModelConfig
from .routing import build_route_table

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 sums of squares drift.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; cos/sin: [T, hd], or [B, T, hd] for per-row positions, in fp32."""
    x32 = x.float()
    return (x32 * cos[..., None, :] + rotate_half(x32) * sin[..., None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_mask: DocumentMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if document_mask is not None:  # packed window: each example attends only to itself
            out = document_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_mask)
        else:  # Right padding needs no mask: under the causal mask no real token sees a later pad.
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class TRMoEEngine(nn.Module):
    """Shared SwiGLU plus routed SwiGLU experts chosen by a fixed token-id table."""

    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        d, s, e, w = config.hidden_size, config.shared_intermediate_size, config.num_experts, config.expert_width
        self.shared_gate = nn.Linear(d, s, bias=False)
        self.shared_up = nn.Linear(d, s, bias=False)
        self.shared_down = nn.Linear(s, d, bias=False)
        self.expert_gate = nn.Parameter(torch.empty(e, d, w))
        self.expert_up = nn.Parameter(torch.empty(e, d, w))
        self.expert_down = nn.Parameter(torch.empty(e, w, d))
        # A checkpoint's table is authoritative: when one will be loaded, nothing is built.
        table = build_route_table(config) if build_routes else torch.zeros(
            config.num_experts_per_tok, config.vocab_size, dtype=torch.int64)
        self.register_buffer("route_table", table)
        self.route_weights = config.route_weights()
        self.shared_output_scale = config.shared_output_scale
        self.routed_output_scale = config.routed_output_scale
        self.last_backend = "none"  # set by each forward: what actually ran

    def expert_coefficients(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, E]: each token's route weight on its experts, zero elsewhere."""
        routes = self.route_table[:, token_ids]  # [top_k, N]
        coeff = torch.zeros(token_ids.numel(), self.expert_gate.shape[0], dtype=dtype, device=token_ids.device)
        for k, weight in enumerate(self.route_weights):
            # scatter_add, not scatter: a table that routes a token twice to one expert sums both weights.
            coeff.scatter_add_(1, routes[k][:, None], torch.full_like(coeff[:, :1], weight))
        return coeff

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        # Dense over experts: with few narrow experts every expert on every token
        # is cheap, exact (unrouted experts get coefficient 0) and gather-free.
        gate = torch.einsum("nd,edw->new", x, self.expert_gate)
        up = torch.einsum("nd,edw->new", x, self.expert_up)
        coeff = self.expert_coefficients(token_ids.reshape(-1), gate.dtype)
        routed = torch.einsum("new,ewd->nd", F.silu(gate) * up * coeff[:, :, None], self.expert_down)
        self.last_backend = "torch_dense"
        out = self.shared_output_scale * shared + self.routed_output_scale * routed
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        # A dict, not a wrapper class, so the tensor names read `mlp.engine.*` as published.
        self.mlp = nn.ModuleDict({"engine": TRMoEEngine(config, build_routes)})

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_mask: DocumentMask | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, document_mask)
        return h + self.mlp["engine"](self.post_attention_layernorm(h), token_ids)


class TRMoEModel(nn.Module):
    """Decoder returning final (normed) hidden states; the loss owns the tied head."""

    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, build_routes) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.grad_ckpt = False
        self.last_attention = "torch_sdpa"  # set by each forward: what actually ran
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        residual_std = INIT_STD / (2 * self.config.num_hidden_layers) ** 0.5
        for name, param in self.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "shared_down.weight", "expert_down")):
                param.normal_(0.0, residual_std)  # keeps the residual stream's variance flat in depth
            else:
                param.normal_(0.0, INIT_STD)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def rope(self, seq_len: int, device: torch.device,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, hd] for positions 0..T-1, or [B, T, hd] for given [B, T] positions."""
        if positions is None:
            positions = torch.arange(seq_len, device=device)
        freqs = positions.float()[..., None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states. document_ids [B, T]: packed examples, each attending only to itself
        with positions restarting at 0; None: one sequence per row, as if unpacked."""
        document_mask, positions = None, None
        if document_ids is not None:
            document_mask = build_document_mask(document_ids)
            positions = document_positions(document_ids)
        self.last_attention = document_mask.backend if document_mask is not None else "torch_sdpa"
        cos, sin = self.rope(input_ids.shape[1], input_ids.device, positions)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                h = checkpoint(layer, h, input_ids, cos, sin, document_mask, use_reentrant=False)
            else:
                h = layer(h, input_ids, cos, sin, document_mask)
        return self.norm(h)

    def kernel_path(self) -> dict[str, str]:
        """The backends the last forward actually used, read back from the modules."""
        return {
            "attention": self.last_attention,
            "rmsnorm": "torch",
            "rope": "torch",
            "moe": self.layers[0].mlp["engine"].last_backend,
        }
