"""The decoder's fast modules, and the swap that puts them in place of the reference ones.

Each fast module subclasses its reference module (cflib.model.decoder), adds no parameter or buffer, and
overrides the computation it replaces, so state dicts, adapters and checkpoints do not change with the
kernels. `use_kernels(model, kernels)` gives every module the class a KernelChoice (cflib.ops.dispatch) names,
as Liger swaps modules, and the same model swaps back to the reference.

- norms: Liger's RMSNorm; on cflib's path the residual add and the norm after it in one kernel
  (cflib.ops.add_rms_norm), whose backward reads the norm's output, or keeps the sum where a weight is zero:
  the blocks then hand each sub-layer's output on to the next norm instead of adding it themselves
  (FusedResidualLayer, FusedResidualModel);
- attention: Liger's RoPE; or one QKV GEMM, with QK-norm and RoPE in one kernel (cflib.ops.qk_norm_rope);
- the TR-MoE block: Liger's SwiGLU for the shared branch; or the whole block as one wide SwiGLU
  (cflib.ops.trmoe); on Hopper with quack-kernels, its SwiGLU in quack's GEMM epilogues;
- what a run sets before step 1 (cflib.train.execution): the BF16 weight copies the fused GEMMs read
  (attach_weight_copies), the TR-MoE activations kept for backward (keep_activations), checkpointed layers
  (checkpoint_layers).
Each class names what it runs (`kernels`); a fast module that chooses per forward records what it chose in
`ran` (the weights it read, the activation kept), which TRMoEModel.kernel_path() reads back. Adapters join the
fused GEMMs through the weight protocol (cflib.model.weights): with updates that fold, the GEMMs read effective
weights; otherwise the base GEMM runs and each adapter adds its branch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch.utils.checkpoint import checkpoint

from cflib.model.config import ModelConfig
from cflib.model.decoder import (
    EXPERT_TENSORS,
    Attention,
    DecoderLayer,
    RMSNorm,
    TRMoEEngine,
    TRMoEModel,
    apply_rope,
    attend_rows,
    layer_cache,
)
from cflib.model.kv_cache import KVCache, LayerCache
from cflib.model.weight_copies import WeightCopies, columns, reads_half, rows
from cflib.model.weights import effective_weight, is_adapted
from cflib.ops.attention import DENSE_SDPA, AttentionBatch, PackedDocuments
from cflib.ops.dispatch import KernelChoice
from cflib.ops.gemm import TORCH_GEMMS, Gemms
from cflib.ops.rows import Rows, gather_rows


class LigerRMSNorm(RMSNorm):
    kernels = {"rmsnorm": "liger"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cflib.ops.liger import LigerRMSNormFunction
        # "gemma" casting: normalise and scale in fp32, cast once at the end, as the reference does.
        return LigerRMSNormFunction.apply(x, self.weight, self.eps, 0.0, "gemma", False)


class AddRMSNorm(RMSNorm):
    """The residual add and the norm in one kernel: the residual stream stays fp32, the norm comes out for
    the GEMM after it, and backward recovers the normalised sum from that output (cflib.ops.add_rms_norm)."""

    kernels = {"rmsnorm": "cflib_add_rmsnorm"}
    normed_from_output = True

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm), the residual stream's add and the norm after it; delta None adds nothing."""
        from cflib.ops.add_rms_norm import add_rms_norm
        return add_rms_norm(h, delta, self.weight, self.eps, self.normed_from_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x, None)[1]


class AddRMSNormKeptSum(AddRMSNorm):
    """AddRMSNorm for a weight with a zero, whose output has lost the sum in that column: backward keeps the sum
    (in the compute dtype) instead."""

    normed_from_output = False


def _residual_norm(norm: RMSNorm, fast: type[RMSNorm]) -> type[RMSNorm]:
    """The class a residual norm takes: AddRMSNormKeptSum where its weight holds a zero (one host read, at the
    swap)."""
    if fast is AddRMSNorm and (norm.weight.is_meta or bool((norm.weight == 0).any())):
        return AddRMSNormKeptSum
    return fast


