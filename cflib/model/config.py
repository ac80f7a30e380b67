"""Model configuration: the config.json contract of a TR-MoE checkpoint, validated."""
from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cflib.errors import shown
from cflib.jsonio import read_json
from cflib.model.rope import YARN_BETA_FAST, YARN_BETA_SLOW

# Keys that published config.json files carry for other loaders (HF adapters);
# they say nothing about the architecture, so they are accepted and dropped.
IGNORED_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "transformers_version", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "use_cache", "initializer_range",
    "attention_dropout", "head_dim", "is_decoder", "is_encoder_decoder", "dtype",
})
# Keys this model can honour only at one value: anything else would change the maths.
FIXED_CONFIG_KEYS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

# The RoPE scalings cflib computes (cflib.model.rope), each type's keys in transformers' names: required, then
# optional. A rope_scaling dict names its type as `rope_type` (older configs: `type`). A linear one may name the
# positions the model took before it (transformers' yarn and llama3 key), which its frequencies never read but a
# later run's scaling starts from (cflib.train.positions).
ROPE_SCALING_KEYS = {
    "linear": (("factor",), ("original_max_position_embeddings",)),
    "yarn": (("factor", "original_max_position_embeddings"), ("attention_factor", "beta_fast", "beta_slow", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}
# Types transformers knows that a fine-tuned model cannot keep: why each is refused.
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK changes the frequencies with the length of each sequence, so keys cached at one length "
               "are rotated unlike the queries that read them, and training never sees the frequencies inference uses",
    "longrope": "LongRoPE switches between two tables of factors by the length of each sequence (as dynamic NTK does)",
}
# Each key's kind: a number >= 1, a positive number, a positive integer, or true/false.
ROPE_KEY_KINDS = {"factor": "at_least_one", "original_max_position_embeddings": "positions",
                  "attention_factor": "positive", "beta_fast": "positive", "beta_slow": "positive",
                  "low_freq_factor": "positive", "high_freq_factor": "positive", "truncate": "boolean"}


# Bounds on the config's scales (the released model: norm_eps 1e-6, shared_output_scale 1.0, routed_output_scale 2.0).
MAX_NORM_EPS = 1e-2
MAX_OUTPUT_SCALE = 1e4
# Bounds on the sizes, generous (the released model: hidden_size 896, 201M weights) yet below what torch can
# allocate: past them torch.empty fails with a C++ frame dump, or tries to allocate terabytes, naming no key.
MAX_SIZE = 2**31 - 1  # any one size
MAX_ELEMENTS = 2**40  # the weights and route tables those sizes ask for, all layers together
# The sizes whose product sets the element count (the head counts divide hidden_size, num_experts intermediate_size).
ELEMENT_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "shared_intermediate_size", "intermediate_size",
                 "num_experts_per_tok")


class ConfigError(ValueError):
    """A model configuration that cannot describe a working TR-MoE model."""


