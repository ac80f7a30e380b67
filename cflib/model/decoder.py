"""The TR-MoE decoder in plain PyTorch: the numerical reference for every fast path.

`TRMoEModel.use_kernels` points modules at the Triton/Liger fast paths of
cflib.ops instead; each module records the backend its last forward ran.
Module and parameter names mirror the public checkpoint layout (docs/export.md), so a
state dict maps one to one onto `model.safetensors`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cflib.model.config import ModelConfig
from cflib.model.kv_cache import KVCache, LayerCache
from cflib.model.lora import embedding_weight, experts_in, experts_out, fused_linear, fused_trmoe
from cflib.model.routing import build_route_table
from cflib.ops.attention import DENSE_SDPA, AttentionBatch, PackedDocuments, attend, attention_batch, pack_documents

if TYPE_CHECKING:
    from cflib.ops.dispatch import KernelPlan

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "torch"  # or "liger", or "cflib_add_rmsnorm" on the residual stream (TRMoEModel.use_kernels)
        self.last_backend = "none"

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm) in one kernel: the residual stream stays fp32, the norm comes out for the GEMM."""
        from cflib.ops.add_rms_norm import add_rms_norm
        self.last_backend = "cflib_add_rmsnorm"
        return add_rms_norm(h, delta, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_backend = self.backend
        if self.backend == "liger":
            from cflib.ops.liger import LigerRMSNormFunction
            # "gemma" casting: normalise and scale in fp32, cast once at the end, as below.
            return LigerRMSNormFunction.apply(x, self.weight, self.eps, 0.0, "gemma", False)
        # Normalise in fp32 whatever the activation dtype: bf16 sums of squares drift.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))).float()


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, hd] fp32 tables, rotate-half layout (frequencies repeated)."""
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq.to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


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
        self.rope_backend = "torch"  # or "liger", or "cflib_qk_norm_rope" (QK-norm and RoPE fused)
        self.fused_qkv = False  # one GEMM for q, k, v: the input is cast and read once
        self.last_rope_backend = self.last_qkv = self.last_attention = "none"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBatch = DENSE_SDPA, kv: LayerCache | None = None) -> torch.Tensor:
        """attention: the kernel of this forward's rows and, packed, their documents (cflib.ops.attention);
        kv: decoding, the layer's cache keeps k and v and attends over every cached position."""
        batch, seq, _ = x.shape
        shape = (batch, seq, -1, self.head_dim)
        self.last_qkv = "fused_gemm" if self.fused_qkv else "three_gemms"
        self.last_rope_backend = self.rope_backend
        if self.fused_qkv:
            qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))  # LoRA adapters included
            qkv = qkv.view(batch * seq, -1)
        if self.rope_backend == "cflib_qk_norm_rope":  # set only with fused_qkv and QK-norm
            from cflib.ops.qk_norm_rope import qkv_norm_rope
            self.q_norm.last_backend = self.k_norm.last_backend = "cflib_qk_norm_rope"
            q, k, v = qkv_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, batch, seq,
                                    self.num_heads, self.num_kv_heads, self.q_norm.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            if self.fused_qkv:
                q, k, v = qkv.split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], 1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            v = v.reshape(shape).transpose(1, 2)
            q, k = self.q_norm(q.reshape(shape)), self.k_norm(k.reshape(shape))
            if self.rope_backend == "liger":
                from cflib.ops.liger import LigerRopeFunction
                q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, T, hd]
            else:
                q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        if kv is not None:
            out = kv.attend(q, k, v)
            self.last_attention = kv.cache.backend
        else:
            out = attend(q, k, v, attention)  # packed: each example attends only to itself
            self.last_attention = attention.kernel
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return fused_linear(out, (self.o_proj,)) if self.fused_qkv else self.o_proj(out)  # LoRA adapters included


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
        self.backend = "torch_dense"  # or "triton_fused" (cflib.ops.trmoe)
        self.swiglu_backend = "torch"  # or "liger", for the shared branch of torch_dense
        self.last_backend = "none"  # set by each forward: what actually ran
        self.last_swiglu_backend = "none"

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
        if self.backend == "triton_fused":
            self.last_backend = self.last_swiglu_backend = "triton_fused"
            return fused_trmoe(self, x, token_ids.reshape(-1)).reshape(shape)  # cflib.ops.trmoe, adapters included
        self.last_swiglu_backend = self.swiglu_backend
        if self.swiglu_backend == "liger":
            from cflib.ops.liger import LigerSiLUMulFunction
            shared = self.shared_down(LigerSiLUMulFunction.apply(self.shared_gate(x), self.shared_up(x)))
        else:
            shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        # Dense over experts: with few narrow experts every expert on every token
        # is cheap, exact (unrouted experts get coefficient 0) and gather-free.
        gate, up = experts_in(self, "expert_gate", x), experts_in(self, "expert_up", x)  # LoRA adapters included
        coeff = self.expert_coefficients(token_ids.reshape(-1), gate.dtype)
        routed = experts_out(self, F.silu(gate) * up * coeff[:, :, None])
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
                attention: AttentionBatch = DENSE_SDPA, pending: torch.Tensor | None = None,
                kv: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h, pending): with fused add+norm, the MLP output is added by the next norm, so it is returned apart."""
        if self.input_layernorm.backend == "cflib_add_rmsnorm":
            h, x = self.input_layernorm.add_norm(h, pending)
            h, x = self.post_attention_layernorm.add_norm(h, self.self_attn(x, cos, sin, attention, kv))
            return h, self.mlp["engine"](x, token_ids)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attention, kv)
        return h + self.mlp["engine"](self.post_attention_layernorm(h), token_ids), None


class TRMoEModel(nn.Module):
    """Decoder returning final (normed) hidden states; the loss owns the tied head."""

    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, build_routes) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.grad_ckpt = False
        self.attention_backend = "auto"  # cflib.ops.attention.ATTENTION_BACKENDS; set by use_kernels
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
        return embedding_weight(self.embed_tokens)  # a LoRA run's trainable token rows included

    def rope(self, seq_len: int, device: torch.device,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, hd] for positions 0..T-1, or [B, T, hd] for given [B, T] positions."""
        if positions is None:
            return rope_cos_sin(self.inv_freq, seq_len, device)
        freqs = positions.float()[..., None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | PackedDocuments | None = None,
                kv: KVCache | None = None) -> torch.Tensor:
        """Final hidden states. document_ids: packed examples, each attending only to itself with positions
        restarting at 0, as [B, T] ids or, built on the host with the batch, PackedDocuments (no sync);
        None: one sequence per row, as if unpacked. kv (cflib.model.kv_cache.KVCache): decoding; the cache
        says each row's positions and keeps every layer's keys and values."""
        documents = pack_documents(document_ids) if isinstance(document_ids, torch.Tensor) else document_ids
        device = input_ids.device
        activations = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                       else self.embed_tokens.weight.dtype)
        attention = attention_batch(self.attention_backend, device, activations, self.config.head_dim, documents)
        positions = kv.positions if kv is not None else documents.positions if documents is not None else None
        cos, sin = self.rope(input_ids.shape[1], device, positions)
        h, pending = self.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers):
            if self.grad_ckpt and self.training:
                h, pending = checkpoint(layer, h, input_ids, cos, sin, attention, pending, use_reentrant=False)
            else:
                h, pending = layer(h, input_ids, cos, sin, attention, pending,
                                   kv.layers[index] if kv is not None else None)
        if self.norm.backend == "cflib_add_rmsnorm":
            return self.norm.add_norm(h, pending)[1]
        return self.norm(h)

    def use_kernels(self, plan: KernelPlan) -> None:
        """Point every module at the backends of a cflib.ops.dispatch.KernelPlan."""
        self.attention_backend = plan.attention
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.backend = "liger" if plan.liger else "torch"
            elif isinstance(module, Attention):
                module.rope_backend = "liger" if plan.liger else "torch"
                module.fused_qkv = plan.custom
                if plan.custom and isinstance(module.q_norm, RMSNorm):
                    module.rope_backend = "cflib_qk_norm_rope"
            elif isinstance(module, TRMoEEngine):
                module.backend = "triton_fused" if plan.custom else "torch_dense"
                module.swiglu_backend = "liger" if plan.liger else "torch"
        if plan.custom:  # the norms on the residual stream also take its add (cflib.ops.add_rms_norm)
            for layer in self.layers:
                layer.input_layernorm.backend = layer.post_attention_layernorm.backend = "cflib_add_rmsnorm"
            self.norm.backend = "cflib_add_rmsnorm"

    def kernel_path(self) -> dict[str, str]:
        """The backends the last forward actually used, read back from the modules."""
        attention, engine = self.layers[0].self_attn, self.layers[0].mlp["engine"]
        path = {"attention": attention.last_attention, "qkv": attention.last_qkv, "rmsnorm": self.norm.last_backend,
                "rope": attention.last_rope_backend, "swiglu": engine.last_swiglu_backend, "moe": engine.last_backend}
        if isinstance(attention.q_norm, RMSNorm):
            path["qk_norm"] = attention.q_norm.last_backend
        return path
