"""The derived buffers every checkpoint carries for the published adapter: values, saving, checking on load."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cflib.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.model.derived import derived_buffers, fused_route_buffers

try:
    import independent_reference as ref
    from tiny_models import logits, random_ids, tiny_config, tiny_model
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests import independent_reference as ref
    from tests.tiny_models import logits, random_ids, tiny_config, tiny_model

WEIGHTS = "model.safetensors"


def codes_of(routes: list[tuple[int, int]], num_experts: int) -> list[int]:
    table = torch.tensor(routes, dtype=torch.int64).T
    codes, _ = fused_route_buffers(table, num_experts)
    assert codes.dtype == torch.uint8 and codes.shape == (len(routes),)
    return codes.tolist()


def test_four_experts_worked_by_hand():
    # Pairs in torch.combinations order: 0:(0,1) 1:(0,2) 2:(0,3) 3:(1,2) 4:(1,3) 5:(2,3); six pairs <= 8: swap is bit 3.
    _, pairs = fused_route_buffers(torch.tensor([[0], [1]]), 4)
    assert pairs.dtype == torch.int32 and pairs.tolist() == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]
    assert codes_of([(0, 1), (1, 0), (2, 3), (3, 2), (1, 3), (3, 1), (0, 2)], 4) == [0, 8, 5, 13, 4, 12, 1]


def test_six_experts_have_fifteen_pairs_and_swap_on_bit_five():
    _, pairs = fused_route_buffers(torch.tensor([[0], [1]]), 6)
    assert pairs.shape == (15, 2) and pairs[10].tolist() == [2, 4] and pairs[14].tolist() == [4, 5]
    assert codes_of([(0, 1), (1, 0), (2, 4), (4, 2), (4, 5), (5, 4)], 6) == [0, 32, 10, 42, 14, 46]


def test_two_experts():
    assert codes_of([(0, 1), (1, 0)], 2) == [0, 8]


@pytest.mark.parametrize("table, num_experts", [
    (torch.tensor([[0, 1, 2]]), 4),                       # top-1
    (torch.tensor([[0, 1], [1, 2], [2, 3]]), 4),          # top-3
    (torch.tensor([[0, 8], [1, 0]]), 9),                  # more than 8 experts
    (torch.tensor([[0, 1, 2], [1, 1, 3]]), 4),            # token 1 routed twice to expert 1
], ids=["top1", "top3", "nine_experts", "repeated_route"])
def test_undefined_cases_are_empty(table: torch.Tensor, num_experts: int):
    codes, pairs = fused_route_buffers(table, num_experts)
    assert (codes.dtype, tuple(codes.shape)) == (torch.uint8, (0,))
    assert (pairs.dtype, tuple(pairs.shape)) == (torch.int32, (0, 2))


@pytest.mark.parametrize("num_experts", range(2, 9))
def test_matches_the_independent_token_by_token_derivation(num_experts: int):
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "rope_theta": 5000.0, "num_experts": num_experts,
           "num_experts_per_tok": 2, "vocab_size": 300}
    table = torch.argsort(torch.rand(300, num_experts, generator=torch.Generator().manual_seed(num_experts)),
                          dim=1)[:, :2].T.contiguous()
    want = ref._derived_buffers(cfg, [table])
    config = tiny_config(num_experts=num_experts, intermediate_size=8 * num_experts, rope_theta=5000.0,
                         vocab_size=300)
    got = derived_buffers(config, {"layers.0.mlp.engine.route_table": table,
                                   "layers.1.mlp.engine.route_table": table})
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_codes_decode_back_to_each_tokens_routes():
    table = tiny_model().layers[0].mlp["engine"].route_table
    codes, pairs = fused_route_buffers(table, 4)
    pair = pairs[(codes & 7).long()]
    swapped = (codes & 8).bool()
    first = torch.where(swapped, pair[:, 1], pair[:, 0])
    second = torch.where(swapped, pair[:, 0], pair[:, 1])
    assert torch.equal(torch.stack([first, second]).long(), table)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[TRMoEModel, Path]:
    return tiny_model(seed=3), save_checkpoint(tiny_model(seed=3), tmp_path / "ckpt")


def test_saved_checkpoint_carries_them(saved: tuple[TRMoEModel, Path]):
    model, path = saved
    tensors = load_file(str(path / WEIGHTS))
    for i, layer in enumerate(model.layers):
        codes, pairs = fused_route_buffers(layer.mlp["engine"].route_table, 4)
        assert torch.equal(tensors[f"layers.{i}.mlp.engine.fused_route_codes"], codes)
        assert torch.equal(tensors[f"layers.{i}.mlp.engine.fused_expert_pairs"], pairs)
        inv_freq = tensors[f"layers.{i}.self_attn.rotary_emb.inv_freq"]
        hd = model.config.head_dim
        assert inv_freq.dtype == torch.float32
        assert torch.equal(inv_freq, (1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)).float())


def test_gathered_weights_get_them_from_their_own_route_tables(tmp_path: Path):
    """Under FSDP the gathered weights are what is written, not the (sharded) module's state."""
    model = tiny_model()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weights["layers.1.mlp.engine.route_table"] = weights["layers.1.mlp.engine.route_table"].flip(0)
    tensors = load_file(str(save_checkpoint(model, tmp_path / "ckpt", weights=weights) / WEIGHTS))
    codes = tensors["layers.1.mlp.engine.fused_route_codes"]
    assert torch.equal(codes, fused_route_buffers(weights["layers.1.mlp.engine.route_table"], 4)[0])
    assert torch.equal(codes ^ 8, tensors["layers.0.mlp.engine.fused_route_codes"])  # same pairs, other order