def canonical_rope_scaling(raw: Any, positions_optional: bool = False) -> dict | None:
    """A rope_scaling dict checked key by key and written canonically: `rope_type` first (`type`, the older name,
    read as it), then its keys in ROPE_SCALING_KEYS' order, numbers as floats and positions as integers. None, and
    transformers' `default` type, are plain RoPE (None). ConfigError names the key at fault. positions_optional:
    original_max_position_embeddings may be missing (a run's rope_scaling, which cflib.train.positions completes
    with the starting model's positions)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling must be None or a mapping such as {{rope_type: linear, factor: 4.0}}, got "
                          f"{shown(raw)}")
    if "type" in raw and "rope_type" in raw and raw["type"] != raw["rope_type"]:
        raise ConfigError(f"rope_scaling names two types, rope_type {shown(raw['rope_type'])} and type "
                          f"{shown(raw['type'])}: keep rope_type")
    given = {("rope_type" if key == "type" else key): value for key, value in raw.items()}
    kind = given.pop("rope_type", None)
    if kind == "default" and not given:
        return None
    if kind in REFUSED_ROPE_TYPES:
        raise ConfigError(f"rope_scaling.rope_type {kind!r} is not supported: {REFUSED_ROPE_TYPES[kind]}; use "
                          "yarn (or linear) for a fixed extension")
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_scaling.rope_type must be one of {', '.join(ROPE_SCALING_KEYS)}, got {shown(kind)}")
    required, optional = ROPE_SCALING_KEYS[kind]
    unknown = [key for key in given if key not in required + optional]
    if unknown:
        hint = " (set rope_theta on its own, beside rope_scaling)" if unknown[0] == "rope_theta" else ""
        raise ConfigError(f"rope_scaling: {unknown[0]!r} is not a key of rope_type {kind}{hint}; its keys: "
                          f"{', '.join(required + optional)}")
    missing = [key for key in required if key not in given
               and not (positions_optional and key == "original_max_position_embeddings")]
    if missing:
        raise ConfigError(f"rope_scaling: rope_type {kind} needs {', '.join(missing)}")
    scaling = {"rope_type": kind, **{key: _rope_value(key, given[key]) for key in required + optional
                                     if key in given}}
    _check_rope_pairs(scaling)
    return scaling


def _rope_value(key: str, value: Any) -> float | int | bool:
    """One rope_scaling value of its kind (ROPE_KEY_KINDS), or ConfigError naming the key."""
    kind = ROPE_KEY_KINDS[key]
    if kind == "boolean":
        if not isinstance(value, bool):
            raise ConfigError(f"rope_scaling.{key} must be true or false, got {shown(value)}")
        return value
    if kind == "positions":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise ConfigError(f"rope_scaling.{key} must be a positive integer (the positions the model was trained "
                              f"on before this scaling), got {shown(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"rope_scaling.{key} must be a finite number, got {shown(value)}")
    if kind == "at_least_one" and value < 1:
        raise ConfigError(f"rope_scaling.{key} must be at least 1 (the times the context is extended), got {value!r}")
    if kind == "positive" and value <= 0:
        raise ConfigError(f"rope_scaling.{key} must be positive, got {value!r}")
    return float(value)


def _check_rope_pairs(scaling: dict) -> None:
    """YaRN's ramp and Llama 3's blend each run between two bounds that must come in order: the other way round the
    ramp runs backwards, and equal llama3 factors divide by zero."""
    if scaling["rope_type"] == "yarn":
        fast, slow = scaling.get("beta_fast", YARN_BETA_FAST), scaling.get("beta_slow", YARN_BETA_SLOW)
        if not fast > slow:
            raise ConfigError(f"rope_scaling.beta_fast {fast:g} must be more than beta_slow {slow:g} (unset: "
                              f"{YARN_BETA_FAST:g} and {YARN_BETA_SLOW:g})")
    if scaling["rope_type"] == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError(f"rope_scaling.high_freq_factor {scaling['high_freq_factor']:g} must be more than "
                          f"low_freq_factor {scaling['low_freq_factor']:g}")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 896
    num_hidden_layers: int = 16
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    use_qk_norm: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    shared_intermediate_size: int = 3072
    num_experts: int = 4
    intermediate_size: int = 256  # total routed width over all experts
    num_experts_per_tok: int = 2
    top_k_primary_weight: float = 0.5
    routing_strategy: str = "token_id_multi_hash"
    route_hash_count: int = 2
    shared_output_scale: float = 1.0
    routed_output_scale: float = 2.0
    tie_word_embeddings: bool = True
    # None: plain RoPE; or a transformers rope_scaling dict of ROPE_SCALING_KEYS, e.g. {"rope_type": "linear",
    # "factor": 4.0} (cflib.model.rope). Not hashed: a dict has no hash, and equal configs still hash alike.
    rope_scaling: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        # Stored canonical ("type" read as "rope_type", numbers as floats), so equal scalings compare equal.
        object.__setattr__(self, "rope_scaling", canonical_rope_scaling(self.rope_scaling))
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_width(self) -> int:
        return self.intermediate_size // self.num_experts

    def route_weights(self) -> list[float]:
        """Weight of each route: the primary one, then the rest shared equally."""
        k = self.num_experts_per_tok
        if k == 1:
            return [self.top_k_primary_weight]
        rest = (1.0 - self.top_k_primary_weight) / (k - 1)
        return [self.top_k_primary_weight] + [rest] * (k - 1)

    def validate(self) -> None:
        positive = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "vocab_size", "max_position_embeddings", "shared_intermediate_size",
                    "num_experts", "intermediate_size", "num_experts_per_tok", "route_hash_count")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            if value > MAX_SIZE:
                raise ConfigError(f"{name} {shown(value)} is more than {MAX_SIZE:,} (2**31 - 1), the largest size "
                                  "cflib builds; is it mistyped?")
        for name in ("norm_eps", "rope_theta", "top_k_primary_weight", "shared_output_scale", "routed_output_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):  # NaN passes `<= 0`, and either poisons the first forward
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        for name in ("use_qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} (hidden_size / num_attention_heads) must be even for RoPE")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                              f"num_key_value_heads {self.num_key_value_heads} (GQA groups)")
        if self.intermediate_size % self.num_experts:
            raise ConfigError(f"intermediate_size {self.intermediate_size} (total routed width) is not "
                              f"divisible by num_experts {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                              f"got {self.num_experts_per_tok}")
        if not 0.0 < self.top_k_primary_weight <= 1.0:
            raise ConfigError(f"top_k_primary_weight must be in (0, 1], got {self.top_k_primary_weight}")
        if self.num_experts_per_tok == 1 and self.top_k_primary_weight != 1.0:
            raise ConfigError("top_k_primary_weight must be 1.0 when num_experts_per_tok is 1 "
                              f"(got {self.top_k_primary_weight})")
        if not isinstance(self.routing_strategy, str):
            raise ConfigError(f"routing_strategy must be a string, got {self.routing_strategy!r}")
        self._validate_element_count()
        self._validate_scales()
        if not self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings must be true: TR-MoE checkpoints have no separate lm_head")

    def _validate_element_count(self) -> None:
        """Sizes each within MAX_SIZE may still multiply to more weights than any machine holds."""
        elements = self.num_parameters() + self.num_hidden_layers * self.num_experts_per_tok * self.vocab_size
        if elements > MAX_ELEMENTS:
            sizes = ", ".join(f"{name} {getattr(self, name):,}" for name in ELEMENT_SIZES)
            raise ConfigError(f"{sizes} ask for {elements:,} weights and route-table entries, more than the "
                              f"{MAX_ELEMENTS:,} (2**40) cflib builds; is one of them mistyped?")

    def _validate_scales(self) -> None:
        """The numbers that set the forward's scale, bounded where a finite value still reaches step 1 as NaN."""
        if not 0 < self.norm_eps <= MAX_NORM_EPS:
            why = ("a larger one drowns the activations' own scale (outputs near 0, gradients zero)"
                   if self.norm_eps > 0 else "the norm of an all-zero row would divide by zero")
            raise ConfigError(f"norm_eps must be in (0, {MAX_NORM_EPS:g}], got {self.norm_eps!r}: {why}")
        if not 1 <= self.rope_theta:
            raise ConfigError(f"rope_theta must be at least 1, got {self.rope_theta!r}: RoPE's frequencies are "
                              "rope_theta ** (-2i / head_dim), and below 1 they grow without bound")
        for name in ("shared_output_scale", "routed_output_scale"):
            if not abs(getattr(self, name)) <= MAX_OUTPUT_SCALE:
                raise ConfigError(f"{name} must be within [-{MAX_OUTPUT_SCALE:g}, {MAX_OUTPUT_SCALE:g}], got "
                                  f"{getattr(self, name)!r}: the residual stream it scales overflows to inf, then "
                                  "NaN, at the first step")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: a config is a JSON object of keys, got {type(raw).__name__}")
        try:
            raw = with_rope_parameters(raw)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        for key, required in FIXED_CONFIG_KEYS.items():
            if key in raw and raw[key] != required:
                raise ConfigError(f"{source}: {key}={raw[key]!r} is not supported by the TR-MoE model "
                                  f"(only {required!r})")
        unknown = sorted(set(raw) - known - IGNORED_CONFIG_KEYS - set(FIXED_CONFIG_KEYS))
        # A near miss of a field name is a typo that would silently fall back to a default.
        typos = {key: difflib.get_close_matches(key, known, n=1, cutoff=0.85) for key in unknown}
        typos = {key: match[0] for key, match in typos.items() if match}
        if typos:
            hints = ", ".join(f"{key!r} (did you mean {match!r}?)" for key, match in typos.items())
            raise ConfigError(f"{source}: unknown config keys {sorted(typos)}: {hints}")
        if unknown:
            warnings.warn(f"{source}: ignoring config keys this model does not use: {unknown}", stacklevel=2)
        try:
            config = cls(**{k: v for k, v in raw.items() if k in known})
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        # Checked on the built config, whose sizes are validated integers: arithmetic on the raw values would meet
        # a "64" or a [4] as a TypeError naming neither the file nor the key.
        if "head_dim" in raw and raw["head_dim"] != config.head_dim:
            raise ConfigError(f"{source}: head_dim {shown(raw['head_dim'])} != hidden_size / num_attention_heads "
                              f"({config.hidden_size} / {config.num_attention_heads} = {config.head_dim})")
        return config

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_dict(read_json(path, ConfigError, "model config (config.json)"), source=str(path))

    def num_parameters(self) -> int:
        """Trainable parameters (route tables are buffers, the head is tied)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        qk_norm = 2 * hd if self.use_qk_norm else 0
        mlp = 3 * d * self.shared_intermediate_size + 3 * d * self.intermediate_size
        per_layer = attn + qk_norm + mlp + 2 * d
        return self.vocab_size * d + self.num_hidden_layers * per_layer + d

    def active_parameters(self) -> int:
        """Parameters each token touches: only top_k of the experts count."""
        d = self.hidden_size
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * d * self.expert_width
        return self.num_parameters() - self.num_hidden_layers * idle


def with_rope_parameters(raw: dict) -> dict:
    """`raw` with transformers' `rope_parameters` (its save_pretrained writes RoPE as {rope_type, rope_theta, ...})
    read as rope_theta and rope_scaling; ConfigError where it disagrees with either key beside it."""
    if "rope_parameters" not in raw:
        return raw
    parameters = raw["rope_parameters"]
    if not isinstance(parameters, dict):
        raise ConfigError(f"rope_parameters must be a mapping with rope_type and rope_theta, got {shown(parameters)}")
    parameters = dict(parameters)
    out = {key: value for key, value in raw.items() if key != "rope_parameters"}
    if "rope_theta" in parameters:
        theta = parameters.pop("rope_theta")
        if "rope_theta" in raw and raw["rope_theta"] != theta:
            raise ConfigError(f"rope_parameters.rope_theta {shown(theta)} disagrees with rope_theta "
                              f"{shown(raw['rope_theta'])}")
        out["rope_theta"] = theta
    scaling = canonical_rope_scaling(parameters)
    if "rope_scaling" in raw and canonical_rope_scaling(raw["rope_scaling"]) != scaling:
        raise ConfigError(f"rope_parameters {shown(raw['rope_parameters'])} disagrees with rope_scaling "
                          f"{shown(raw['rope_scaling'])}")
    out["rope_scaling"] = scaling
    return out


PRESETS: dict[str, ModelConfig] = {
    # The released TR-HASH MoE 200M architecture (its published config.json).
    "tr_hash_200m": ModelConfig(),
    # Small enough to learn the embedded tasks on two CPU cores in minutes.
    "quickstart": ModelConfig(
        hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=260, max_position_embeddings=256, shared_intermediate_size=512,
        num_experts=4, intermediate_size=128,
    ),
    # The smallest sensible model, for tests and notebook smoke runs.
    "smoke": ModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=260, max_position_embeddings=256, shared_intermediate_size=128,
        num_experts=4, intermediate_size=64,
    ),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]
