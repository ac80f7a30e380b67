"""What each data-parallel strategy costs a rank, computed (cflib.train.distributed.strategy_costs) and checked
against the two-GPU measurements committed in outputs/records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import cflib.train.run
from cflib.model.config import preset
from cflib.model.lora import base_bytes
from cflib.train import batch_arithmetic, describe_arithmetic
from cflib.train.distributed import TRAINING_BYTES_PER_PARAM, strategy_costs
from cflib.train.params import TrainParams

RECORDS = Path(__file__).resolve().parents[2] / "outputs" / "records"
GIB = 2**30


def peak_gib(name: str) -> float:
    return json.loads((RECORDS / f"{name}.json").read_text())["throughput"]["peak_memory_gib"]


def test_the_computed_state_per_rank_matches_the_two_gpu_runs_peaks():
    """The 200M preset at 16 x 2,048 per rank on H200s, the same step on 1 GPU, 2 under DDP, 2 under FSDP: the
    activations are the same on every rank, so the peaks differ by what each strategy holds besides them."""
    config = preset("tr_hash_200m")
    costs = strategy_costs(config, world_size=2, micro_steps=1)
    whole = TRAINING_BYTES_PER_PARAM * config.num_parameters()
    single, ddp, fsdp = (peak_gib(f"train_sft_200m_{run}_h200") for run in ("1gpu", "2gpu", "2gpu_fsdp"))
    assert ddp - single == pytest.approx((costs["ddp"]["state_bytes"] - whole) / GIB, abs=0.05)  # the buckets
    # FSDP holds a little more than computed (its reduce-scatter's buffers): 0.27 GiB on 34.9.
    assert single - fsdp == pytest.approx((whole - costs["fsdp"]["state_bytes"]) / GIB, abs=0.3)


def test_ring_collectives_send_what_the_strategies_move():
    config = preset("smoke")
    params = config.num_parameters()
    root = config.vocab_size * config.hidden_size + config.hidden_size
    one, four = strategy_costs(config, 2, micro_steps=1), strategy_costs(config, 2, micro_steps=4)
    assert one["ddp"]["sent_bytes_per_step"] == 4 * params == four["ddp"]["sent_bytes_per_step"]  # synced once
    gathers = 4 * (2 * (params - root) + root) / 2  # layers twice a micro-step, the root once, half of each sent
    assert one["fsdp"]["sent_bytes_per_step"] == round(gathers + 4 * params / 2)
    assert four["fsdp"]["sent_bytes_per_step"] == round(4 * gathers + 4 * params / 2)
    eight = strategy_costs(config, 8, micro_steps=1)
    assert eight["fsdp"]["state_bytes"] < one["fsdp"]["state_bytes"] < one["ddp"]["state_bytes"]
    assert eight["ddp"]["sent_bytes_per_step"] == round(2 * 7 / 8 * 4 * params)


def test_lora_ranks_sync_only_the_adapters():
    config = preset("smoke")
    full = strategy_costs(config, 2, 1)
    lora = strategy_costs(config, 2, 1, {"trainable_params": 1000, "frozen_params": config.num_parameters(),
                                         "frozen_dtype": "bfloat16", "frozen_by": "lora"})
    assert lora["ddp"]["sent_bytes_per_step"] == 4 * 1000
    assert lora["ddp"]["state_bytes"] == base_bytes(config, "bfloat16") + 20 * 1000  # embeddings, norms in fp32
    assert lora["fsdp"]["sent_bytes_per_step"] < full["fsdp"]["sent_bytes_per_step"]  # a BF16 base gathered


def test_the_dry_run_of_a_two_process_run_gives_each_strategys_cost_per_rank():
    params = TrainParams(micro_batch_per_rank=8, global_batch=32, nproc_per_node=2, device="cpu")
    figures = batch_arithmetic(params)
    costs = figures["memory_estimate"]["per_strategy"]
    assert (costs["world_size"], costs["micro_steps"]) == (2, 2)
    line = describe_arithmetic(figures, params).splitlines()[-1]
    assert line.startswith("per rank") and "ddp holds" in line and "fsdp holds" in line
    assert "per_strategy" not in batch_arithmetic(TrainParams(micro_batch_per_rank=8, device="cpu"))["memory_estimate"]


def test_frozen_modules_are_counted_at_their_storage_and_only_the_trainable_gradients_are_reduced(monkeypatch):
    """The smoke preset with its experts alone training: the frozen weights take 4 B/param (fp32, no gradient, no
    moments), the experts 16; DDP's buckets and all-reduce hold the experts' gradients alone; and strategy: auto
    picks DDP on a device that the frozen weights fit but every weight trained would not."""
    config = preset("smoke")
    experts = 3 * config.num_hidden_layers * config.num_experts * config.hidden_size * config.expert_width
    frozen = config.num_parameters() - experts
    params = TrainParams(micro_batch_per_rank=8, global_batch=32, nproc_per_node=2, device="cpu",
                         frozen_modules=("embeddings", "attention", "shared", "norms"))
    memory = batch_arithmetic(params)["memory_estimate"]
    assert memory["model_and_optimizer_bytes"] == 4 * frozen + 16 * experts
    assert memory["weights"] == {"trainable_params": experts, "frozen_params": frozen, "frozen_dtype": "float32",
                                 "frozen_by": "frozen_modules"}
    assert memory["rule"].startswith(f"frozen_modules: frozen weights 4 B/param ({frozen:,} in float32")
    ddp = memory["per_strategy"]["ddp"]
    assert ddp["state_bytes"] == 4 * frozen + 16 * experts + 4 * experts
    assert ddp["sent_bytes_per_step"] == 4 * experts  # 2 x (W-1)/W of the fp32 trainable gradients, W = 2
    every_weight_trained = 16 * config.num_parameters() + memory["activation_bytes"]
    device = int(every_weight_trained / 0.9) - 1  # what the frozen weights fit, but not every weight trained
    assert memory["total_bytes"] <= 0.9 * device < every_weight_trained
    monkeypatch.setattr(cflib.train.run, "device_memory_bytes", lambda _: device)
    assert batch_arithmetic(params)["strategy"] == "ddp"
    assert batch_arithmetic(TrainParams(micro_batch_per_rank=8, global_batch=32, nproc_per_node=2,
                                        device="cpu"))["strategy"] == "fsdp"
