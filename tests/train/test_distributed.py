"""Data parallelism on CPU with real torchrun processes (gloo): equivalence, sharding, nodes, failures."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mixture_helpers import mixture, task_roots
from safetensors.torch import load_file

from cflib.data.mixture import plan_mixture
from cflib.lab.report import summary
from cflib.model.checkpoint import load_checkpoint
from cflib.model.config import preset
from cflib.model.derived import DERIVED_SUFFIXES
from cflib.train import prepare, train
from cflib.train.distributed import DistContext, epoch_stream, memory_estimate, rank_share, whole_batches
from cflib.train.launch import fit
from cflib.train.launch_failures import LaunchError
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics

try:
    from processes import wait_until_gone, worker_pids
except ImportError:  # run from the repository root as a package
    from tests.processes import wait_until_gone, worker_pids

BASE = {"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 16, "lr": 3e-3,
        "exact_match_limit": 0, "device": "cpu", "max_steps": 3, "eval_at_start": False}


def train_losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r["event"] == "train"]


@pytest.mark.parametrize("num_examples, world, micro, accum", [(40, 2, 4, 2), (37, 3, 2, 2), (64, 2, 8, 4)])
def test_ranks_share_each_epoch_once_plus_counted_fill_ins(num_examples, world, micro, accum):
    global_batch = micro * world * accum
    order, fill_ins = epoch_stream(num_examples, seed=5, epoch=2, global_batch=global_batch)
    assert fill_ins == -num_examples % global_batch and len(order) % global_batch == 0
    seen = []
    for start in range(0, len(order), global_batch):
        shares = [rank_share(order[start:start + global_batch], DistContext(rank, world)) for rank in range(world)]
        assert all(len(share) == micro * accum for share in shares)
        seen += [int(i) for share in shares for i in share]
    counts = np.bincount(seen, minlength=num_examples)
    assert (counts >= 1).all() and counts.sum() == num_examples + fill_ins  # every example, fill-ins counted
    assert (counts == 2).sum() == fill_ins


def test_epochs_reshuffle_reproducibly():
    first, _ = epoch_stream(50, seed=1, epoch=1, global_batch=10)
    assert np.array_equal(first, epoch_stream(50, seed=1, epoch=1, global_batch=10)[0])
    assert not np.array_equal(first, epoch_stream(50, seed=1, epoch=2, global_batch=10)[0])


def test_ranks_take_disjoint_slices_of_one_mixture_order():
    """Every rank computes the epoch's global order from (seed, epoch) alone and takes its own slice of each global
    batch: the slices never overlap, and together they are the epoch's draw, fill-ins counted."""
    plan = plan_mixture(["addition", "uppercase"], ["a", "b"], [0.8, 0.2], [30, 12], 40, seed=3)
    world, global_batch = 2, 16
    for epoch in (1, 2):
        order, fill_ins = whole_batches(plan.epoch(epoch), global_batch)
        assert fill_ins == 8
        slots = np.arange(len(order))  # positions in the global order, which each rank recomputes on its own
        taken = {rank: [] for rank in range(world)}
        for start in range(0, len(order), global_batch):
            for rank in range(world):
                taken[rank] += rank_share(slots[start:start + global_batch], DistContext(rank, world)).tolist()
        assert not set(taken[0]) & set(taken[1]) and sorted(taken[0] + taken[1]) == slots.tolist()
        drawn = np.bincount(order[taken[0] + taken[1]], minlength=42)
        assert drawn.sum() == 48 and drawn[:30].sum() >= 32 and drawn[30:].sum() >= 8


# Every evaluation's held-out loss, and the highest chooses best/: the first evaluation after step 0, not the last
# weights, so a best/ that followed the last checkpoint (or a rank that decided otherwise) shows.
BEST = {"eval_every_steps": 1, "best_metric": "eval_loss", "greater_is_better": True, "collective_timeout_s": 120}


