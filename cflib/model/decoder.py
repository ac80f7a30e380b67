"""The TR-MoE decoder in plain PyTorch: the numerical reference for every fast path.

A pre-norm decoder: each block is two residual lines, h + attention(norm(h)), then h + the TR-MoE block(norm(h))
(a shared SwiGLU plus routed SwiGLU experts chosen by a fixed token-id table), and a final norm; the tied head
belongs to the loss. Module and parameter names mirror the public checkpoint layout (docs/formats.md), so a
state dict maps one to one onto `model.safetensors`.

The fast paths are subclasses of these modules (cflib.model.fast): `use_kernels(model, kernels)` swaps each
module's class for the one a KernelChoice names, so the state dict, checkpoints and adapters do not change
with the kernels. Each class names what it runs (`kernels`), and `TRMoEModel.kernel_path()` reads that back
over every layer, with what the last forward chose for its rows (the attention kernel, the rows the last layer
computed) and what the fast modules record of their own forwards. Adapters (LoRA) reach the computation
through the weight protocol of cflib.model.weights; nothing here imports them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cflib.model.config import ModelConfig
from cflib.model.kv_cache import KVCache, LayerCache
from cflib.model.rope import attention_factor, rope_inv_freq, scaled_cos_sin
from cflib.model.routing import build_route_table
from cflib.model.weights import ExpertAdapter, effective_weight
from cflib.ops.attention import DENSE_SDPA, AttentionBatch, PackedDocuments, attend, attention_batch, pack_documents
from cflib.ops.rows import Rows, gather_rows

INIT_STD = 0.02
POSITION_KEYS = ("rope_theta", "rope_scaling", "max_position_embeddings")  # what set_positions may change
EXPERT_TENSORS = ("expert_gate", "expert_up", "expert_down")  # a TR-MoE engine's [E, ., .] parameters
# The order records list what ran in.
KERNEL_PATH_KEYS = ("attention", "qkv", "rmsnorm", "rope", "swiglu", "moe", "swiglu_activation", "qk_norm",
                    "qk_norm_backward", "residual", "last_layer_rows", "embedding_noise")


class RMSNorm(nn.Module):
    kernels = {"rmsnorm": "torch"}  # what this class runs, as records name it

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 sums of squares drift.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int, device: torch.device, factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, hd] fp32 tables, rotate-half layout (frequencies repeated), times YaRN's attention factor."""
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq.to(device))
    return scaled_cos_sin(freqs, factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; cos/sin: [T, hd], or [B, T, hd] for per-row positions, in fp32."""
    x32 = x.float()
    return (x32 * cos[..., None, :] + rotate_half(x32) * sin[..., None, :]).to(x.dtype)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: AttentionBatch,
                kv: LayerCache | None = None, rows: Rows | None = None) -> torch.Tensor:
    """Heads [B, H, T, hd] attended, as token rows [B, T, H x hd]: with this forward's attention kernel (and, packed,
    its documents: each example attends to itself), or over the layer's KV cache while decoding. rows: those
    token rows alone, [R, H x hd] (every position still attends and is attended to)."""
    batch, _, seq, _ = q.shape
    out = kv.attend(q, k, v) if kv is not None else attend(q, k, v, attention)
    out = out.transpose(1, 2).reshape(batch, seq, -1)
    return out if rows is None else gather_rows(out, rows)


class Attention(nn.Module):
    """GQA with QK-norm and RoPE: three projections, the norms and RoPE in PyTorch, the attention kernel of
    this forward's rows (cflib.ops.attention)."""

    kernels = {"qkv": "three_gemms", "rope": "torch"}

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
                attention: AttentionBatch = DENSE_SDPA, kv: LayerCache | None = None,
                rows: Rows | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D], or [R, D] for `rows` (attend_rows); kv: decoding, the layer's cache."""
        heads = (*x.shape[:2], -1, self.head_dim)
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(heads)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(heads)), cos, sin)
        v = self.v_proj(x).reshape(heads)
        return self.o_proj(attend_rows(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention, kv, rows))


