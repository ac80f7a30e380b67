"""Parity of cflib against the independent reference in independent_reference.py.

Checkpoints and shards are produced by the independent writer (never by
cflib), loaded through cflib's public API, and compared against a float64,
one-sequence-at-a-time reference forward pass written from docs/formats.md alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

# Works whether tests/ is on sys.path (rootdir-less pytest) or is a package.
try:
    import independent_reference as ref
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import independent_reference as ref

# cflib is imported inside each test (not at module level) so that a single
# missing cflib module fails only the tests that need it, with a clear error.

LOGIT_ATOL = 1e-4
LOSS_ATOL = 1e-4
EOS_ID = 0
MAX_SEQ_LEN = 48


def tiny_config(**overrides: object) -> dict:
    """Small config with every config.json key of docs/formats.md#the-released-200m-configuration."""
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # head_dim 16, two query heads per KV head
        "use_qk_norm": True,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": 97,
        "max_position_embeddings": 128,
        "shared_intermediate_size": 96,
        "num_experts": 4,
        "intermediate_size": 64,  # total routed width: 16 per expert
        "num_experts_per_tok": 2,
        "top_k_primary_weight": 0.5,
        "routing_strategy": "token_id_multi_hash",
        "route_hash_count": 2,
        "shared_output_scale": 1.0,
        "routed_output_scale": 2.0,
        "tie_word_embeddings": True,
    }
    cfg.update(overrides)
    return cfg


CASES = {
    # The released shape of routing (top-2, 0.5/0.5, scales 1.0/2.0).
    "released_routing": tiny_config(),
    # Unequal route weights catch swapped/averaged weights; unequal scales catch
    # swapped scales; a non-default rope_theta catches a hard-coded 10000.
    "primary_0.7": tiny_config(
        top_k_primary_weight=0.7,
        shared_output_scale=0.75,
        routed_output_scale=1.5,
        rope_theta=50000.0,
    ),
    # top-3: the non-primary weight (1 - w0) / (top_k - 1) is 0.2, not 1 - w0.
    "top3": tiny_config(num_experts_per_tok=3, top_k_primary_weight=0.6, route_hash_count=3),
}


