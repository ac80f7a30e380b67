"""Independent reference for the TR-MoE decoder and its public file formats.

Written from docs/formats.md alone, deliberately without importing
cflib, so that parity tests compare two implementations that share no code.
Everything here favours being obviously right over being fast: the forward
pass handles one sequence at a time in float64 with explicit loops.

Public surface:
    write_public_checkpoint(path, cfg, seed)
    load_public_checkpoint(path) -> (state, cfg)
    write_public_shard(root, partition, examples, vocab_size, eos_token_id, max_seq_len)
    reference_logits(state, cfg, input_ids) -> [T, V]
    reference_eval_loss(state, cfg, shard_examples) -> float
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

IGNORE_INDEX = -100
SHARD_FORMAT = "complexity-sft-token-shard-v2"

# Keys of config.json listed in docs/formats.md#the-released-200m-configuration.
CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "use_qk_norm",
    "norm_eps",
    "rope_theta",
    "vocab_size",
    "max_position_embeddings",
    "shared_intermediate_size",
    "num_experts",
    "intermediate_size",
    "num_experts_per_tok",
    "top_k_primary_weight",
    "routing_strategy",
    "route_hash_count",
    "shared_output_scale",
    "routed_output_scale",
    "tie_word_embeddings",
)


# ---------------------------------------------------------------------------
# Shapes derived from the config
# ---------------------------------------------------------------------------


def head_dim(cfg: dict) -> int:
    """head_dim is not a separate key in the table of docs/formats.md#the-released-200m-configuration;
    it is hidden / heads (896 / 14 = 64). An explicit "head_dim" key, if present, wins."""
    return int(cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))


def expert_width(cfg: dict) -> int:
    """intermediate_size is the *total* routed width (256 = 4 experts x 64).
    This reading is the one that reproduces the 201,194,368 parameter count."""
    if cfg["intermediate_size"] % cfg["num_experts"]:
        raise ValueError("intermediate_size must be divisible by num_experts")
    return cfg["intermediate_size"] // cfg["num_experts"]


def route_weights(cfg: dict) -> list[float]:
    """w_0 = top_k_primary_weight; the remaining mass is split equally."""
    top_k = int(cfg["num_experts_per_tok"])
    primary = float(cfg["top_k_primary_weight"])
    if top_k == 1:
        return [primary]
    return [primary] + [(1.0 - primary) / (top_k - 1)] * (top_k - 1)


def public_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Exact public tensor names and shapes (docs/formats.md#the-checkpoint-layout)."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    s, e, w = cfg["shared_intermediate_size"], cfg["num_experts"], expert_width(cfg)
    top_k = cfg["num_experts_per_tok"]
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (hq * hd, d),
                p + "self_attn.k_proj.weight": (hkv * hd, d),
                p + "self_attn.v_proj.weight": (hkv * hd, d),
                p + "self_attn.o_proj.weight": (d, hq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.engine.shared_gate.weight": (s, d),
                p + "mlp.engine.shared_up.weight": (s, d),
                p + "mlp.engine.shared_down.weight": (d, s),
                p + "mlp.engine.expert_gate": (e, d, w),
                p + "mlp.engine.expert_up": (e, d, w),
                p + "mlp.engine.expert_down": (e, w, d),
                p + "mlp.engine.route_table": (top_k, v),
            }
        )
    shapes["norm.weight"] = (d,)
    return shapes


# ---------------------------------------------------------------------------
# Checkpoint writer / reader
# ---------------------------------------------------------------------------


def _random_route_table(cfg: dict, gen: torch.Generator) -> torch.Tensor:
    """[top_k, V] int64 with distinct experts per token, drawn at random.

    Random rather than modulo-cyclic on purpose: a loader that rebuilds the
    table instead of using the stored one produces different logits."""
    v, e, top_k = cfg["vocab_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
    if top_k > e:
        raise ValueError("num_experts_per_tok cannot exceed num_experts")
    # argsort of i.i.d. noise gives a uniformly random permutation per token.
    perms = torch.argsort(torch.rand(v, e, generator=gen), dim=1)
    return perms[:, :top_k].T.contiguous().to(torch.int64)


def _derived_buffers(cfg: dict, route_tables: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The derived buffers of docs/formats.md#derived-buffers.

    inv_freq is the RoPE frequency vector; fused_expert_pairs lists every pair
    a < b of experts; fused_route_codes packs each token's (first, second)
    route as the index of its pair plus a swap bit. Written token by token, in
    plain Python, to stay independent of cflib's vectorised version."""
    hd = head_dim(cfg)
    e, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    inv_freq = 1.0 / (
        float(cfg["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    )
    pairs = [(a, b) for a in range(e) for b in range(a + 1, e)]
    out: dict[str, torch.Tensor] = {}
    for i, table in enumerate(route_tables):
        routes = table.T.tolist()
        if top_k == 2 and 2 <= e <= 8 and all(r0 != r1 for r0, r1 in routes):
            swap_value = 8 if len(pairs) <= 8 else 32
            codes = [pairs.index((min(r0, r1), max(r0, r1))) + (swap_value if r0 > r1 else 0)
                     for r0, r1 in routes]
            code_tensor = torch.tensor(codes, dtype=torch.uint8)
            pair_tensor = torch.tensor(pairs, dtype=torch.int32)
        else:
            code_tensor = torch.zeros(0, dtype=torch.uint8)
            pair_tensor = torch.zeros(0, 2, dtype=torch.int32)
        p = f"layers.{i}."
        out[p + "self_attn.rotary_emb.inv_freq"] = inv_freq.to(torch.float32)
        out[p + "mlp.engine.fused_route_codes"] = code_tensor
        out[p + "mlp.engine.fused_expert_pairs"] = pair_tensor
    return out


def write_public_checkpoint(
    path: str | Path,
    cfg: dict,
    seed: int,
    *,
    derived_buffers: bool = True,
    std: float = 0.02,
) -> None:
    """Write config.json + model.safetensors in the public layout, F32 weights.

    Norm weights are 1 + 0.1*randn (not all ones) so that a missing or
    misplaced norm weight changes the output."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    state: dict[str, torch.Tensor] = {}
    route_tables: list[torch.Tensor] = []
    for name, shape in public_tensor_shapes(cfg).items():
        if name.endswith("route_table"):
            table = _random_route_table(cfg, gen)
            route_tables.append(table)
            state[name] = table
        elif len(shape) == 1:  # every 1-D float tensor in the layout is a norm weight
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = std * torch.randn(shape, generator=gen)
    if derived_buffers:
        state.update(_derived_buffers(cfg, route_tables))
    state = {k: (v if not v.dtype.is_floating_point else v.to(torch.float32)).contiguous()
             for k, v in state.items()}

    config = {key: cfg[key] for key in CONFIG_KEYS}
    # Extra keys a Hugging Face style export typically carries; must be harmless.
    config.update(
        {
            "architectures": ["ComplexityForCausalLM"],
            "model_type": "complexity",
            "torch_dtype": "float32",
            "head_dim": head_dim(cfg),
        }
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(path / "model.safetensors"))


def load_public_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a public checkpoint back with plain safetensors + json."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    return load_file(str(path / "model.safetensors")), cfg


# ---------------------------------------------------------------------------
# SFT token shard writer
# ---------------------------------------------------------------------------


def build_example(
    prompt_ids: Sequence[int], answer_ids: Sequence[int], eos_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens = prompt + answer + [eos]; labels causally aligned.

    labels[j] = tokens[j + 1] whenever tokens[j + 1] is part of answer + eos,
    else -100; the final position predicts nothing and is -100."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt must be non-empty: the first answer token needs a predictor")
    tokens = list(prompt_ids) + list(answer_ids) + [eos_token_id]
    labels = [IGNORE_INDEX] * len(tokens)
    for j in range(len(prompt_ids) - 1, len(tokens) - 1):
        labels[j] = tokens[j + 1]
    return np.asarray(tokens, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_public_shard(
    root: str | Path,
    partition: str,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    vocab_size: int,
    eos_token_id: int,
    max_seq_len: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Write root/partition/{input_ids.bin, labels.bin, examples.jsonl, sft.idx.json}.

    Returns the per-example (input_ids, labels) arrays, exactly what was
    written, so callers can feed them to reference_eval_loss."""
    out_dir = Path(root) / partition
    out_dir.mkdir(parents=True, exist_ok=True)

    built = [build_example(p, a, eos_token_id) for p, a in examples]
    rows = []
    offset = 0
    for idx, ((prompt, _answer), (ids, labels)) in enumerate(zip(examples, built)):
        if len(ids) > max_seq_len:
            raise ValueError(f"example {idx} has {len(ids)} tokens > max_seq_len {max_seq_len}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"example {idx} has a token id outside [0, {vocab_size})")
        rows.append(
            {
                "example_id": f"{partition}-{idx:06d}",
                "offset": offset,
                "num_tokens": int(len(ids)),
                "task": ("qa", "summarize", "chat")[idx % 3],
                "source": "independent-reference",
                "capability": "synthetic",
                "supervised_tokens": int((labels != IGNORE_INDEX).sum()),
            }
        )
        offset += len(ids)

    # Explicit little-endian dtypes: the format is defined as LE on disk.
    all_ids = np.concatenate([ids for ids, _ in built]).astype("<u4")
    all_labels = np.concatenate([labels for _, labels in built]).astype("<i4")
    all_ids.tofile(out_dir / "input_ids.bin")
    all_labels.tofile(out_dir / "labels.bin")
    with open(out_dir / "examples.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    index = {
        "format": SHARD_FORMAT,
        "num_tokens": int(offset),
        "examples": len(rows),
        "eos_token_id": int(eos_token_id),
        "vocab_size": int(vocab_size),
        "max_seq_len": int(max_seq_len),
        "sha256": {
            name: _sha256(out_dir / name)
            for name in ("input_ids.bin", "labels.bin", "examples.jsonl")
        },
    }
    (out_dir / "sft.idx.json").write_text(json.dumps(index, indent=2))
    return built


# ---------------------------------------------------------------------------
# Reference forward pass (one sequence, float64, explicit loops)
# ---------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope_cos_sin(seq_len: int, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, hd] for the rotate-half convention, positions 0..T-1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    positions = torch.arange(seq_len, dtype=torch.float64)
    angles = positions[:, None] * inv_freq[None, :]  # [T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, hd]
    return torch.cos(angles), torch.sin(angles)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _attention(h: torch.Tensor, p: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """GQA self-attention for one sequence h [T, D], one head at a time."""
    seq_len = h.shape[0]
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    eps = float(cfg["norm_eps"])
    group = hq // hkv
    cos, sin = _rope_cos_sin(seq_len, hd, float(cfg["rope_theta"]))

    q = (h @ p["self_attn.q_proj.weight"].T).reshape(seq_len, hq, hd)
    k = (h @ p["self_attn.k_proj.weight"].T).reshape(seq_len, hkv, hd)
    v = (h @ p["self_attn.v_proj.weight"].T).reshape(seq_len, hkv, hd)

    # Explicit causal mask: position i may look at j <= i only.
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()

    head_outputs = []
    for head in range(hq):
        kv_head = head // group  # query heads are grouped contiguously per KV head
        qh, kh, vh = q[:, head, :], k[:, kv_head, :], v[:, kv_head, :]
        if cfg.get("use_qk_norm", True):
            qh = _rms_norm(qh, p["self_attn.q_norm.weight"], eps)
            kh = _rms_norm(kh, p["self_attn.k_norm.weight"], eps)
        qh = qh * cos + _rotate_half(qh) * sin  # RoPE after QK-norm
        kh = kh * cos + _rotate_half(kh) * sin
        scores = (qh @ kh.T) / math.sqrt(hd)  # [T, T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.exp(scores)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        head_outputs.append(probs @ vh)  # [T, hd]
    concat = torch.cat(head_outputs, dim=-1)  # [T, Hq*hd], head-major like q_proj
    return concat @ p["self_attn.o_proj.weight"].T


def _tr_moe(x: torch.Tensor, token_ids: torch.Tensor, p: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """TR-MoE feed-forward, token by token, route by route."""
    table = p["mlp.engine.route_table"]
    weights = route_weights(cfg)
    shared_scale = float(cfg["shared_output_scale"])
    routed_scale = float(cfg["routed_output_scale"])
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t]
        # Shared SwiGLU uses nn.Linear weights [out, in].
        shared = p["mlp.engine.shared_down.weight"] @ (
            _silu(p["mlp.engine.shared_gate.weight"] @ xt) * (p["mlp.engine.shared_up.weight"] @ xt)
        )
        routed = torch.zeros_like(xt)
        token = int(token_ids[t])
        for k, w_k in enumerate(weights):
            e = int(table[k, token])
            inner = _silu(xt @ p["mlp.engine.expert_gate"][e]) * (xt @ p["mlp.engine.expert_up"][e])
            routed = routed + w_k * (inner @ p["mlp.engine.expert_down"][e])
        out[t] = shared_scale * shared + routed_scale * routed
    return out


def reference_logits(state: dict[str, torch.Tensor], cfg: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float64) for a single unbatched sequence of token ids [T]."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
    # Float weights to float64; integer tables (route_table) stay as they are.
    w = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in state.items()}
    eps = float(cfg["norm_eps"])

    h = w["embed_tokens.weight"][input_ids]  # no embedding scale in this family
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"layers.{i}."
        p = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        h = h + _attention(_rms_norm(h, p["input_layernorm.weight"], eps), p, cfg)
        h = h + _tr_moe(_rms_norm(h, p["post_attention_layernorm.weight"], eps), input_ids, p, cfg)
    h = _rms_norm(h, w["norm.weight"], eps)
    return h @ w["embed_tokens.weight"].T  # tied output head


def reference_eval_loss(
    state: dict[str, torch.Tensor],
    cfg: dict,
    shard_examples: Sequence[tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]],
) -> float:
    """Token-level mean cross-entropy over every supervised position.

    shard_examples are (input_ids, causally aligned labels) pairs, as returned
    by write_public_shard. Each example runs alone (no packing), and the sum of
    token losses is divided by the total supervised-token count, so long
    examples weigh more than short ones."""
    total_nll = 0.0
    total_tokens = 0
    for ids, labels in shard_examples:
        ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
        logits = reference_logits(state, cfg, ids_t)
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        for j in range(len(labels_t)):
            target = int(labels_t[j])
            if target != IGNORE_INDEX:
                total_nll -= float(log_probs[j, target])
                total_tokens += 1
    if total_tokens == 0:
        raise ValueError("no supervised tokens")
    return total_nll / total_tokens
