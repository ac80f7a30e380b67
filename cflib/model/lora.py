"""LoRA: trainable low-rank updates beside frozen base weights, on the reference and the fused paths.

A target weight W [out, in] becomes W + scale * B @ A with A [r, in], B [out, r]
and scale = alpha / r, as PEFT defines it (alpha / sqrt(r) under rank-stabilized
LoRA, PEFT's use_rslora; `scaling: rslora`): A starts kaiming-uniform (PEFT's
default), B at zero, so a fresh adapter leaves the model unchanged. The adapters
sit where PEFT puts them, so the model's own state-dict names are PEFT's less its
`base_model.model.` prefix: `layers.0.self_attn.q_proj.lora_A.weight`. Each
expert tensor [E, in, out] gets one adapter per expert, A [E, r, in] and
B [E, out, r], under `mlp.engine.expert_lora.<name>`; PEFT's layout for 3-D
parameters is written on export (cflib.export.peft). Optionally some rows of the
tied embedding train too (PEFT's trainable tokens): tokens a base never saw share
one collapsed embedding, which no adapter on the blocks can tell apart in the head.

DoRA (weight-decomposed LoRA, Liu et al. 2024; PEFT's use_dora; `dora: true`), on the
linear targets only (PEFT refuses it on 3-D parameters): the adapted weight is
m * (W + scale * B @ A) / ||W + scale * B @ A||, the norm per output feature (over
the input dimension) and detached from the gradient (the paper's section 4.3, as
PEFT computes it), m a trainable vector per output feature that starts at W's own
row norms, so a fresh adapter still leaves the model unchanged. Its state-dict name
is PEFT's saved one: `layers.0.self_attn.q_proj.lora_magnitude_vector`. The fused
paths fold it as they fold LoRA, reading its effective weight (DoraWeight, whose
backward keeps no weight-sized tensor: PEFT's gradients, from W, A and B apart);
with dropout its branch is PEFT's (m/n - 1) * W x' + (m/n) * scale * B A x' on the
dropped input x', which costs one more base GEMM per adapted weight.

Two forms of the same function:
- the reference (plain PyTorch, the decoder's reference modules):
  PEFT's textbook `base(x) + scale * B(A(dropout(x)))`, one branch per target;
- the fused paths (cflib.model.fast: one QKV GEMM, the wide TR-MoE GEMMs of cflib.ops.trmoe). With
  lora_dropout 0 they run on the effective weight W + scale * B @ A: weight-sized
  work, small next to the token-sized GEMMs of a 32k-token step; the fused GEMMs
  and kernels stay as they are, and autograd takes dA, dB from dW_eff without a
  base gradient being stored. The base-weight GEMM of the backward is still paid;
  a rank-r branch would skip it but read the token-sized activations and output
  gradients several more times (by estimate the same order of time at the 200M shapes),
  and could not reach the down projection inside the fused SwiGLU kernel without
  changing it. Under BF16 autocast the GEMM reads bf16(W + update): an update
  below W's bf16 resolution is rounded, as a full-parameter run's fp32 weights
  are when cast for the same GEMM. With dropout > 0 the update cannot fold into
  the weight (each token sees its own mask): the base GEMM runs frozen (no weight
  gradient) and each branch is added on its dropped input, the down projections'
  on the activation the fused kernel hands out for them.
The adapters reach both through the weight protocol of cflib.model.weights: the decoder never names them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cflib.model.decoder import EXPERT_TENSORS

if TYPE_CHECKING:
    from cflib.model.config import ModelConfig

# target -> where it lives in a decoder layer
TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "shared_gate": "mlp.engine.shared_gate", "shared_up": "mlp.engine.shared_up",
    "shared_down": "mlp.engine.shared_down", "expert_gate": "mlp.engine.expert_gate",
    "expert_up": "mlp.engine.expert_up", "expert_down": "mlp.engine.expert_down",
}
EXPERT_TARGETS = EXPERT_TENSORS
# The engine's ModuleDict of expert adapters: its name is part of the adapters' state-dict names (PEFT's, on export).
EXPERT_SLOT = "expert_lora"
LINEAR_TARGETS = tuple(name for name in TARGETS if name not in EXPERT_TARGETS)
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# How alpha and the rank give the update's scale: PEFT's alpha / r, or rank-stabilized LoRA's alpha / sqrt(r).
RANK_DIVISORS = {"standard": float, "rslora": math.sqrt}
SCALINGS = tuple(RANK_DIVISORS)
DORA_TARGETS = LINEAR_TARGETS  # PEFT's ParamWrapper (the expert tensors) refuses use_dora


@dataclass(frozen=True)
class LoraSettings:
    """What a LoRA run adapts and how; PEFT's defaults (rank 8, alpha 8, no dropout), every target."""

    rank: int = 8
    alpha: float = 8.0
    scaling: str = "standard"  # standard: alpha / rank; rslora: alpha / sqrt(rank) (PEFT's use_rslora)
    dora: bool = False  # weight-decomposed LoRA (PEFT's use_dora): a trainable magnitude per output feature
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)
    base_dtype: str = "float32"
    trainable_tokens: tuple[int, ...] = ()  # embedding rows (token ids) that train too: PEFT's trainable tokens

    def __post_init__(self) -> None:
        if self.dora and self.targets == tuple(TARGETS):  # the default targets: the ones DoRA can adapt
            object.__setattr__(self, "targets", DORA_TARGETS)
        if self.scaling not in SCALINGS:  # never a silent standard scale for a misspelt one
            raise ValueError(f"LoRA scaling must be one of {SCALINGS}, got {self.scaling!r}")
        experts = [t for t in self.targets if t not in DORA_TARGETS]
        if self.dora and experts:  # never a format PEFT cannot load
            raise ValueError(f"DoRA adapts the linear targets only ({', '.join(DORA_TARGETS)}), not {experts}")

    @property
    def scale(self) -> float:
        return self.alpha / RANK_DIVISORS[self.scaling](self.rank)

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets), "trainable_tokens": list(self.trainable_tokens)}

    @classmethod
    def from_dict(cls, raw: dict) -> "LoraSettings":
        """Settings saved before a key existed take its default: adapters saved without `scaling` are standard,
        without `dora` plain LoRA."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        return cls(**{**values, "targets": tuple(values.get("targets", TARGETS)),
                      "trainable_tokens": tuple(values.get("trainable_tokens", ()))})


def dropout_input(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """The adapter's input: x with dropout p while training (one function, so tests can fix the masks)."""
    return F.dropout(x, p, training) if p > 0 else x


