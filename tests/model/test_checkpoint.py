"""Checkpoints: public layout, exact round trip, trainer state, atomic saves, load errors."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import cflib.model.checkpoint
from cflib.model.checkpoint import CheckpointError, load_checkpoint, load_trainer_state, save_checkpoint
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel

try:
    from tiny_models import logits, random_ids, tiny_model
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import logits, random_ids, tiny_model

WEIGHTS = "model.safetensors"


def public_layout(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of docs/formats.md#the-checkpoint-layout (no derived buffers)."""
    d, v, hd = config.hidden_size, config.vocab_size, config.head_dim
    hq, hkv, s = config.num_attention_heads, config.num_key_value_heads, config.shared_intermediate_size
    e, w, k = config.num_experts, config.expert_width, config.num_experts_per_tok
    layout: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, d), "norm.weight": (d,)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        layout.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (hq * hd, d), p + "self_attn.k_proj.weight": (hkv * hd, d),
            p + "self_attn.v_proj.weight": (hkv * hd, d), p + "self_attn.o_proj.weight": (d, hq * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.engine.shared_gate.weight": (s, d), p + "mlp.engine.shared_up.weight": (s, d),
            p + "mlp.engine.shared_down.weight": (d, s),
            p + "mlp.engine.expert_gate": (e, d, w), p + "mlp.engine.expert_up": (e, d, w),
            p + "mlp.engine.expert_down": (e, w, d), p + "mlp.engine.route_table": (k, v),
        })
    return layout


def route_tables(model: TRMoEModel) -> list[torch.Tensor]:
    return [layer.mlp["engine"].route_table for layer in model.layers]


def randomise_route_tables(model: TRMoEModel, seed: int) -> None:
    """Give every layer its own random table (distinct experts per token), unlike any built one."""
    config, gen = model.config, torch.Generator().manual_seed(seed)
    for table in route_tables(model):
        perms = torch.argsort(torch.rand(config.vocab_size, config.num_experts, generator=gen), dim=1)
        table.copy_(perms[:, :config.num_experts_per_tok].T)


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[TRMoEModel, Path]:
    """A tiny model with custom route tables, saved to tmp_path/ckpt."""
    model = tiny_model(seed=7)
    randomise_route_tables(model, seed=11)
    return model, save_checkpoint(model, tmp_path / "ckpt")


@torch.no_grad()
def test_round_trip_reproduces_logits_and_route_tables(saved: tuple[TRMoEModel, Path]) -> None:
    model, path = saved
    loaded = load_checkpoint(path).eval()
    assert loaded.config == model.config
    ids = random_ids(model.config.vocab_size, 2, 8)
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    for got, want in zip(route_tables(loaded), route_tables(model)):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    assert not torch.equal(route_tables(loaded)[0], TRMoEModel(model.config).layers[0].mlp["engine"].route_table)