class TRMoEEngine(nn.Module):
    """Shared SwiGLU plus routed SwiGLU experts chosen by a fixed token-id table."""

    kernels = {"swiglu": "torch", "moe": "torch_dense"}

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
        self.expert_adapter_slot: str | None = None

    def attach_expert_adapter(self, name: str, adapter: ExpertAdapter, slot: str) -> None:
        """Adapt expert tensor `name` ("expert_gate", "expert_up" or "expert_down"); the adapters live in a
        ModuleDict attribute named `slot`, so their tensors are named `<slot>.<name>.*` in the state dict."""
        if not hasattr(self, slot):
            setattr(self, slot, nn.ModuleDict())
        getattr(self, slot)[name] = adapter
        self.expert_adapter_slot = slot

    def expert_adapters(self) -> dict[str, ExpertAdapter]:
        return dict(getattr(self, self.expert_adapter_slot).items()) if self.expert_adapter_slot else {}

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
        out = self.block(x.reshape(-1, shape[-1]), token_ids.reshape(-1))
        return out.reshape(shape)

    def block(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D], token ids [N] -> [N, D]."""
        shared = self.shared_down(self.swiglu(self.shared_gate(x), self.shared_up(x)))
        # Dense over experts: with few narrow experts every expert on every token
        # is cheap, exact (unrouted experts get coefficient 0) and gather-free.
        adapters = self.expert_adapters()
        gate = self.experts_in(x, self.expert_gate, adapters.get("expert_gate"))
        up = self.experts_in(x, self.expert_up, adapters.get("expert_up"))
        coeff = self.expert_coefficients(token_ids, gate.dtype)
        hidden = F.silu(gate) * up * coeff[:, :, None]
        routed = torch.einsum("new,ewd->nd", hidden, self.expert_down)
        if (down := adapters.get("expert_down")) is not None:
            routed = routed + down.branch_out(hidden)
        return self.shared_output_scale * shared + self.routed_output_scale * routed

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    @staticmethod
    def experts_in(x: torch.Tensor, weight: torch.Tensor, adapter: ExpertAdapter | None) -> torch.Tensor:
        """[N, D] -> [N, E, W] through every expert's gate or up projection, its adapter's branch added."""
        out = torch.einsum("nd,edw->new", x, weight)
        return out if adapter is None else out + adapter.branch_in(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        # A dict, not a wrapper class, so the tensor names read `mlp.engine.*` as published.
        self.mlp = nn.ModuleDict({"engine": TRMoEEngine(config, build_routes)})

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBatch = DENSE_SDPA, kv: LayerCache | None = None,
                rows: Rows | None = None) -> torch.Tensor:
        """The residual stream h [B, T, D] through one block. rows: after attention, those token rows alone go
        on ([R, D] out): everything after it works token by token."""
        attended = self.self_attn(self.input_layernorm(h), cos, sin, attention, kv, rows)
        if rows is not None:
            h, token_ids = gather_rows(h, rows), token_ids.reshape(-1).index_select(0, rows.indices)
        h = h + attended
        return h + self.mlp["engine"](self.post_attention_layernorm(h), token_ids)


class TRMoEModel(nn.Module):
    """Decoder returning final (normed) hidden states; the loss owns the tied head."""

    def __init__(self, config: ModelConfig, build_routes: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, build_routes) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
                             persistent=False)
        self.rope_attention_factor = attention_factor(config.rope_scaling)  # multiplies cos and sin (YaRN)
        # The backend asked for (cflib.ops.attention.BACKENDS, or auto); each forward picks its kernel for the
        # activations' dtype and the kind of rows. Set by cflib.model.fast.use_kernels.
        self.attention_backend = "auto"
        # What the last forward chose for its rows: the attention kernel, the last layer's rows, the stream's dtype.
        self.last_forward: dict[str, str] = {}
        # NEFTune's noise on the embeddings of training forwards (cflib.model.neftune), where the run's execution
        # plan attaches it; a module without tensors, so the state dict does not change with it.
        self.embedding_noise: nn.Module | None = None
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
        return effective_weight(self.embed_tokens)  # an adapter's trainable token rows included

    def rope(self, seq_len: int, device: torch.device,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, hd] for positions 0..T-1, or [B, T, hd] for given [B, T] positions."""
        if positions is None:
            return rope_cos_sin(self.inv_freq, seq_len, device, self.rope_attention_factor)
        return scaled_cos_sin(positions.float()[..., None] * self.inv_freq.to(device), self.rope_attention_factor)

    def set_positions(self, config: ModelConfig) -> None:
        """Take `config`'s positions (rope_theta, rope_scaling, max_position_embeddings), every other key being the
        model's own: a run that extends the context of the checkpoint it starts from, whose stored frequencies
        were checked against the checkpoint's config as it loaded. Before use_kernels, which reads the attention
        factor (cflib.model.fast)."""
        changed = {key for key, value in config.to_dict().items() if value != getattr(self.config, key)}
        if not changed <= set(POSITION_KEYS):
            raise ValueError(f"only {', '.join(POSITION_KEYS)} may change on a built model, not {sorted(changed)}")
        self.config = config
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.rope_attention_factor = attention_factor(config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | PackedDocuments | None = None,
                kv: KVCache | None = None, rows: Rows | None = None,
                example_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, T, D]. document_ids: packed examples, each attending only to itself with
        positions restarting at 0, as [B, T] ids or, built on the host with the batch, PackedDocuments (no sync);
        None: one sequence per row, as if unpacked. kv (cflib.model.kv_cache.KVCache): decoding; the cache
        says each row's positions and keeps every layer's keys and values. rows (cflib.ops.rows.Rows): the final
        hidden states of those flat positions alone, [R, D]: everything after the last layer's attention works
        token by token, so the last layer computes no other row (a third less of its work when a third of the
        tokens is unsupervised). example_lengths: [B, T], the token count of each position's example, which
        NEFTune's noise reads in a training forward (cflib.model.neftune); the training step's batches carry it."""
        h, cos, sin, attention = self.embed(input_ids, document_ids, kv, rows, example_lengths)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            h = layer(h, input_ids, cos, sin, attention, layer_cache(kv, index), rows if index == last else None)
        return self.norm(h)

    def embed(self, input_ids: torch.Tensor, document_ids: torch.Tensor | PackedDocuments | None,
              kv: KVCache | None, rows: Rows | None, example_lengths: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch]:
        """The residual stream's start (the token embeddings, with NEFTune's noise where the plan attached it and
        the model trains), RoPE's tables for the rows' positions and the attention kernel for these rows; noted in
        `last_forward` for kernel_path()."""
        documents = pack_documents(document_ids) if isinstance(document_ids, torch.Tensor) else document_ids
        device = input_ids.device
        activations = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                       else self.embed_tokens.weight.dtype)
        attention = attention_batch(self.attention_backend, device, activations, self.config.head_dim, documents)
        positions = kv.positions if kv is not None else documents.positions if documents is not None else None
        cos, sin = self.rope(input_ids.shape[1], device, positions)
        h = self.embed_tokens(input_ids)
        noise = self.embedding_noise
        if noise is not None:
            h = noise(h, example_lengths)
        self.last_forward = {"attention": kv.backend if kv is not None else attention.kernel,
                             "residual": str(h.dtype).removeprefix("torch."),
                             "last_layer_rows": "all" if rows is None else "selected",
                             **({} if noise is None else {"embedding_noise": noise.last_form})}
        return h, cos, sin, attention

    def kernel_path(self) -> dict[str, str]:
        """What the last forward ran, read back from every layer's modules ("a+b" where layers differ); {} before
        any forward."""
        if not self.last_forward:
            return {}
        found: dict[str, set[str]] = {}
        for layer in self.layers:
            for module in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                           layer.mlp["engine"]):
                for key, value in kernels_of(module).items():
                    found.setdefault(key, set()).add(value)
        for key, value in {**kernels_of(self.norm), **self.last_forward}.items():
            found.setdefault(key, set()).add(value)
        order = {key: index for index, key in enumerate(KERNEL_PATH_KEYS)}
        return {key: "+".join(sorted(found[key])) for key in sorted(found, key=lambda k: order.get(k, len(order)))}


def layer_cache(kv: KVCache | None, index: int) -> LayerCache | None:
    return kv.layers[index] if kv is not None else None


def kernels_of(module: nn.Module) -> dict[str, str]:
    """What a module runs: its class's kernels (an attention's QK-norm named by its norms' class), and what a fast
    module chose in its last forward (`ran`: cflib.model.fast)."""
    found = dict(type(module).kernels)
    if isinstance(module, Attention) and isinstance(module.q_norm, RMSNorm):
        found.setdefault("qk_norm", type(module.q_norm).kernels["rmsnorm"])
    return {**found, **getattr(module, "ran", {})}