class LoraLinear(nn.Linear):
    """nn.Linear with a frozen weight and a LoRA update; its forward is the reference form."""

    def __init__(self, base: nn.Linear, settings: LoraSettings) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the base weight is taken over, not re-created
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", None)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, settings.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(settings.rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init_lora_weights=True
        nn.init.zeros_(self.lora_B.weight)
        self.scale, self.dropout = settings.scale, settings.dropout
        self.last_form = "none"

    def folds(self) -> bool:
        return self.dropout == 0  # with dropout each token sees its own mask: no single effective weight

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(dropout_input(x, self.dropout, self.training))) * self.scale

    def delta(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scale

    def effective_weight(self) -> torch.Tensor:
        # Outside autocast fp32, the adapters' dtype (a BF16 base promoted); under BF16 autocast B @ A is a BF16
        # product, added to the base in the base's dtype.
        return self.weight + self.delta()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_form = "branch"
        return F.linear(x, self.weight) + self.branch(x)


def row_norms(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """||W + update|| per output feature ([out]), over the input dimension, in fp32 (fp64 for an fp64 weight)."""
    return torch.linalg.norm(weight.to(torch.promote_types(weight.dtype, torch.float32)) + update, dim=1)


def dora_factor(weight: torch.Tensor, update: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's m / ||W + update|| per output feature ([out]): the row norms detached, as PEFT's DoraLinearLayer
    computes them (the paper's section 4.3: no gradient flows through the norm)."""
    return magnitude / row_norms(weight.detach(), update.detach())


class DoraWeight(torch.autograd.Function):
    """DoRA's effective weight m * (W + s B A) / ||W + s B A|| (the norm detached), keeping from forward to backward
    only W (the parameter itself), A, B and two numbers per output feature: no weight-sized tensor of its own. The
    gradients are autograd's of the same expression (in fp32, fp64 for fp64 weights): with V = W + s B A,
    f = m / ||V|| and G the output's gradient, dm = rowsum(G * V) / ||V|| = (rowsum(G * W) + s rowsum((G A^T) * B))
    / ||V||, dB = s f (G A^T), dA = s (f B)^T G, so V is never rebuilt."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor,
                scale: float) -> torch.Tensor:
        update = (b @ a) * scale  # under BF16 autocast a BF16 product, as LoraLinear.delta's
        norm = row_norms(weight, update)  # dora_factor's, in fp32 at least
        factor = magnitude / norm
        ctx.save_for_backward(weight, a, b, norm, factor)
        ctx.scale = scale
        return factor.unsqueeze(1) * (weight + update)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, a, b, norm, factor = ctx.saved_tensors
        compute = torch.promote_types(grad.dtype, factor.dtype)  # fp32 at least (the norm's), fp64 in fp64
        grad, scale = grad.to(compute), ctx.scale
        projected = grad @ a.to(compute).t()  # G A^T [out, r]
        need_w, need_a, need_b, need_m, _ = ctx.needs_input_grad
        grad_w = (factor.unsqueeze(1) * grad).to(weight.dtype) if need_w else None
        grad_a = ((b.to(compute) * factor.unsqueeze(1)).t() @ grad * scale).to(a.dtype) if need_a else None
        grad_b = (projected * (factor * scale).unsqueeze(1)).to(b.dtype) if need_b else None
        grad_m = None
        if need_m:
            along = (grad * weight).sum(1) + scale * (projected * b.to(compute)).sum(1)  # rowsum(G * V)
            grad_m = (along / norm).to(factor.dtype)
        return grad_w, grad_a, grad_b, grad_m, None


class DoraLinear(LoraLinear):
    """A LoraLinear under DoRA: its weight's direction is W + scale * B @ A, its length per output feature the
    trainable `lora_magnitude_vector` (PEFT's name and init: the row norms of W + scale * B @ A, B zero: W's own,
    so a fresh adapter changes nothing)."""

    def __init__(self, base: nn.Linear, settings: LoraSettings) -> None:
        super().__init__(base, settings)
        with torch.no_grad():
            norms = row_norms(self.weight, super().delta())
        self.lora_magnitude_vector = nn.Parameter(norms)

    def factor(self) -> torch.Tensor:
        return dora_factor(self.weight, super().delta(), self.lora_magnitude_vector)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's DoRA forward less the base output: (f - 1) * W x' + f * scale * B A x', x' the dropped input."""
        dropped = dropout_input(x, self.dropout, self.training)
        factor = self.factor()
        low_rank = self.lora_B(self.lora_A(dropped)) * self.scale
        return (factor - 1) * F.linear(dropped, self.weight) + factor * low_rank

    def effective_weight(self) -> torch.Tensor:
        return DoraWeight.apply(self.weight, self.lora_A.weight, self.lora_B.weight, self.lora_magnitude_vector,
                                self.scale)

    def delta(self) -> torch.Tensor:
        """The whole update, effective weight less W (the protocol's; the fused paths read the effective weight)."""
        return self.effective_weight() - self.weight


class _Stack(nn.Module):
    """One LoRA factor for every expert, named `.weight` as PEFT's factors are."""

    def __init__(self, *shape: int, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=torch.float32))


class ExpertLora(nn.Module):
    """One adapter per expert of an [E, in, out] tensor: A [E, r, in], B [E, out, r]."""

    def __init__(self, base: torch.Tensor, settings: LoraSettings) -> None:
        super().__init__()
        experts, d_in, d_out = base.shape
        self.lora_A = _Stack(experts, settings.rank, d_in, device=base.device)
        self.lora_B = _Stack(experts, d_out, settings.rank, device=base.device)
        for matrix in self.lora_A.weight:  # per expert: a 3-D tensor's own fan-in would count E x r
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scale, self.dropout = settings.scale, settings.dropout
        self.last_form = "none"

    def folds(self) -> bool:
        return self.dropout == 0

    def delta(self) -> torch.Tensor:
        """[E, in, out], the stored layout of the expert tensor."""
        return torch.einsum("eri,eor->eio", self.lora_A.weight, self.lora_B.weight) * self.scale

    def branch_in(self, x: torch.Tensor) -> torch.Tensor:
        """[N, in] -> [N, E, out]: every expert's update on every token (dense, as the engine is)."""
        self.last_form = "branch"
        low = torch.einsum("ni,eri->ner", dropout_input(x, self.dropout, self.training), self.lora_A.weight)
        return torch.einsum("ner,eor->neo", low, self.lora_B.weight) * self.scale

    def branch_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, E, in] per-expert inputs -> [N, out], summed over experts."""
        self.last_form = "branch"
        low = torch.einsum("nei,eri->ner", dropout_input(hidden, self.dropout, self.training), self.lora_A.weight)
        return torch.einsum("ner,eor->no", low, self.lora_B.weight) * self.scale


class TrainableTokens(nn.Module):
    """New values for some rows of the (tied) embedding, PEFT's `trainable_tokens_delta`: rows the base never
    learned, e.g. the tokens of a new task, whose frozen embeddings the head could not tell apart."""

    def __init__(self, embedding: torch.Tensor, token_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("token_indices", torch.tensor(token_ids, dtype=torch.long, device=embedding.device),
                             persistent=False)
        # PEFT's convention: the parameter holds the rows' values (starting as the base's), not a difference.
        self.trainable_tokens_delta = nn.Parameter(embedding.detach()[self.token_indices].float().clone())


class LoraEmbedding(nn.Embedding):
    """The frozen embedding (and tied head) with some rows replaced by trainable ones."""

    def __init__(self, base: nn.Embedding, token_ids: tuple[int, ...]) -> None:
        nn.Module.__init__(self)  # the base weight is taken over, not re-created
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, base.max_norm, base.norm_type
        self.scale_grad_by_freq, self.sparse = base.scale_grad_by_freq, base.sparse
        self.weight = base.weight
        self.token_adapter = TrainableTokens(base.weight, token_ids)

    def effective_weight(self) -> torch.Tensor:
        rows = self.token_adapter.trainable_tokens_delta.to(self.weight.dtype)
        return self.weight.index_copy(0, self.token_adapter.token_indices, rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.effective_weight())


# --- attaching -------------------------------------------------------------------------------------

def _owner(layer: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    module = layer
    for part in parents:
        module = module[part] if isinstance(module, nn.ModuleDict) else getattr(module, part)
    return module, name


def attach_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze every base weight, add the adapters (fp32), and hold the frozen matrices in base_dtype.

    Embeddings (also the tied head the loss reads) and norms stay fp32 and frozen."""
    if has_lora(model):
        raise ValueError("the model already carries LoRA adapters")
    for param in model.parameters():
        param.requires_grad_(False)
    base_dtype = BASE_DTYPES[settings.base_dtype]
    for layer in model.layers:
        for name, param in layer.named_parameters():
            if param.dim() >= 2:
                param.data = param.data.to(base_dtype)
        for target in settings.targets:
            owner, name = _owner(layer, TARGETS[target])
            if target in EXPERT_TARGETS:
                owner.attach_expert_adapter(name, ExpertLora(getattr(owner, name), settings), EXPERT_SLOT)
            else:
                setattr(owner, name, (DoraLinear if settings.dora else LoraLinear)(getattr(owner, name), settings))
    if settings.trainable_tokens:
        vocab = model.embed_tokens.num_embeddings
        outside = [t for t in settings.trainable_tokens if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"lora_trainable_tokens: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        model.embed_tokens = LoraEmbedding(model.embed_tokens, settings.trainable_tokens)
    model.lora_settings = settings
    return model


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_settings", None) is not None


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name of the adapted weight's module (or expert tensor) -> its adapter."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            found[name] = module
        elif isinstance(module, ExpertLora):
            found[name.replace(f".{EXPERT_SLOT}.", ".")] = module
    return found


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by their names in the model (PEFT's, less `base_model.model.`)."""
    return {name: param for name, param in model.named_parameters() if is_adapter_name(name)}


def is_adapter_name(name: str) -> bool:
    return (".lora_A." in name or ".lora_B." in name or name.endswith(".lora_magnitude_vector")
            or name.endswith(".trainable_tokens_delta"))


@torch.no_grad()
def merge_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], settings: LoraSettings) -> None:
    """Add scale * B @ A into the base weights of a plain model, in fp32, in place (names of adapter_state_dict);
    under DoRA the weight becomes m * (W + scale * B @ A) / ||W + scale * B @ A||, as PEFT merges it."""
    scale = settings.scale
    params = dict(model.named_parameters())
    rows = adapters.get("embed_tokens.token_adapter.trainable_tokens_delta")
    if rows is not None:
        embedding = params["embed_tokens.weight"]
        index = torch.tensor(settings.trainable_tokens, dtype=torch.long, device=embedding.device)
        embedding.index_copy_(0, index, rows.to(embedding.device, embedding.dtype))
    for target_name, param in params.items():
        module_name, _, leaf = target_name.rpartition(".")
        if leaf in EXPERT_TARGETS:
            prefix = f"{module_name}.{EXPERT_SLOT}.{leaf}"
            if f"{prefix}.lora_A.weight" in adapters:
                a, b = (adapters[f"{prefix}.lora_{f}.weight"].to(param.device, torch.float32) for f in "AB")
                param.add_(torch.einsum("eri,eor->eio", a, b) * scale)
        elif leaf == "weight" and f"{module_name}.lora_A.weight" in adapters:
            a, b = (adapters[f"{module_name}.lora_{f}.weight"].to(param.device, torch.float32) for f in "AB")
            magnitude = adapters.get(f"{module_name}.lora_magnitude_vector")
            if magnitude is None:
                param.add_((b @ a) * scale)
            else:
                update = (b @ a) * scale
                factor = dora_factor(param, update, magnitude.to(param.device, torch.float32))
                param.copy_(factor.unsqueeze(1) * (param.float() + update))


def lora_kernel_path(model: nn.Module) -> dict[str, str]:
    """How the adapters ran in the last forward (read back), for the run record; {} without adapters."""
    forms = sorted({m.last_form for m in adapter_modules(model).values()})
    return {"lora": "+".join(forms)} if forms else {}


def describe(model: nn.Module) -> dict:
    """Settings and parameter counts of an adapted model, for the record."""
    settings: LoraSettings = model.lora_settings
    adapter = sum(p.numel() for p in adapter_state_dict(model).values())
    total = sum(p.numel() for p in model.parameters())
    return {**settings.to_dict(), "scale": settings.scale, "adapter_parameters": adapter,
            "base_parameters": total - adapter}


def base_bytes(config: ModelConfig, base_dtype: str = "float32") -> int:
    """The bytes of a model of `config` held as attach_lora holds a frozen base, without building it: its layers'
    matrices in base_dtype, its embeddings (the tied head) and norms in float32 (a distillation teacher is held so
    too: cflib.train.teacher)."""
    d = config.hidden_size
    norms = config.num_hidden_layers * (2 * d + (2 * config.head_dim if config.use_qk_norm else 0)) + d
    embeddings = config.vocab_size * d
    matrices = config.num_parameters() - norms - embeddings
    return BASE_DTYPES[base_dtype].itemsize * matrices + 4 * (norms + embeddings)


def adapter_parameter_count(config: ModelConfig, settings: LoraSettings) -> int:
    """Trainable parameters LoRA adds to a model of `config`, without building it."""
    d, hd = config.hidden_size, config.head_dim
    q, kv, s = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.shared_intermediate_size
    e, w = config.num_experts, config.expert_width
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "shared_gate": (d, s),
              "shared_up": (d, s), "shared_down": (s, d), "expert_gate": (d, w), "expert_up": (d, w),
              "expert_down": (w, d)}
    per_layer = sum(settings.rank * sum(shapes[t]) * (e if t in EXPERT_TARGETS else 1) for t in settings.targets)
    if settings.dora:  # one magnitude per output feature of each adapted weight
        per_layer += sum(shapes[t][1] for t in settings.targets)
    return per_layer * config.num_hidden_layers + len(settings.trainable_tokens) * d