def fused_linear(x: torch.Tensor, modules: tuple[nn.Module, ...]) -> torch.Tensor:
    """One GEMM over the concatenated weights of `modules` (q|k|v, or o alone), adapters included."""
    adapted = [m for m in modules if is_adapted(m)]
    if not adapted or adapted[0].folds():
        for module in adapted:
            module.last_form = "effective_weight"
        weights = [effective_weight(m) for m in modules]
        return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(weights))
    base = F.linear(x, modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules]))
    for module in adapted:
        module.last_form = "separate_branch"
    return base + torch.cat([m.branch(x) if is_adapted(m) else base.new_zeros(*base.shape[:-1], m.out_features)
                             for m in modules], dim=-1)


class FastAttention(Attention):
    """The attention forward in the steps where the fast paths differ: q, k and v projected, normed and rotated
    (`project`), attended, and the output projection (`output`); the reference's arithmetic as it stands."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBatch = DENSE_SDPA, kv: LayerCache | None = None,
                rows: Rows | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)  # [B, H, T, hd] each
        return self.output(attend_rows(q, k, v, attention, kv, rows))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, H, T, hd], normed and rotated."""
        return self.norm_and_rotate(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, T, H x hd] -> [B, H, T, hd], with QK-norm and RoPE on q and k."""
        heads = (*q.shape[:2], -1, self.head_dim)
        q, k = self.rope(self.q_norm(q.reshape(heads)), self.k_norm(k.reshape(heads)), cos, sin)
        return q, k, v.reshape(heads).transpose(1, 2)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, H, hd] in, [B, H, T, hd] out."""
        return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)


class LigerRopeAttention(FastAttention):
    kernels = {"qkv": "three_gemms", "rope": "liger"}

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        from cflib.ops.liger import LigerRopeFunction
        return LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, T, hd]


class FusedQKVAttention(FastAttention):
    """One GEMM for q, k and v (the input is cast and read once) and the output through the same path; with
    weight copies (attach_weight_copies), both GEMMs read BF16 copies of their weights under BF16 autocast."""

    kernels = {"qkv": "fused_gemm", "rope": "torch"}
    weight_copies: WeightCopies | None = None
    copies_prefix = ""

    def copy_weights(self, copies: WeightCopies, prefix: str) -> None:
        q, k, v, o = (m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
        edges = [0, q.shape[0], q.shape[0] + k.shape[0], q.shape[0] + k.shape[0] + v.shape[0]]
        copies.add(f"{prefix}.qkv", (q, k, v), tuple(rows(a, b) for a, b in zip(edges, edges[1:])),
                   (edges[-1], q.shape[1]))
        copies.add(f"{prefix}.o", (o,), (rows(0, o.shape[0]),), tuple(o.shape))
        self.weight_copies, self.copies_prefix = copies, prefix

    def gemm(self, x: torch.Tensor, part: str, modules: tuple[nn.Module, ...]) -> torch.Tensor:
        copies = self.weight_copies
        self.copies_read = copies is not None and reads_half(x, copies.dtype) and not any(map(is_adapted, modules))
        if self.copies_read:
            return copies.linear(x, f"{self.copies_prefix}.{part}")
        return fused_linear(x, modules)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        self.ran = {} if self.weight_copies is None else {
            "weights": "bf16_copies" if self.copies_read else "fp32_masters"}
        return out

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.gemm(x, "qkv", (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = qkv.split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], -1)
        return self.norm_and_rotate(q, k, v, cos, sin)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.gemm(out, "o", (self.o_proj,))


class FusedAttention(FusedQKVAttention):
    """The QKV GEMM, then QK-norm and RoPE in one kernel that also splits q, k and v (models with QK-norm); its
    backward recovers the normed heads from q and k, which attention keeps anyway, so qkv is freed after
    forward (cflib.ops.qk_norm_rope.QKVNormRope)."""

    kernels = {"qkv": "fused_gemm", "rope": "cflib_qk_norm_rope", "qk_norm": "cflib_qk_norm_rope",
               "qk_norm_backward": "from_output"}
    normed_from_output = True

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from cflib.ops.qk_norm_rope import qkv_norm_rope
        batch, seq, _ = x.shape
        qkv = self.gemm(x, "qkv", (self.q_proj, self.k_proj, self.v_proj)).view(batch * seq, -1)
        q, k, v = qkv_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, batch, seq,
                                self.num_heads, self.num_kv_heads, self.q_norm.eps, self.normed_from_output)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class FusedAttentionKeptQKV(FusedAttention):
    """FusedAttention for head-norm weights that q and k cannot give back the normed heads through (a zero, or
    a rotation pair too far apart: cflib.ops.qk_norm_rope.normed_from_output_fits), or for RoPE tables scaled by
    YaRN's attention factor: backward keeps qkv."""

    kernels = {**FusedAttention.kernels, "qk_norm_backward": "kept_qkv"}
    normed_from_output = False