def assert_trained_like_one(one: Path, two: Path, single: dict, double: dict, strategy: str) -> None:
    """The two-process run's losses, last and best weights and best_metric entry are the one-process run's."""
    assert single["world_size"] == 1 and double["world_size"] == 2 and double["strategy"] == strategy
    assert double["device"]["count"] == 2
    assert double["grad_accum"] == 2 and single["grad_accum"] == 4
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=0, atol=1e-5)
    for checkpoint in ("last", "best"):
        a = load_checkpoint(one / "checkpoints" / checkpoint).state_dict()
        b = load_checkpoint(two / "checkpoints" / checkpoint).state_dict()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=f"{checkpoint}: {name}")
    # Gathered weights (FSDP) are written with the derived buffers too, and load_checkpoint found them agreeing.
    for checkpoint in ("last", "best"):
        written = load_file(str(two / "checkpoints" / checkpoint / "model.safetensors"))
        assert {f"layers.{i}.{suffix}" for i in range(2) for suffix in DERIVED_SUFFIXES} <= written.keys()
    # best/: rank 0's choice (every rank joined its save under FSDP), as the one-process run chose it
    evals = [r for r in read_metrics(two / "metrics.jsonl") if r["event"] == "eval"]
    chosen = max(evals, key=lambda r: r["loss"])
    assert [r["step"] for r in evals] == list(range(1, double["schedule"]["steps_done"] + 1))
    assert chosen["step"] == 1
    assert double["best_metric"] == {"name": "eval_loss", "greater_is_better": True, "step": 1,
                                     "value": pytest.approx(chosen["loss"], abs=0)}
    assert single["best_metric"] == {**double["best_metric"], "value": pytest.approx(chosen["loss"], abs=1e-5)}
    assert double["checkpoints"]["best_step"] == "1"
    last = load_checkpoint(two / "checkpoints" / "last").state_dict()
    best = load_checkpoint(two / "checkpoints" / "best").state_dict()
    assert any(not torch.equal(best[name], last[name]) for name in best)


def assert_frozen(two: Path, frozen: set[str], single: dict, double: dict) -> None:
    """The two-process run's `frozen` weights are the preset's starting ones (prepare seeds with seed 0), every
    other weight trained, and both runs count the same trainable parameters."""
    from cflib.model.decoder import TRMoEModel

    torch.manual_seed(0)
    start = TRMoEModel(preset("smoke")).state_dict()
    last = load_checkpoint(two / "checkpoints" / "last")
    assert {name for name, value in last.named_parameters() if torch.equal(value, start[name])} == frozen
    assert double["params_trainable"] == single["params_trainable"] == double["params_total"] - sum(
        start[name].numel() for name in frozen)