def corrupt_codes(tensors: dict[str, torch.Tensor]) -> None:
    tensors["layers.1.mlp.engine.fused_route_codes"][17] ^= 8


def corrupt_inv_freq(tensors: dict[str, torch.Tensor]) -> None:
    tensors["layers.0.self_attn.rotary_emb.inv_freq"][2] *= 1.01


def reorder_pairs(tensors: dict[str, torch.Tensor]) -> None:
    tensors["layers.1.mlp.engine.fused_expert_pairs"] = tensors["layers.1.mlp.engine.fused_expert_pairs"].flip(0)


def wrong_shape(tensors: dict[str, torch.Tensor]) -> None:
    tensors["layers.0.mlp.engine.fused_route_codes"] = tensors["layers.0.mlp.engine.fused_route_codes"][:-1]


CORRUPTIONS = {
    corrupt_codes: "layers.1.mlp.engine.fused_route_codes disagrees with layers.1.mlp.engine.route_table at token 17",
    corrupt_inv_freq: "layers.0.self_attn.rotary_emb.inv_freq disagrees with rope_theta 10000.0 and head_dim 8 "
                      "at index 2",
    reorder_pairs: "layers.1.mlp.engine.fused_expert_pairs disagrees with num_experts 4 and "
                   "layers.1.mlp.engine.route_table at row 0",
    wrong_shape: "layers.0.mlp.engine.fused_route_codes has shape [49], but layers.0.mlp.engine.route_table gives [50]",
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_a_disagreeing_buffer_is_refused_naming_layer_and_tensor(saved: tuple[TRMoEModel, Path], corrupt):
    _, path = saved
    tensors = load_file(str(path / WEIGHTS))
    corrupt(tensors)
    save_file(tensors, str(path / WEIGHTS))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(CheckpointError, match=re.escape(CORRUPTIONS[corrupt])):
        load_checkpoint(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_saving_disagreeing_buffers_writes_nothing(saved: tuple[TRMoEModel, Path], tmp_path: Path):
    model, path = saved
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    weights = {**model.state_dict(), **load_file(str(path / WEIGHTS))}
    corrupt_codes(weights)
    with pytest.raises(CheckpointError, match=re.escape(CORRUPTIONS[corrupt_codes])):
        save_checkpoint(model, path, weights=weights)
    with pytest.raises(CheckpointError, match="fused_route_codes"):
        save_checkpoint(model, tmp_path / "fresh", weights=weights)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_bf16_checkpoint_whose_inv_freq_is_bf16_too_loads(saved: tuple[TRMoEModel, Path]):
    """Its frequencies are compared at the precision they are stored in; one that is wrong in BF16 is still
    refused."""
    model, path = saved
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
               for name, t in load_file(str(path / WEIGHTS)).items()}
    save_file(tensors, str(path / WEIGHTS))
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.norm.weight, model.norm.weight.to(torch.bfloat16).float())
    name = "layers.1.self_attn.rotary_emb.inv_freq"
    save_file({**tensors, name: tensors[name] * 1.1}, str(path / WEIGHTS))
    with pytest.raises(CheckpointError, match=f"{name} disagrees with rope_theta"):
        load_checkpoint(path)


def test_a_checkpoint_without_them_still_loads(saved: tuple[TRMoEModel, Path]):
    model, path = saved
    tensors = {name: t for name, t in load_file(str(path / WEIGHTS)).items()
               if not name.endswith(("inv_freq", "fused_route_codes", "fused_expert_pairs"))}
    save_file(tensors, str(path / WEIGHTS))
    ids = random_ids(model.config.vocab_size, 2, 7)
    with torch.no_grad():
        assert torch.equal(logits(load_checkpoint(path).eval(), ids), logits(model, ids))


def test_a_buffer_of_a_layer_the_model_lacks_is_unexpected(saved: tuple[TRMoEModel, Path]):
    _, path = saved
    tensors = load_file(str(path / WEIGHTS))
    tensors["layers.2.self_attn.rotary_emb.inv_freq"] = tensors["layers.0.self_attn.rotary_emb.inv_freq"].clone()
    save_file(tensors, str(path / WEIGHTS))
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor 'layers.2.self_attn.rotary_emb.inv_freq'")):
        load_checkpoint(path)


def test_top3_model_writes_empty_fused_buffers(tmp_path: Path):
    model = TRMoEModel(ModelConfig(**{**tiny_config().to_dict(), "num_experts_per_tok": 3,
                                      "top_k_primary_weight": 0.5}))
    tensors = load_file(str(save_checkpoint(model, tmp_path / "ckpt") / WEIGHTS))
    assert tensors["layers.0.mlp.engine.fused_route_codes"].shape == (0,)
    assert tensors["layers.0.mlp.engine.fused_expert_pairs"].shape == (0, 2)
    load_checkpoint(tmp_path / "ckpt")


def test_saving_an_out_of_range_route_table_names_it(tmp_path: Path):
    model = tiny_model()
    model.layers[1].mlp["engine"].route_table[0, 3] = 4
    with pytest.raises(CheckpointError, match=re.escape("layers.1.mlp.engine.route_table: routes to "
                                                        "experts outside [0, 4)")):
        save_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