def _attention(attention: Attention, fast: type[Attention], rope_factor: float) -> type[Attention]:
    """The class an attention takes: FusedAttentionKeptQKV where its head norms' weights do not fit recovery from
    the output (one host read each, at the swap), or where RoPE's tables carry YaRN's attention factor
    (`rope_factor`): the recovery undoes a rotation, and a scaled one is no rotation."""
    from cflib.ops.qk_norm_rope import normed_from_output_fits
    if fast is FusedAttention and (rope_factor != 1.0 or not all(normed_from_output_fits(norm.weight)
                                                                 for norm in (attention.q_norm, attention.k_norm))):
        return FusedAttentionKeptQKV
    return fast


class LigerSwiGLUEngine(TRMoEEngine):
    kernels = {"swiglu": "liger", "moe": "torch_dense"}

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        from cflib.ops.liger import LigerSiLUMulFunction
        return LigerSiLUMulFunction.apply(gate, up)


class FusedTRMoEEngine(TRMoEEngine):
    """The block as one wide SwiGLU over the shared and every expert's columns (cflib.ops.trmoe), with the
    engine's adapters: effective weights where their updates fold, else the frozen block plus each branch on
    its dropped input. With weight copies (attach_weight_copies) the block's two GEMMs read BF16 copies of their
    fused weights under BF16 autocast."""

    kernels = {"swiglu": "triton_fused", "moe": "triton_fused"}
    weight_copies: WeightCopies | None = None
    copies_prefix = ""
    # The activation kept from forward to backward instead of recomputed there (keep_activations sets it per layer).
    keep_activation = False

    interleaved_gate_up = False  # the gate|up copy's rows: gate rows then up rows, or each gate row then its up

    def copy_weights(self, copies: WeightCopies, prefix: str) -> None:
        """gate|up [2C, D] and down [D, C] as cflib.ops.trmoe.fused_weights lays them out (gate|up interleaved row
        by row, as cflib.ops.trmoe.interleave_gate_up, where interleaved_gate_up)."""
        num_experts, hidden, width = self.expert_gate.shape
        shared = self.shared_gate.weight.shape[0]
        columns_total = shared + num_experts * width

        def half_rows(up: bool, first: int, count: int, experts: bool = False):
            """Rows first..first + count of the gate (or up) half, in the copy's layout; the experts' seen as
            expert_gate's [E, D, W]."""
            start, step = (2 * first + up, 2) if self.interleaved_gate_up else (first + up * columns_total, 1)
            if experts:
                return lambda copy: copy[start:start + step * count:step].unflatten(0, (num_experts, width)).mT
            return lambda copy: copy[start:start + step * count:step]

        masters = (self.shared_gate.weight, self.expert_gate, self.shared_up.weight, self.expert_up)
        copies.add(f"{prefix}.gate_up", masters,
                   tuple(half_rows(up, *span) for up in (False, True)
                         for span in ((0, shared), (shared, num_experts * width, True))),
                   (2 * columns_total, hidden))
        copies.add(f"{prefix}.down", (self.shared_down.weight, self.expert_down),
                   (columns(0, shared), lambda copy: copy[:, shared:].t().unflatten(0, (num_experts, width))),
                   (hidden, columns_total))
        self.weight_copies, self.copies_prefix = copies, prefix

    def reads_copies(self, x: torch.Tensor) -> bool:
        return reads_half(x, self.weight_copies.dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        self.ran = {}  # what this forward chose: the weights it read (block), then how it keeps its activation
        out = super().forward(x, token_ids)
        self.ran["swiglu_activation"] = "kept" if self.keep_activation else "recomputed"
        return out

    def from_copies(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        from cflib.ops.trmoe import trmoe_forward
        copies, prefix = self.weight_copies, self.copies_prefix
        return trmoe_forward(self, x, token_ids, fused=(None, copies.weight(f"{prefix}.down")),
                             gate_up_gemm=lambda rows: copies.linear(rows, f"{prefix}.gate_up"),
                             keep_activation=self.keep_activation)

    def block(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        from cflib.ops.trmoe import engine_weights, trmoe_forward

        adapters = {name: m for name in ("shared_gate", "shared_up", "shared_down")
                    if is_adapted(m := getattr(self, name))}
        adapters.update(self.expert_adapters())
        copies = self.weight_copies
        if copies is not None:
            read = not adapters and self.reads_copies(x)
            self.ran["weights"] = "bf16_copies" if read else "fp32_masters"
            if read:
                return self.from_copies(x, token_ids)
        if not adapters:
            return trmoe_forward(self, x, token_ids, keep_activation=self.keep_activation)
        weights = engine_weights(self)
        if next(iter(adapters.values())).folds():
            for name, adapter in adapters.items():
                adapter.last_form = "effective_weight"
                # a linear adapter's effective weight as it offers it (DoRA's is no sum of W and an update)
                weights[name] = (weights[name] + adapter.delta() if name in EXPERT_TENSORS
                                 else effective_weight(adapter))
            return trmoe_forward(self, x, token_ids, weights=weights, keep_activation=self.keep_activation)
        return self._with_branches(x, token_ids, weights, adapters)

    def _with_branches(self, x: torch.Tensor, token_ids: torch.Tensor, weights: dict[str, torch.Tensor],
                       adapters: dict) -> torch.Tensor:
        from cflib.ops.trmoe import trmoe_forward

        num_tokens, (num_experts, _, width) = x.shape[0], self.expert_gate.shape

        def update(name: str) -> torch.Tensor | None:
            if name not in adapters:
                return None
            if name in EXPERT_TENSORS:
                return adapters[name].branch_in(x).reshape(num_tokens, num_experts * width)
            return adapters[name].branch(x)

        shared = self.shared_gate.weight.shape[0]
        pieces = [(update(n), c) for n, c in (("shared_gate", shared), ("expert_gate", num_experts * width),
                                               ("shared_up", shared), ("expert_up", num_experts * width))]
        gate_up_delta = None
        if any(piece is not None for piece, _ in pieces):
            like = next(piece for piece, _ in pieces if piece is not None)
            gate_up_delta = torch.cat([piece if piece is not None else like.new_zeros(num_tokens, columns)
                                       for piece, columns in pieces], dim=1)
        out, hidden = trmoe_forward(self, x, token_ids, weights=weights, gate_up_delta=gate_up_delta,
                                    return_hidden=True, keep_activation=self.keep_activation)
        # hidden carries each column's output scale, and dropout's mask commutes with it: by linearity these
        # are the reference's scaled branches.
        if "shared_down" in adapters:
            out = out + adapters["shared_down"].branch(hidden[:, :shared])
        if "expert_down" in adapters:
            out = out + adapters["expert_down"].branch_out(hidden[:, shared:].reshape(num_tokens, num_experts, width))
        for adapter in adapters.values():  # after the branches, which the adapters note as their reference form
            adapter.last_form = "separate_branch"
        return out


class EpilogueSwiGLUEngine(FusedTRMoEEngine):
    """Training steps in half precision run the block through quack's SwiGLU GEMMs (cflib.ops.trmoe.
    GatedSwiGLUDown): the gate|up GEMM writes silu(gate) * up from its epilogue, the backward GEMM the
    activation's derivative from its own, and a small kernel applies the experts' per-token scales; with weight
    copies the GEMMs read them, gate and up interleaved row by row as quack's epilogue pairs them. Elsewhere
    (fp32 activations, which quack's epilogue does not write; no gradients, evaluation and decoding; adapters)
    the block runs as FusedTRMoEEngine's over the FP32 masters."""

    kernels = {"swiglu": "quack_gemm_swiglu", "moe": "triton_fused"}
    interleaved_gate_up = True

    def gated(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (reads_half(x, torch.bfloat16) or reads_half(x, torch.float16))

    def reads_copies(self, x: torch.Tensor) -> bool:
        return self.gated(x) and reads_half(x, self.weight_copies.dtype)

    def from_copies(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        from cflib.ops.trmoe import trmoe_gated_forward
        copies, prefix = self.weight_copies, self.copies_prefix
        return trmoe_gated_forward(self, x, token_ids, (copies.parts(f"{prefix}.gate_up"),
                                                        copies.parts(f"{prefix}.down")), gemms=copies.gemms,
                                   keep_activation=self.keep_activation)

    def block(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        from cflib.ops.trmoe import trmoe_gated_forward

        adapted = self.expert_adapters() or any(is_adapted(getattr(self, name))
                                                for name in ("shared_gate", "shared_up", "shared_down"))
        if not self.gated(x) or adapted:
            self.ran.update(FusedTRMoEEngine.kernels)
        elif self.weight_copies is None:
            return trmoe_gated_forward(self, x, token_ids, keep_activation=self.keep_activation)
        return super().block(x, token_ids)


class FusedResidualLayer(DecoderLayer):
    """The block on cflib's path: its residual adds run inside the next norm's kernel (AddRMSNorm), so it takes
    the stream with the previous block's TR-MoE output still to add (`pending`) and hands its own on the same
    way, (h, pending); the arithmetic is the reference block's."""

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBatch = DENSE_SDPA, kv: LayerCache | None = None, rows: Rows | None = None,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.input_layernorm.add_norm(h, pending)
        attended = self.self_attn(x, cos, sin, attention, kv, rows)
        if rows is not None:
            h, token_ids = gather_rows(h, rows), token_ids.reshape(-1).index_select(0, rows.indices)
        h, x = self.post_attention_layernorm.add_norm(h, attended)
        return h, self.mlp["engine"](x, token_ids)


class FusedResidualModel(TRMoEModel):
    """The decoder on cflib's path: each block's last output is added by the next block's first norm, the last
    one's by the final norm (FusedResidualLayer)."""

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | PackedDocuments | None = None,
                kv: KVCache | None = None, rows: Rows | None = None,
                example_lengths: torch.Tensor | None = None) -> torch.Tensor:
        h, cos, sin, attention = self.embed(input_ids, document_ids, kv, rows, example_lengths)
        pending, last = None, len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            h, pending = layer(h, input_ids, cos, sin, attention, layer_cache(kv, index),
                               rows if index == last else None, pending=pending)
        return self.norm.add_norm(h, pending)[1]


class Checkpointed:
    """A block recomputed in backward while training (activation checkpointing): only its input is kept."""

    def forward(self, *args, **kwargs):
        if not self.training:
            return super().forward(*args, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


class CheckpointedLayer(Checkpointed, DecoderLayer):
    pass


class CheckpointedFusedResidualLayer(Checkpointed, FusedResidualLayer):
    pass


_CHECKPOINTED = {DecoderLayer: CheckpointedLayer, FusedResidualLayer: CheckpointedFusedResidualLayer}


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Make `module` an instance of `cls`, a fast or reference variant of its own class (same state)."""
    families = (RMSNorm, Attention, TRMoEEngine, DecoderLayer, TRMoEModel)
    reference = next((ref for ref in families if issubclass(cls, ref)), None)
    if reference is None or not isinstance(module, reference):
        raise TypeError(f"a {type(module).__name__} cannot become a {cls.__name__}")
    module.__class__ = cls


def _layer_class(fused_residual: bool, checkpointed: bool) -> type[DecoderLayer]:
    layer = FusedResidualLayer if fused_residual else DecoderLayer
    return _CHECKPOINTED[layer] if checkpointed else layer


def use_kernels(model: TRMoEModel, kernels: KernelChoice) -> TRMoEModel:
    """Give every module of `model` the implementation `kernels` chooses (in place; returns the model);
    checkpointed layers stay checkpointed."""
    model.attention_backend = kernels.attention
    residual_norm = AddRMSNorm if kernels.custom else LigerRMSNorm if kernels.liger else RMSNorm
    head_norm = LigerRMSNorm if kernels.liger else RMSNorm
    if kernels.custom:
        attention = FusedAttention if model.config.use_qk_norm else FusedQKVAttention
    else:
        attention = LigerRopeAttention if kernels.liger else Attention
    if kernels.custom:
        engine = EpilogueSwiGLUEngine if kernels.epilogue_swiglu else FusedTRMoEEngine
    else:
        engine = LigerSwiGLUEngine if kernels.liger else TRMoEEngine
    for layer in model.layers:
        swap_class(layer, _layer_class(kernels.custom, isinstance(layer, Checkpointed)))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            swap_class(norm, _residual_norm(norm, residual_norm))
        swap_class(layer.self_attn, _attention(layer.self_attn, attention, model.rope_attention_factor))
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if isinstance(norm, RMSNorm):
                swap_class(norm, head_norm)
        swap_class(layer.mlp["engine"], engine)
    swap_class(model.norm, _residual_norm(model.norm, residual_norm))
    swap_class(model, FusedResidualModel if kernels.custom else TRMoEModel)
    return model


def checkpoint_layers(model: TRMoEModel, on: bool = True) -> TRMoEModel:
    """Every block of `model` recomputed in backward while training (on), or keeping its activations (off)."""
    for layer in model.layers:
        swap_class(layer, _layer_class(isinstance(layer, FusedResidualLayer), on))
    return model


def keep_activations(model: TRMoEModel, layers: int) -> TRMoEModel:
    """The first `layers` blocks' fused TR-MoE engines keep their activation from forward to backward instead of
    recomputing it in the backward kernel: faster, for 2 bytes x the block's width a token in each. The
    reference engines' autograd keeps what it keeps."""
    if not 0 <= layers <= len(model.layers):
        raise ValueError(f"kept_swiglu_layers: {layers} layers, the model has {len(model.layers)}")
    for index, layer in enumerate(model.layers):
        layer.mlp["engine"].keep_activation = index < layers
    return model


def attach_weight_copies(model: TRMoEModel, dtype: torch.dtype = torch.bfloat16, head: bool = False,
                         gemms: Gemms = TORCH_GEMMS) -> WeightCopies:
    """BF16 copies (cflib.model.weight_copies) of the fused GEMMs' weights, which the fused attention and the
    whole-block TR-MoE engine read from now on under autocast in `dtype`; the caller refreshes them after each
    optimizer step. `head`: also the tied head's ("head", for a loss that computes in `dtype`; the embedding
    lookup keeps reading the FP32 table). `gemms`: how the GEMMs that read the copies run (cflib.ops.gemm)."""
    copies = WeightCopies(dtype, gemms)
    if head and type(model.embed_tokens) is nn.Embedding:
        table = model.embed_tokens.weight
        copies.add("head", (table,), (rows(0, table.shape[0]),), tuple(table.shape))
    for index, layer in enumerate(model.layers):
        if isinstance(layer.self_attn, FusedQKVAttention):
            layer.self_attn.copy_weights(copies, f"layers.{index}.self_attn")
        if isinstance(layer.mlp["engine"], FusedTRMoEEngine):
            layer.mlp["engine"].copy_weights(copies, f"layers.{index}.mlp")
    return copies


def detach_weight_copies(model: TRMoEModel) -> None:
    """Every module of `model` reads its masters again (copies attached earlier are no longer refreshed)."""
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp["engine"]):
            if isinstance(module, (FusedQKVAttention, FusedTRMoEEngine)):
                module.weight_copies = None


def build_model(config: ModelConfig, kernels: KernelChoice, build_routes: bool = True) -> TRMoEModel:
    """A model of `config` whose modules are the implementations `kernels` chooses."""
    return use_kernels(TRMoEModel(config, build_routes), kernels)