@pytest.mark.slow
def test_two_ddp_processes_pack_weigh_and_report_like_one(tmp_path):
    """Workers skip the preflight their launcher ran, plan the same windows and weigh the same tokens; rank 0
    alone reports to the trackers. The embeddings (and the tied head) stay frozen on every rank: DDP reduces the
    others' gradients alone. Each rank distils from its own copy of a teacher, whose KL term (over packed windows,
    weighted) is summed over the ranks as the loss is."""
    groups = {"arithmetic": {"target_share": 0.4, "tasks": ["addition"], "task_target_shares": {"addition": 1.0}},
              "text": {"target_share": 0.6, "tasks": ["uppercase"], "task_target_shares": {"uppercase": 1.0}}}
    packed = {**BASE, **BEST, "pack_sequences": True, "loss_groups": groups, "frozen_modules": "embeddings",
              "teacher_checkpoint": str(lora_base(tmp_path / "teacher")), "distill_temperature": 2.0}
    single = train({**packed, "out_dir": str(tmp_path / "one")}, progress=False)
    double = train({**packed, "out_dir": str(tmp_path / "two"), "nproc_per_node": 2, "strategy": "ddp",
                    "report_to": "tensorboard"}, progress=False)
    assert_trained_like_one(tmp_path / "one", tmp_path / "two", single, double, "ddp")
    assert_frozen(tmp_path / "two", {"embed_tokens.weight"}, single, double)
    assert double["kernel_path"]["attention"] == "sdpa_mask"
    assert double["packing"] == single["packing"] and double["loss_weighting"] == single["loss_weighting"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 1 wrote none
    events = EventAccumulator(str(tmp_path / "two" / "tensorboard")).Reload()
    for name in ("loss", "kl_loss"):
        assert [(s.step, s.value) for s in events.Scalars(f"train/{name}")] == [
            (r["step"], pytest.approx(r[name], rel=1e-6))
            for r in read_metrics(tmp_path / "two" / "metrics.jsonl") if r["event"] == "train"]
    kl = {folder: [r["kl_loss"] for r in read_metrics(tmp_path / folder / "metrics.jsonl") if r["event"] == "train"]
          for folder in ("one", "two")}
    np.testing.assert_allclose(kl["two"], kl["one"], rtol=0, atol=1e-6)
    assert double["execution_plan"]["distill"]["teacher"] == single["execution_plan"]["distill"]["teacher"]


@pytest.mark.slow
def test_two_fsdp_processes_draw_one_mixture_like_one_process(tmp_path):
    """Two gloo workers open the mixture unchecked (their launcher checked it) and train on their slices of one
    global order: the losses, the draw and the per-source evaluation are those of one process. Under FSDP every
    rank evaluates; rank 0 decides whether best/ improved and every rank joins in gathering it."""
    roots = task_roots(tmp_path / "roots", {"addition": 30, "uppercase": 12}, held_out=6)
    mixed = {**BASE, **BEST, "data": mixture(roots, {"addition": 0.8, "uppercase": 0.2}), "examples_per_epoch": 40,
             "max_steps": 4,  # into a second epoch, drawn anew
             "frozen_modules": "experts", "frozen_layers": "0"}  # frozen and trained weights in one shard group
    single = train({**mixed, "out_dir": str(tmp_path / "one")}, progress=False)
    double = train({**mixed, "out_dir": str(tmp_path / "two"), "nproc_per_node": 2, "strategy": "fsdp"},
                   progress=False)
    assert_trained_like_one(tmp_path / "one", tmp_path / "two", single, double, "fsdp")
    assert_frozen(tmp_path / "two", {f"layers.0.mlp.engine.{name}" for name in ("expert_gate", "expert_up",
                                                                               "expert_down")}, single, double)
    assert double["data"]["mixture"] == single["data"]["mixture"]
    for source, loss in single["eval"]["final"]["loss_by_source"].items():
        assert double["eval"]["final"]["loss_by_source"][source] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_two_ddp_processes_pack_a_mixture_s_draws_like_one_process(tmp_path):
    """Each worker packs every epoch's draw itself, from the seed and the epoch alone: the windows, the losses, the
    draw and the per-source evaluation are one process's, the epochs after the first planned as they start."""
    roots = task_roots(tmp_path / "roots", {"addition": 30, "uppercase": 12}, held_out=6)
    packed = {**BASE, **BEST, "data": mixture(roots, {"addition": 0.8, "uppercase": 0.2}), "examples_per_epoch": 80,
              "pack_sequences": True, "max_steps": 5}  # about 22 windows an epoch, 16 a step: into a third epoch
    single = train({**packed, "out_dir": str(tmp_path / "one")}, progress=False)
    double = train({**packed, "out_dir": str(tmp_path / "two"), "nproc_per_node": 2, "strategy": "ddp"},
                   progress=False)
    assert_trained_like_one(tmp_path / "one", tmp_path / "two", single, double, "ddp")
    assert double["data"]["mixture"] == single["data"]["mixture"] and double["packing"] == single["packing"]
    assert single["packing"]["epochs"] == 3 and double["kernel_path"]["attention"] == "sdpa_mask"
    for source, loss in single["eval"]["final"]["loss_by_source"].items():
        assert double["eval"]["final"]["loss_by_source"][source] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_two_fsdp_processes_step_muon_like_one(tmp_path):
    """torch's Muon steps the 2-D matrices and AdamW the rest on every rank, on FSDP's DTensor shards (DTensor
    gathers what the Newton-Schulz iteration multiplies), its state saved whole. (Under DDP every rank steps the
    same reduced gradients, as with AdamW.) The iteration runs in BF16 (torch's), where gradients summed in another
    order and products summed over the shards round apart by about 0.4%, which it carries into about 5% of the
    orthogonalised update: the runs agree to that, not to float32 (within a third of one step's update,
    lr x 0.2 sqrt(128) x 0.3)."""
    strategy = "fsdp"
    muon = {**BASE, "optimizer": "muon", "lr": 1e-2, "save_optimizer_state": True}
    single = train({**muon, "out_dir": str(tmp_path / "one")}, progress=False)
    double = train({**muon, "out_dir": str(tmp_path / "two"), "nproc_per_node": 2, "strategy": strategy},
                   progress=False)
    assert double["strategy"] == strategy and double["world_size"] == 2 and double["grad_accum"] == 2
    np.testing.assert_allclose(train_losses(tmp_path / "two"), train_losses(tmp_path / "one"), rtol=0, atol=1e-3)
    one, two = (load_checkpoint(tmp_path / run / "checkpoints" / "last").state_dict() for run in ("one", "two"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=2e-3, msg=name)
    assert double["kernel_path"]["optimizer"] == single["kernel_path"]["optimizer"] == "torch_muon+torch"
    state = torch.load(tmp_path / "two" / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    momentum = state["optimizer"]["state"]["layers.0.mlp.engine.shared_up.weight"]["momentum_buffer"]
    assert momentum.shape == one["layers.0.mlp.engine.shared_up.weight"].shape  # gathered whole under FSDP


def lora_base(folder: Path) -> Path:
    from cflib.model.checkpoint import save_checkpoint
    from cflib.model.decoder import TRMoEModel

    torch.manual_seed(1)
    return save_checkpoint(TRMoEModel(preset("smoke")), folder)


def lora_params(base: Path, **overrides) -> dict:
    return {**BASE, "init_checkpoint": str(base), "full_parameter": False, "lora_rank": 4, "lr": 1e-2, **overrides}


def assert_adapters_like_one(one: Path, two: Path, loss_atol: float, weight_atol: float) -> None:
    from cflib.export.peft import read_adapter

    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=0, atol=loss_atol)
    first = read_adapter(one / "checkpoints" / "last")[2]
    second = read_adapter(two / "checkpoints" / "last")[2]
    assert set(first) == set(second)
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=weight_atol, msg=name)


@pytest.mark.slow
def test_two_fsdp_processes_train_lora_adapters_like_one(tmp_path):
    """Frozen BF16 base, trainable adapters: mixed dtypes in one shard group. (DDP's LoRA run: the two nodes'.) Kept
    close to that base by its KL (teacher_checkpoint: init): FSDP shards the student alone, every rank holds the
    teacher whole, its matrices in BF16."""
    lora = lora_params(lora_base(tmp_path / "base"), base_dtype="bfloat16", bf16=True, teacher_checkpoint="init",
                       distill_ratio=0.5)
    train({**lora, "out_dir": str(tmp_path / "one")}, progress=False)
    double = train({**lora, "out_dir": str(tmp_path / "two"), "nproc_per_node": 2, "strategy": "fsdp"},
                   progress=False)
    assert double["strategy"] == "fsdp" and double["params_trainable"] == double["lora"]["adapter_parameters"]
    assert double["execution_plan"]["distill"]["teacher"]["matrices_dtype"] == "bfloat16"
    assert train_rows_kl(tmp_path / "two")[0] == pytest.approx(0.0, abs=1e-6)  # B = 0: the student is its base
    # BF16 autocast: the two runs round differently
    assert_adapters_like_one(tmp_path / "one", tmp_path / "two", loss_atol=2e-2, weight_atol=5e-3)


def train_rows_kl(out_dir: Path) -> list[float]:
    return [r["kl_loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r["event"] == "train"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_rendezvous_on_localhost_and_train_lora_adapters_like_one(tmp_path):
    """Two launchers of one process each meet at a rendezvous: DDP across nodes, here on a frozen base with
    trainable adapters, which train as in one process."""
    lora = lora_params(lora_base(tmp_path / "base"))
    train({**lora, "out_dir": str(tmp_path / "one")}, progress=False)
    endpoint = f"127.0.0.1:{free_port()}"
    common = {**lora, "out_dir": str(tmp_path / "run"), "nnodes": 2, "rdzv_endpoint": endpoint}
    results: dict[int, object] = {}

    def node(rank: int) -> None:
        try:
            results[rank] = fit(prepare(TrainParams.from_dict({**common, "node_rank": rank})), progress=False)
        except Exception as err:  # reported below, from the main thread
            results[rank] = err

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results[0]["world_size"] == 2 and results[0]["strategy"] == "ddp", results
    assert results[0]["params_trainable"] == results[0]["lora"]["adapter_parameters"]
    assert results[1] == {"node_rank": 1, "world_size": 2}, results
    assert "rank 0 writes the record" in summary(results[1])  # the notebook's later cells on node 1
    assert len(train_losses(tmp_path / "run")) == 3
    assert_adapters_like_one(tmp_path / "one", tmp_path / "run", loss_atol=1e-5, weight_atol=1e-5)


@pytest.mark.slow
def test_killing_a_rank_ends_the_job_promptly_with_its_error(tmp_path):
    out_dir = tmp_path / "run"
    run = prepare(TrainParams.from_dict({**BASE, "out_dir": str(out_dir), "nproc_per_node": 2,
                                         "max_steps": 100_000, "save_checkpoints": False}))
    outcome: dict[str, object] = {}

    def launch() -> None:
        try:
            fit(run, progress=False)
        except LaunchError as err:
            outcome["error"] = err

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 60
    while not (out_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # mid-training, not mid-start-up
    pids = worker_pids(out_dir)
    assert len(pids) == 2, f"workers not found: {pids}"
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the job hung after a rank died"
    assert time.monotonic() - killed < 30
    message = str(outcome["error"])  # rank 1's end first, not the SIGTERM torchrun then sent rank 0
    assert message.startswith("rank 1 died: SIGKILL (signal 9)") and "torchrun exited with code 1" in message
    assert ".torchrun-node" not in message  # the launch folder is gone: none of its files is cited
    assert wait_until_gone(out_dir), "orphan workers left behind"


def test_launch_parameters_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ParamError, match="rdzv_endpoint"):
        TrainParams.from_dict({**BASE, "nnodes": 2})
    with pytest.raises(ParamError, match="node_rank 2"):
        TrainParams.from_dict({**BASE, "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"})
    with pytest.raises(ParamError, match="global_batch 16 is not a multiple .* world_size 3"):
        TrainParams.from_dict({**BASE, "nproc_per_node": 3})
    with pytest.raises(ParamError, match="strategy"):
        TrainParams.from_dict({**BASE, "strategy": "zero3"})


def test_strategy_auto_chooses_ddp_when_model_and_optimizer_fit(tmp_path):
    run = prepare(TrainParams.from_dict({**BASE, "out_dir": str(tmp_path / "r"), "nproc_per_node": 2}))
    assert run.strategy == "ddp" and run.memory_estimate["fits_one_device"]
    h200 = memory_estimate(preset("tr_hash_200m"), 16, 2048, bf16=True, grad_ckpt=False,
                           device_memory_bytes=140 * 2**30)
    # 201M x 16 B = 3.0 GiB of state + 72 x 16 x 2048 x 16 x 896 B = 31.5 GiB of activations
    assert h200["model_and_optimizer_bytes"] == 16 * 201_194_368 and h200["fits_one_device"]
    assert h200["activation_bytes"] == 72 * 16 * 2048 * 16 * 896
    card_32 = dict(device_memory_bytes=32 * 2**30, micro_batch_per_rank=16, seq_len=2048, bf16=True)
    assert not memory_estimate(preset("tr_hash_200m"), grad_ckpt=False, **card_32)["fits_one_device"]
    assert memory_estimate(preset("tr_hash_200m"), grad_ckpt=True, **card_32)["fits_one_device"]
