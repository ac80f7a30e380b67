"""Configuration of the TR-MoE decoder (model_type "tr_hash_moe") for Hugging Face transformers.

Self-contained: loaded by `AutoConfig.from_pretrained(folder, trust_remote_code=True)`
from an exported bundle, it imports transformers only. The keys are those of
the checkpoint's config.json; `intermediate_size` is the total routed width
over all experts. RoPE is `rope_theta` and `rope_scaling` (None, or a linear,
yarn or llama3 dict in transformers' names), as cflib writes them, or
`rope_parameters`, as transformers' save_pretrained writes them; the config
holds them as `rope_parameters` (which transformers' `rope_scaling` reads).
"""
from __future__ import annotations

from transformers import PretrainedConfig

# The RoPE types the modeling code computes, each with its required keys.
ROPE_TYPES = {"default": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
              "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}


def rope_scaling_of(parameters: dict | None) -> dict | None:
    """A rope_scaling or rope_parameters dict as the scaling it names (rope_theta left out, `type` read as
    `rope_type`), checked against ROPE_TYPES; None for plain RoPE."""
    scaling = {("rope_type" if key == "type" else key): value for key, value in (parameters or {}).items()
               if key != "rope_theta"}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return None
    if kind not in ROPE_TYPES or any(key not in scaling for key in ROPE_TYPES[kind]):
        raise ValueError(f"rope_scaling {parameters!r}: this model computes rope_type {', '.join(ROPE_TYPES)}, "
                         f"with the keys {ROPE_TYPES}")
    return scaling


class TRHashConfig(PretrainedConfig):
    model_type = "tr_hash_moe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 896,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 14,
        num_key_value_heads: int = 2,
        use_qk_norm: bool = True,
        norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 2048,
        shared_intermediate_size: int = 3072,
        num_experts: int = 4,
        intermediate_size: int = 256,
        num_experts_per_tok: int = 2,
        top_k_primary_weight: float = 0.5,
        routing_strategy: str = "token_id_multi_hash",
        route_hash_count: int = 2,
        shared_output_scale: float = 1.0,
        routed_output_scale: float = 2.0,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.use_qk_norm = use_qk_norm
        self.norm_eps = norm_eps
        self.rope_theta = rope_theta
        self.rope_parameters = self._rope_parameters(rope_scaling, kwargs.pop("rope_parameters", None))
        self.max_position_embeddings = max_position_embeddings
        self.shared_intermediate_size = shared_intermediate_size
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.top_k_primary_weight = top_k_primary_weight
        self.routing_strategy = routing_strategy
        self.route_hash_count = route_hash_count
        self.shared_output_scale = shared_output_scale
        self.routed_output_scale = routed_output_scale
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.unk_token_id = unk_token_id
        self._check(tie_word_embeddings, kwargs.pop("head_dim", None))
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _rope_parameters(self, rope_scaling: dict | None, rope_parameters: dict | None) -> dict:
        """{rope_type, rope_theta, ...} from rope_scaling (cflib's config.json) or rope_parameters (a saved one's,
        whose rope_theta wins) and rope_theta."""
        if rope_parameters is not None:
            self.rope_theta = rope_parameters.get("rope_theta", self.rope_theta)
            rope_scaling = rope_parameters
        return {**(rope_scaling_of(rope_scaling) or {"rope_type": "default"}), "rope_theta": self.rope_theta}

    def _validate_linear_rope_parameters(self, rope_parameters: dict, ignore_keys: set | None = None) -> None:
        """transformers' check of a linear scaling, which also takes original_max_position_embeddings: cflib names
        the positions the model took before the scaling there, as yarn and llama3 do (the frequencies read factor
        alone)."""
        super()._validate_linear_rope_parameters(
            rope_parameters, ignore_keys=set(ignore_keys or ()) | {"original_max_position_embeddings"})

    def rope_scaling_dict(self) -> dict | None:
        """The RoPE scaling the model computes, None for plain RoPE: read from rope_parameters, where
        from_pretrained's overrides (rope_scaling=...) also land."""
        return rope_scaling_of(getattr(self, "rope_parameters", None))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_width(self) -> int:
        return self.intermediate_size // self.num_experts

    def route_weights(self) -> list[float]:
        """The primary route's weight, then the rest shared equally by the other routes."""
        k = self.num_experts_per_tok
        if k == 1:
            return [self.top_k_primary_weight]
        return [self.top_k_primary_weight] + [(1.0 - self.top_k_primary_weight) / (k - 1)] * (k - 1)

    def _check(self, tie_word_embeddings: bool, head_dim: int | None) -> None:
        if head_dim is not None and head_dim != self.head_dim:
            raise ValueError(f"head_dim {head_dim} is not hidden_size / num_attention_heads = {self.head_dim}")
        if not tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be true: the TR-MoE head is the input embedding")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_attention_heads} heads "
                             "of even size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.intermediate_size % self.num_experts:
            raise ValueError(f"intermediate_size {self.intermediate_size} (total routed width) is not divisible "
                             f"by num_experts {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