def make_examples(vocab_size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """~12 (prompt, answer) pairs of varied lengths, including edge cases:
    a one-token prompt, an empty answer (only EOS supervised), and an example
    exactly MAX_SEQ_LEN long."""
    rng = np.random.default_rng(seed)
    lengths = [(1, 5), (3, 0), (7, 12), (12, 3), (2, 20), (9, 9),
               (20, 27), (5, 1), (15, 15), (4, 30), (11, 6), (6, 17)]
    assert any(p + a + 1 == MAX_SEQ_LEN for p, a in lengths)

    def draw(n: int) -> list[int]:
        # Content tokens avoid EOS so EOS only ever appears as the terminator.
        return [int(t) for t in rng.integers(1, vocab_size, size=n)]

    return [(draw(p), draw(a)) for p, a in lengths]


@dataclass
class Case:
    cfg: dict
    ckpt: Path
    shard_root: Path
    state: dict[str, torch.Tensor]
    examples: list[tuple[np.ndarray, np.ndarray]]  # (input_ids, labels) as written


@pytest.fixture(params=sorted(CASES), ids=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    cfg = CASES[request.param]
    ckpt = tmp_path / "ckpt"
    ref.write_public_checkpoint(ckpt, cfg, seed=1234)
    state, _ = ref.load_public_checkpoint(ckpt)
    shard_root = tmp_path / "data"
    examples = ref.write_public_shard(
        shard_root, "eval", make_examples(cfg["vocab_size"], seed=99),
        vocab_size=cfg["vocab_size"], eos_token_id=EOS_ID, max_seq_len=MAX_SEQ_LEN,
    )
    return Case(cfg, ckpt, shard_root, state, examples)


def cflib_logits(model: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
    """cflib's forward returns final-normed hidden states; apply the tied head."""
    with torch.no_grad():
        hidden = model(torch.as_tensor(ids, dtype=torch.int64)[None])
    assert hidden.shape == (1, len(ids), model.embed_tokens.weight.shape[1])
    return (hidden[0] @ model.embed_tokens.weight.T).double()


# ---------------------------------------------------------------------------
# Forward-pass parity
# ---------------------------------------------------------------------------


def test_loaded_model_is_fp32_on_cpu(case: Case) -> None:
    from cflib.model.checkpoint import load_checkpoint

    model = load_checkpoint(case.ckpt)
    assert isinstance(model, torch.nn.Module)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert tensor.device.type == "cpu", name
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32, name


def test_logits_match_reference_for_every_example(case: Case) -> None:
    from cflib.model.checkpoint import load_checkpoint

    model = load_checkpoint(case.ckpt).eval()
    for idx, (ids, _labels) in enumerate(case.examples):
        expected = ref.reference_logits(case.state, case.cfg, torch.as_tensor(ids))
        got = cflib_logits(model, ids)
        err = (got - expected).abs().max().item()
        assert err < LOGIT_ATOL, f"example {idx} (T={len(ids)}): max |logit diff| = {err:.3e}"


def test_derived_buffers_are_optional(case: Case, tmp_path: Path) -> None:
    """The derived buffers "may" be present: a checkpoint without them must
    load too and give the same logits."""
    from cflib.model.checkpoint import load_checkpoint

    bare = tmp_path / "bare"
    ref.write_public_checkpoint(bare, case.cfg, seed=1234, derived_buffers=False)
    model = load_checkpoint(bare).eval()
    ids = case.examples[6][0]
    expected = ref.reference_logits(case.state, case.cfg, torch.as_tensor(ids))
    assert (cflib_logits(model, ids) - expected).abs().max().item() < LOGIT_ATOL


def test_route_table_is_loaded_not_rebuilt(case: Case) -> None:
    from cflib.model.checkpoint import load_checkpoint

    model = load_checkpoint(case.ckpt)
    loaded = model.state_dict()
    e, top_k, v = case.cfg["num_experts"], case.cfg["num_experts_per_tok"], case.cfg["vocab_size"]
    modulo = torch.stack([(torch.arange(v) + k) % e for k in range(top_k)])
    for i in range(case.cfg["num_hidden_layers"]):
        key = f"layers.{i}.mlp.engine.route_table"
        written = case.state[key]
        # Guard on the fixture itself: a modulo table would make this test toothless.
        assert not torch.equal(written, modulo)
        assert key in loaded, f"{key} missing from model.state_dict()"
        assert tuple(loaded[key].shape) == (top_k, v)
        assert torch.equal(loaded[key].cpu().to(torch.int64), written), key


# ---------------------------------------------------------------------------
# Evaluation parity
# ---------------------------------------------------------------------------


def test_eval_loss_matches_reference(case: Case) -> None:
    from cflib.data.shards import open_shard
    from cflib.model.checkpoint import load_checkpoint
    from cflib.train.held_out import eval_loss

    model = load_checkpoint(case.ckpt)
    shard = open_shard(case.shard_root, "eval")
    # loss_chunk_tokens=7 does not divide any natural size, so chunk edges are exercised.
    result = eval_loss(model, shard, micro_batch=4, device="cpu", bf16=False,
                       loss_chunk_tokens=7, fp32_loss=True)

    supervised = sum(int((labels != ref.IGNORE_INDEX).sum()) for _, labels in case.examples)
    expected = ref.reference_eval_loss(case.state, case.cfg, case.examples)
    assert result["supervised_tokens"] == supervised
    assert abs(result["loss"] - expected) < LOSS_ATOL, (result["loss"], expected)


# ---------------------------------------------------------------------------
# Loader strictness
# ---------------------------------------------------------------------------


def rewrite_checkpoint(
    src: Path, dst: Path, mutate: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """Copy a checkpoint, editing its tensor dict in place via `mutate`."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def assert_load_fails_naming(ckpt: Path, name: str) -> None:
    from cflib.model.checkpoint import load_checkpoint

    with pytest.raises(Exception) as excinfo:
        load_checkpoint(ckpt)
    assert name in str(excinfo.value), f"error does not name {name!r}: {excinfo.value!r}"


@pytest.fixture
def good_ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "good"
    ref.write_public_checkpoint(path, CASES["released_routing"], seed=7)
    return path


@pytest.mark.parametrize(
    "name",
    [
        "layers.1.mlp.engine.expert_up",
        "layers.0.mlp.engine.route_table",  # must never be silently rebuilt
        "norm.weight",
    ],
)
def test_missing_tensor_is_named(good_ckpt: Path, tmp_path: Path, name: str) -> None:
    bad = rewrite_checkpoint(good_ckpt, tmp_path / "bad", lambda t: t.pop(name))
    assert_load_fails_naming(bad, name)


@pytest.mark.parametrize(
    "name, make_bad",
    [
        # Transposed: same numel, so only a real shape check catches it.
        ("layers.0.self_attn.k_proj.weight", lambda t: t.T.contiguous()),
        ("layers.1.mlp.engine.expert_gate", lambda t: t.transpose(1, 2).contiguous()),
        ("layers.0.mlp.engine.route_table", lambda t: t[:, :-1].contiguous()),
        ("norm.weight", lambda t: torch.ones(t.shape[0] + 1)),
    ],
    ids=["k_proj_transposed", "expert_gate_transposed", "route_table_short", "norm_too_long"],
)
def test_wrong_shape_is_named(
    good_ckpt: Path, tmp_path: Path, name: str, make_bad: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    def mutate(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = make_bad(tensors[name])

    bad = rewrite_checkpoint(good_ckpt, tmp_path / "bad", mutate)
    assert_load_fails_naming(bad, name)


@pytest.mark.parametrize(
    "name, tensor",
    [
        # A learned router does not exist in TR-MoE; loading must not ignore it.
        ("layers.0.mlp.router.weight", torch.zeros(4, 64)),
        # A layer beyond num_hidden_layers.
        ("layers.2.input_layernorm.weight", torch.ones(64)),
    ],
    ids=["learned_router", "extra_layer"],
)
def test_unknown_tensor_is_named(good_ckpt: Path, tmp_path: Path, name: str, tensor: torch.Tensor) -> None:
    bad = rewrite_checkpoint(good_ckpt, tmp_path / "bad", lambda t: t.__setitem__(name, tensor))
    assert_load_fails_naming(bad, name)


# ---------------------------------------------------------------------------
# Self-checks of the independent writer (no cflib needed)
# ---------------------------------------------------------------------------


def test_reference_writer_produces_public_layout(case: Case) -> None:
    """The writer emits exactly the public names/shapes plus the derived buffers."""
    expected = ref.public_tensor_shapes(case.cfg)
    derived_suffixes = ("self_attn.rotary_emb.inv_freq", "mlp.engine.fused_route_codes",
                        "mlp.engine.fused_expert_pairs")
    for name, tensor in case.state.items():
        if name.endswith(derived_suffixes):
            continue
        assert tuple(tensor.shape) == expected[name], name
        want = torch.int64 if name.endswith("route_table") else torch.float32
        assert tensor.dtype == want, name
    assert set(expected) <= set(case.state)
    for i in range(case.cfg["num_hidden_layers"]):
        table = case.state[f"layers.{i}.mlp.engine.route_table"]
        # Distinct experts per token.
        assert all(len(set(col.tolist())) == table.shape[0] for col in table.T)
    cfg_on_disk = json.loads((case.ckpt / "config.json").read_text())
    assert all(cfg_on_disk[k] == case.cfg[k] for k in ref.CONFIG_KEYS)


def test_reference_shard_is_causally_aligned(case: Case) -> None:
    part = case.shard_root / "eval"
    ids = np.fromfile(part / "input_ids.bin", dtype="<u4")
    labels = np.fromfile(part / "labels.bin", dtype="<i4")
    rows = [json.loads(line) for line in (part / "examples.jsonl").read_text().splitlines()]
    index = json.loads((part / "sft.idx.json").read_text())
    assert index["num_tokens"] == len(ids) == len(labels)
    assert index["examples"] == len(rows) == len(case.examples)
    for row, (ex_ids, ex_labels) in zip(rows, case.examples):
        sl = slice(row["offset"], row["offset"] + row["num_tokens"])
        assert np.array_equal(ids[sl], ex_ids) and np.array_equal(labels[sl], ex_labels)
        assert ex_ids[-1] == EOS_ID and ex_labels[-1] == ref.IGNORE_INDEX
        sup = np.nonzero(ex_labels != ref.IGNORE_INDEX)[0]
        assert np.array_equal(ex_labels[sup], ex_ids[sup + 1])
        assert row["supervised_tokens"] == len(sup)
