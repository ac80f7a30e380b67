"""ModelConfig: presets, parameter counts, validation and the config.json contract."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from cflib.model.config import PRESETS, ConfigError, ModelConfig, preset
from cflib.model.decoder import TRMoEModel

try:
    from tiny_models import TINY_FIELDS, tiny_config
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import TINY_FIELDS, tiny_config

RELEASED_PARAMETERS = 201_194_368

# docs/formats.md#the-released-200m-configuration.
RELEASED_FIELDS: dict[str, object] = dict(
    hidden_size=896, num_hidden_layers=16, num_attention_heads=14, num_key_value_heads=2,
    use_qk_norm=True, norm_eps=1e-6, rope_theta=10000.0, vocab_size=32000,
    max_position_embeddings=2048, shared_intermediate_size=3072, num_experts=4,
    intermediate_size=256, num_experts_per_tok=2, top_k_primary_weight=0.5,
    routing_strategy="token_id_multi_hash", route_hash_count=2, shared_output_scale=1.0,
    routed_output_scale=2.0, tie_word_embeddings=True, rope_scaling=None,
)


def meta_model(config: ModelConfig) -> TRMoEModel:
    """The real module tree with no storage: counts the 200M model for free."""
    with torch.device("meta"):
        return TRMoEModel(config)


def counted_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tr_hash_200m_matches_design_table() -> None:
    config = preset("tr_hash_200m")
    assert config.to_dict() == RELEASED_FIELDS
    assert (config.head_dim, config.expert_width) == (64, 64)


def test_tr_hash_200m_formula_count_is_exact() -> None:
    assert preset("tr_hash_200m").num_parameters() == RELEASED_PARAMETERS


def test_tr_hash_200m_real_module_count_is_exact() -> None:
    model = meta_model(preset("tr_hash_200m"))
    assert counted_parameters(model) == RELEASED_PARAMETERS


@pytest.mark.parametrize("config", [
    *PRESETS.values(),
    tiny_config(),
    tiny_config(use_qk_norm=False),
    tiny_config(num_experts=2, intermediate_size=16, num_experts_per_tok=1, top_k_primary_weight=1.0),
], ids=[*PRESETS, "tiny", "tiny_no_qk_norm", "tiny_top1"])
def test_formula_count_matches_real_module(config: ModelConfig) -> None:
    assert config.num_parameters() == counted_parameters(meta_model(config))


def test_route_tables_are_buffers_not_parameters() -> None:
    config = preset("tr_hash_200m")
    model = meta_model(config)
    assert not [name for name, _ in model.named_parameters() if "route_table" in name]
    tables = {name: buf for name, buf in model.named_buffers() if name.endswith("route_table")}
    assert set(tables) == {f"layers.{i}.mlp.engine.route_table" for i in range(config.num_hidden_layers)}
    for table in tables.values():
        assert table.shape == (config.num_experts_per_tok, config.vocab_size)
        assert table.dtype == torch.int64


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_active_parameters_drop_only_the_idle_experts(top_k: int) -> None:
    config = tiny_config(num_experts_per_tok=top_k, top_k_primary_weight=1.0 if top_k == 1 else 0.5)
    engine = meta_model(config).layers[0].mlp["engine"]
    per_expert = sum(p[0].numel() for p in (engine.expert_gate, engine.expert_up, engine.expert_down))
    idle = config.num_hidden_layers * (config.num_experts - top_k) * per_expert
    assert config.active_parameters() == config.num_parameters() - idle


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match=r"'nope'.*quickstart.*tr_hash_200m"):
        preset("nope")


def test_config_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset("tr_hash_200m").hidden_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("top_k, primary, expected", [
    (1, 1.0, [1.0]),
    (2, 0.5, [0.5, 0.5]),
    (2, 0.7, [0.7, 0.3]),
    (3, 0.6, [0.6, 0.2, 0.2]),
    (4, 0.25, [0.25, 0.25, 0.25, 0.25]),
])
def test_route_weights(top_k: int, primary: float, expected: list[float]) -> None:
    config = tiny_config(num_experts_per_tok=top_k, top_k_primary_weight=primary)
    assert config.route_weights() == pytest.approx(expected)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=30), "hidden_size 30 is not divisible by num_attention_heads 4"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not divisible by num_key_value_heads 3"),
    (dict(intermediate_size=30), "intermediate_size 30 (total routed width) is not divisible by num_experts 4"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok must be in [1, num_experts=4], got 5"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive integer, got 0"),
    (dict(hidden_size=36), "head_dim 9 (hidden_size / num_attention_heads) must be even"),
    (dict(hidden_size=True), "hidden_size must be a positive integer, got True"),
    (dict(vocab_size=-1), "vocab_size must be a positive integer, got -1"),
    (dict(top_k_primary_weight=0.0), "top_k_primary_weight must be in (0, 1], got 0.0"),
    (dict(top_k_primary_weight=1.5), "top_k_primary_weight must be in (0, 1], got 1.5"),
    (dict(num_experts_per_tok=1), "top_k_primary_weight must be 1.0 when num_experts_per_tok is 1"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings must be true"),
    (dict(norm_eps=0.0), "norm_eps must be in (0, 0.01], got 0.0"),
    # Finite, yet NaN by step 1: each is refused by its bound.
    (dict(norm_eps=1e300), "norm_eps must be in (0, 0.01], got 1e+300"),
    (dict(rope_theta=1e-300), "rope_theta must be at least 1, got 1e-300"),
    (dict(shared_output_scale=1e308), "shared_output_scale must be within [-10000, 10000], got 1e+308"),
    (dict(routed_output_scale=-1e308), "routed_output_scale must be within [-10000, 10000], got -1e+308"),
    # Past what torch can allocate: refused naming the key, not by torch.empty's C++ frame dump.
    (dict(hidden_size=10**30), f"hidden_size {10**30} is more than 2,147,483,647 (2**31 - 1)"),
    (dict(max_position_embeddings=2**31), "max_position_embeddings 2147483648 is more than 2,147,483,647"),
    (dict(hidden_size=2**20), "hidden_size 1,048,576, num_hidden_layers"),
    (dict(num_hidden_layers=2**30), "num_hidden_layers 1,073,741,824, vocab_size 50, shared_intermediate_size 48, "
                                    "intermediate_size 32, num_experts_per_tok 2 ask for 11,738,145,621,600 weights "
                                    "and route-table entries, more than the 1,099,511,627,776 (2**40)"),
])
def test_invalid_config_is_refused_with_a_clear_message(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(**overrides)


@pytest.mark.parametrize("overrides", [
    dict(num_experts_per_tok=4),  # top-k == E is allowed
    dict(num_experts_per_tok=1, top_k_primary_weight=1.0),
    dict(num_key_value_heads=4),  # plain MHA
    dict(num_key_value_heads=1),  # MQA
    dict(vocab_size=2**31 - 1),  # the largest size, its weights within 2**40
])
def test_boundary_configs_are_accepted(overrides: dict[str, object]) -> None:
    tiny_config(**overrides)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("config", [*PRESETS.values(), tiny_config(
    top_k_primary_weight=0.7, routing_strategy="modulo_cyclic", use_qk_norm=False, rope_theta=5e4,
    shared_output_scale=0.75, routed_output_scale=1.5, num_experts_per_tok=3, route_hash_count=3,
)], ids=[*PRESETS, "tiny_non_default"])
def test_dict_round_trip(config: ModelConfig) -> None:
    raw = config.to_dict()
    assert set(raw) == set(RELEASED_FIELDS)
    assert ModelConfig.from_dict(raw) == config
    assert ModelConfig.from_dict(json.loads(json.dumps(raw))) == config


def test_from_dict_accepts_published_extra_keys() -> None:
    raw = {**tiny_config().to_dict(), "architectures": ["ComplexityForCausalLM"], "model_type": "complexity",
           "torch_dtype": "float32", "eos_token_id": 0, "head_dim": 8}
    assert ModelConfig.from_dict(raw) == tiny_config()


def test_from_dict_names_an_unknown_key() -> None:
    raw = {**tiny_config().to_dict(), "num_expert": 4}
    with pytest.raises(ConfigError, match=r"somewhere/config\.json: unknown config keys \['num_expert'\]"):
        ModelConfig.from_dict(raw, source="somewhere/config.json")


def test_from_dict_warns_about_and_ignores_other_unknown_keys() -> None:
    raw = {**tiny_config().to_dict(), "rope_type": "default", "router_aux_loss_coef": 0.0}
    with pytest.warns(UserWarning, match=r"ignoring config keys .*\['rope_type', 'router_aux_loss_coef'\]"):
        assert ModelConfig.from_dict(raw) == tiny_config()


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True)])
def test_from_dict_refuses_keys_that_change_the_maths(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{key}="):
        ModelConfig.from_dict({**tiny_config().to_dict(), key: value})


def test_from_dict_refuses_an_inconsistent_head_dim() -> None:
    with pytest.raises(ConfigError, match="head_dim 16 != hidden_size / num_attention_heads"):
        ModelConfig.from_dict({**TINY_FIELDS, "head_dim": 16})


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("num_attention_heads", [4]),
                                        ("num_attention_heads", None), ("hidden_size", {"d": 64})])
def test_a_wrongly_typed_size_beside_head_dim_names_the_file_and_key(tmp_path: Path, key: str,
                                                                      value: object) -> None:
    """head_dim is checked against hidden_size / num_attention_heads: only once both are known to be integers, so a
    published config.json with "hidden_size": "64" is refused by name, not with a TypeError from the division."""
    path = write_config(tmp_path / "config.json", json.dumps({**TINY_FIELDS, "head_dim": 8, key: value}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {key} must be a positive integer")):
        ModelConfig.from_json_file(path)


def test_from_dict_prefixes_validation_errors_with_the_source() -> None:
    with pytest.raises(ConfigError, match=re.escape("ckpt/config.json: num_attention_heads 4 is not divisible")):
        ModelConfig.from_dict({**TINY_FIELDS, "num_key_value_heads": 3}, source="ckpt/config.json")


def write_config(path: Path, content: str | bytes) -> Path:
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def test_from_json_file_round_trip(tmp_path: Path) -> None:
    config = tiny_config(top_k_primary_weight=0.7)
    path = write_config(tmp_path / "config.json", json.dumps(config.to_dict()))
    assert ModelConfig.from_json_file(path) == config
    assert ModelConfig.from_json_file(str(path)) == config


def test_from_json_file_missing_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "config.json"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        ModelConfig.from_json_file(path)


@pytest.mark.parametrize("content", [
    b'{"hidden_size": 32,',          # truncated JSON
    b"",                              # empty file
    b"[]",                            # JSON, but not an object
    b"null",
    b'"hidden_size"',
    b"\xff\xfe\x00\x81garbage\x00",   # not even text
], ids=["truncated", "empty", "array", "null", "string", "binary"])
def test_from_json_file_unreadable_content_names_the_path(tmp_path: Path, content: bytes) -> None:
    path = write_config(tmp_path / "config.json", content)
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        ModelConfig.from_json_file(path)


def test_from_json_file_unknown_key_names_path_and_key(tmp_path: Path) -> None:
    path = write_config(tmp_path / "config.json", json.dumps({**TINY_FIELDS, "moe_capacity": 1.25}))
    with pytest.warns(UserWarning) as caught:
        ModelConfig.from_json_file(path)
    message = str(caught[0].message)
    assert str(path) in message and "moe_capacity" in message
    path = write_config(tmp_path / "config.json", json.dumps({**TINY_FIELDS, "num_hiden_layers": 3}))
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_json_file(path)
    assert str(path) in str(err.value) and "did you mean 'num_hidden_layers'" in str(err.value)


def test_from_json_file_invalid_value_names_the_path(tmp_path: Path) -> None:
    path = write_config(tmp_path / "config.json", json.dumps({**TINY_FIELDS, "intermediate_size": 30}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: intermediate_size 30")):
        ModelConfig.from_json_file(path)


def test_from_json_file_size_past_torch_names_the_path_and_key(tmp_path: Path) -> None:
    path = write_config(tmp_path / "config.json", json.dumps({**TINY_FIELDS, "hidden_size": 10**30}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: hidden_size {10**30} is more than 2,147,483,647")):
        ModelConfig.from_json_file(path)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "32"),
    ("top_k_primary_weight", "0.5"),
    ("norm_eps", None),
    ("rope_theta", "10000"),
    ("use_qk_norm", "false"),
])
def test_wrongly_typed_value_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**TINY_FIELDS, field: value}, source="config.json")