def derived_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The derived buffers (docs/formats.md#derived-buffers) of a top-2 model over 4 experts: names, shapes, dtypes."""
    pairs = config.num_experts * (config.num_experts - 1) // 2
    layout = {}
    for i in range(config.num_hidden_layers):
        layout[f"layers.{i}.self_attn.rotary_emb.inv_freq"] = ((config.head_dim // 2,), torch.float32)
        layout[f"layers.{i}.mlp.engine.fused_expert_pairs"] = ((pairs, 2), torch.int32)
        layout[f"layers.{i}.mlp.engine.fused_route_codes"] = ((config.vocab_size,), torch.uint8)
    return layout


def test_written_files_follow_the_public_layout(saved: tuple[TRMoEModel, Path]) -> None:
    model, path = saved
    assert sorted(os.listdir(path)) == ["config.json", WEIGHTS]
    assert json.loads((path / "config.json").read_text()) == model.config.to_dict()
    layout = public_layout(model.config)
    derived = derived_layout(model.config)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        names = set(f.keys())
        assert names == set(layout) | set(derived)
        assert f.metadata() == {"format": "pt"}
        for name in layout:
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == layout[name], name
            expected = torch.int64 if name.endswith("route_table") else torch.float32
            assert tensor.dtype == expected, name
        for name, (shape, dtype) in derived.items():
            tensor = f.get_tensor(name)
            assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), name


def test_load_in_bf16_keeps_integer_route_tables(saved: tuple[TRMoEModel, Path]) -> None:
    model, path = saved
    loaded = load_checkpoint(path, dtype=torch.bfloat16)
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    for got, want in zip(route_tables(loaded), route_tables(model)):
        assert got.dtype == torch.int64 and torch.equal(got, want)


def adamw_with_scheduler(model: TRMoEModel) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return optimizer, scheduler


def train_step(model: TRMoEModel, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, ids: torch.Tensor) -> None:
    optimizer.zero_grad()
    logits(model, ids).square().mean().backward()
    optimizer.step()
    scheduler.step()


def test_trainer_state_round_trip_restores_a_fresh_optimizer(tmp_path: Path) -> None:
    model = tiny_model().train()
    optimizer, scheduler = adamw_with_scheduler(model)
    ids = random_ids(model.config.vocab_size, 2, 6)
    train_step(model, optimizer, scheduler, ids)
    path = save_checkpoint(model, tmp_path / "ckpt",
                           trainer_state={"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                          "step": 1})

    state = load_trainer_state(path)
    assert state["step"] == 1
    restored = load_checkpoint(path).train()
    optimizer2, scheduler2 = adamw_with_scheduler(restored)
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert optimizer2.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]

    # One more identical step on both sides lands on identical weights.
    train_step(model, optimizer, scheduler, ids)
    train_step(restored, optimizer2, scheduler2, ids)
    for (name, want), got in zip(model.named_parameters(), restored.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


class Payload:
    """A picklable class: weights_only loading must refuse it."""


def test_load_trainer_state_refuses_pickled_objects(saved: tuple[TRMoEModel, Path]) -> None:
    _, path = saved
    torch.save({"step": 1, "payload": Payload()}, path / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer_state.pt: refused: it holds Python objects") as caught:
        load_trainer_state(path)
    assert "weights_only" not in str(caught.value)  # torch's advice to load it with its code is never passed on


def test_saving_over_a_checkpoint_replaces_it(saved: tuple[TRMoEModel, Path]) -> None:
    _, path = saved
    newer = tiny_model(seed=8)
    save_checkpoint(newer, path)
    ids = random_ids(newer.config.vocab_size, 1, 5)
    with torch.no_grad():
        assert torch.equal(logits(load_checkpoint(path).eval(), ids), logits(newer, ids))
    assert os.listdir(path.parent) == [path.name]  # no staging or retired directories


def test_every_file_of_a_checkpoint_is_as_readable_as_the_umask_makes_new_files(tmp_path: Path) -> None:
    """safetensors writes its file private (0600): a checkpoint copied to a shared folder would be half unreadable."""
    previous = os.umask(0o022)
    try:
        path = save_checkpoint(tiny_model(seed=1), tmp_path / "ckpt", trainer_state={"step": 1})
    finally:
        os.umask(previous)
    assert {entry.name: oct(entry.stat().st_mode & 0o777) for entry in path.iterdir()} == dict.fromkeys(
        ("config.json", WEIGHTS, "trainer_state.pt"), "0o644")


def fail_in_save_file(monkeypatch: pytest.MonkeyPatch, path: Path) -> dict[str, object] | None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full (injected)")
    monkeypatch.setattr(cflib.model.checkpoint, "save_file", broken)
    return None


def fail_in_torch_save(monkeypatch: pytest.MonkeyPatch, path: Path) -> dict[str, object] | None:
    return {"schedule": lambda step: step}  # torch.save cannot pickle a lambda


def fail_in_publish(monkeypatch: pytest.MonkeyPatch, path: Path) -> dict[str, object] | None:
    """The move of the finished staging directory onto the checkpoint path fails (once)."""
    real_replace = os.replace
    failed: list[bool] = []

    def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if Path(dst) == path and not failed:
            failed.append(True)
            raise OSError("rename failed (injected)")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    import cflib.atomic

    real_exchange = cflib.atomic._exchange

    def exchange(a: Path, b: Path) -> bool:  # the one-step swap that replaces an existing folder
        if Path(b) == path and not failed:
            failed.append(True)
            raise OSError("exchange failed (injected)")
        return real_exchange(a, b)
    monkeypatch.setattr(cflib.atomic, "_exchange", exchange)
    return None


FAILURES = [fail_in_save_file, fail_in_torch_save, fail_in_publish]


@pytest.mark.parametrize("inject", FAILURES, ids=lambda f: f.__name__)
def test_failing_save_keeps_the_previous_checkpoint(saved: tuple[TRMoEModel, Path], monkeypatch: pytest.MonkeyPatch,
                                                    inject: Callable[..., dict[str, object] | None]) -> None:
    model, path = saved
    before = tree_bytes(path)
    trainer_state = inject(monkeypatch, path)
    with pytest.raises(Exception):
        save_checkpoint(tiny_model(seed=8), path, trainer_state=trainer_state)
    monkeypatch.undo()
    assert os.listdir(path.parent) == [path.name], "staging or retired directories left behind"
    assert tree_bytes(path) == before
    ids = random_ids(model.config.vocab_size, 1, 5)
    with torch.no_grad():
        assert torch.equal(logits(load_checkpoint(path).eval(), ids), logits(model, ids))


@pytest.mark.parametrize("inject", FAILURES, ids=lambda f: f.__name__)
def test_failing_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           inject: Callable[..., dict[str, object] | None]) -> None:
    path = tmp_path / "ckpt"
    trainer_state = inject(monkeypatch, path)
    with pytest.raises(Exception):
        save_checkpoint(tiny_model(), path, trainer_state=trainer_state)
    assert os.listdir(tmp_path) == []


def test_missing_directory_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)


def test_missing_config_is_named(saved: tuple[TRMoEModel, Path]) -> None:
    _, path = saved
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=re.escape(str(path / "config.json"))):
        load_checkpoint(path)


def test_a_run_folder_is_named_as_one_with_the_checkpoint_to_give(tmp_path: Path) -> None:
    """A run folder given where a checkpoint is wanted (init_checkpoint: RUN): the message says what it is and
    names its best checkpoint, else its last, else its newest numbered one."""
    run = tmp_path / "run"
    for name in ("epoch-1", "last", "best"):
        save_checkpoint(tiny_model(), run / "checkpoints" / name)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{run}: a run folder, not a checkpoint (config.json + model.safetensors): name one of its "
                f"checkpoints, e.g. {run / 'checkpoints' / name}")):
            load_checkpoint(run)


def test_missing_weights_are_named(saved: tuple[TRMoEModel, Path]) -> None:
    _, path = saved
    (path / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(path / WEIGHTS))):
        load_checkpoint(path)


@pytest.mark.parametrize("corrupt", [
    lambda data: os.urandom(64),                    # garbage bytes
    lambda data: b"\x00\x01",                       # shorter than the header length
    lambda data: data[: len(data) // 2],            # truncated tensor data
], ids=["garbage", "tiny", "truncated"])
def test_corrupt_weights_are_named(saved: tuple[TRMoEModel, Path], corrupt: Callable[[bytes], bytes]) -> None:
    _, path = saved
    weights = path / WEIGHTS
    weights.write_bytes(corrupt(weights.read_bytes()))
    with pytest.raises(CheckpointError, match=re.escape(str(weights))):
        load_checkpoint(path)


@pytest.mark.parametrize("bad_value", [4, -1])
def test_out_of_range_route_table_is_named(saved: tuple[TRMoEModel, Path], bad_value: int) -> None:
    _, path = saved
    name = "layers.1.mlp.engine.route_table"

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][1, 17] = bad_value
    rewrite_weights(path, poison)
    with pytest.raises(CheckpointError, match=re.escape(repr(name))):
        load_checkpoint(path)


def test_float_route_table_is_named(saved: tuple[TRMoEModel, Path]) -> None:
    _, path = saved
    name = "layers.0.mlp.engine.route_table"

    def to_float(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].float()
    rewrite_weights(path, to_float)
    with pytest.raises(CheckpointError, match=re.escape(repr(name))):
        load_checkpoint(path)


def test_int32_route_table_is_accepted_as_int64(saved: tuple[TRMoEModel, Path]) -> None:
    model, path = saved

    def to_int32(tensors: dict[str, torch.Tensor]) -> None:
        for name in tensors:
            if name.endswith("route_table"):
                tensors[name] = tensors[name].int()
    rewrite_weights(path, to_int32)
    for got, want in zip(route_tables(load_checkpoint(path)), route_tables(model)):
        assert got.dtype == torch.int64 and torch.equal(got, want)


def test_a_checkpoint_of_another_routing_strategy_loads_its_own_tables(tmp_path: Path) -> None:
    model = tiny_model()
    with torch.no_grad():
        for layer in model.layers:
            table = layer.mlp["engine"].route_table
            table.copy_(torch.flip(table, dims=[0]))  # not what any builder makes
    path = save_checkpoint(model, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "routing_strategy": "published_hash_v7"}))
    loaded = load_checkpoint(path)
    for mine, theirs in zip(model.layers, loaded.layers):
        assert torch.equal(mine.mlp["engine"].route_table, theirs.mlp["engine"].route_table)
