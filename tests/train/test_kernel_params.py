"""A run's fast paths and attention backend: checked before any step (nothing written when refused), and the
kernels that ran read back into the record.

Which kernel runs where is tested in tests/ops/ (test_dispatch.py, test_attention.py).
"""
from __future__ import annotations

import pytest
import torch
from sft_shard_helpers import task_shard
from tiny_models import KERNEL_DEVICE

from cflib.ops.attention import ATTENTION_BACKENDS
from cflib.ops.dispatch import KernelUnavailable, quack_problem
from cflib.train import prepare, train
from cflib.train.execution import weight_copies_problem
from cflib.train.params import ParamError, TrainParams

DEVICE = KERNEL_DEVICE


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """16 train and 4 held-out examples: the closing evaluation of an interpreted run is one short pass."""
    return task_shard(tmp_path_factory.mktemp("shard"), 16, 4)


@pytest.mark.parametrize("flags, message", [
    ({"use_custom_kernels": "true"}, "use_custom_kernels: true, but no GPU"),
    ({"require_liger": True}, "require_liger: true, but no GPU"),
])
def test_required_fast_path_stops_before_training(monkeypatch, tmp_path, flags, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out_dir = tmp_path / "run"
    params = TrainParams.from_dict({"model": "smoke", "device": "cpu", "out_dir": str(out_dir), **flags})
    with pytest.raises(KernelUnavailable, match=message):
        prepare(params)
    assert not out_dir.exists()


@pytest.mark.slow
def test_training_records_the_kernels_that_ran(tmp_path, shard):
    record = train({"model": "smoke", "data": str(shard), "seq_len": 32, "micro_batch_per_rank": 2, "global_batch": 2, "max_steps": 2,
                    "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False,
                    "device": DEVICE.type, "out_dir": str(tmp_path / "run"),
                    "use_custom_kernels": "true", "require_liger": True,
                    "kernel_overrides": {"epilogue_swiglu": "false"}}, progress=False)
    assert record["kernel_path"]["moe"] == "triton_fused"
    assert record["kernel_path"]["rmsnorm"] == "cflib_add_rmsnorm" and record["kernel_path"]["qk_norm"] == "cflib_qk_norm_rope"
    assert record["kernel_path"]["loss"] == "cflib_triton_fused_linear_ce"
    assert record["kernel_path"]["attention"] == "torch_sdpa"
    assert record["kernel_path"]["swiglu"] == "triton_fused"
    assert record["kernel_path"]["gemms"] == "torch"  # quack_gemms: auto takes quack only with BF16 weight copies
    # On a GPU the plan says why quack_gemms stayed off; on a CPU (interpreted kernels) auto says nothing of it.
    why_not = quack_problem(DEVICE) or "it reads the BF16 weight copies, off here (bf16 is off)"
    notes = record["kernels_requested"].pop("notes")
    assert record["kernels_requested"] == {"use_custom_kernels": "true", "require_liger": True,
                                           "attention_backend": "auto", "epilogue_swiglu": "false",
                                           "quack_gemms": "auto", "kept_swiglu_layers": "all"}
    # A GPU without flash-attn-4 adds why auto did not take it.
    fa4_missing = "attention_backend (fa4): flash-attn-4 is not installed"
    assert [note for note in notes if not note.startswith(fa4_missing)] == \
           ([f"quack_gemms: {why_not}"] if DEVICE.type == "cuda" else [])
    assert record["kernel_path"]["swiglu_activation"] == "kept"


def test_cudnn_sdpa_with_packed_windows_is_refused_naming_pack_sequences():
    with pytest.raises(ParamError, match="cudnn_sdpa attends dense rows only.*pack_sequences"):
        TrainParams.from_dict({"attention_backend": "cudnn_sdpa", "pack_sequences": True})


def test_fa4_on_cpu_stops_prepare_before_anything_is_written(tmp_path):
    out_dir = tmp_path / "run"
    params = TrainParams.from_dict({"model": "smoke", "device": "cpu", "out_dir": str(out_dir),
                                    "attention_backend": "fa4"})
    with pytest.raises(KernelUnavailable, match="attention_backend: fa4, but no GPU"):
        prepare(params)
    assert not out_dir.exists()


@pytest.mark.parametrize("value", ["FA4", "flash", "flex_attention", "", "true"])
def test_attention_backend_refuses_other_values_listing_the_choices(value):
    with pytest.raises(ParamError, match="attention_backend must be one of") as caught:
        TrainParams.from_dict({"attention_backend": value})
    assert all(name in str(caught.value) for name in ATTENTION_BACKENDS)


def test_a_run_checks_its_backend_where_it_trains(tmp_path):
    """The backend that runs on a CPU is accepted there and the model attends with it; FlexAttention, which
    trains only on a GPU, is refused before any step."""
    params = {"model": "smoke", "device": "cpu", "out_dir": str(tmp_path / "run"), "pack_sequences": True}
    run = prepare(TrainParams.from_dict({**params, "attention_backend": "sdpa_mask"}))
    assert run.plan.kernels.attention == run.model.attention_backend == "sdpa_mask"
    with pytest.raises(KernelUnavailable, match="attention_backend: flex, but no GPU"):
        prepare(TrainParams.from_dict({**params, "attention_backend": "flex"}))


def _copies_run(tmp_path, shard, name: str, **flags) -> dict:
    return train({"model": "smoke", "data": str(shard), "seq_len": 32, "micro_batch_per_rank": 2, "global_batch": 4, "max_steps": 3,
                  "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False, "bf16": True,
                  "fp32_loss": False,  # the head's copy too
                  "eval_micro_batch": 4,  # the closing evaluation in one pass: the interpreter pays per launch
                  "device": DEVICE.type, "out_dir": str(tmp_path / name), "use_custom_kernels": "true", **flags},
                 progress=False)


@pytest.mark.slow
def test_bf16_weight_copies_train_exactly_as_autocasts_casts(tmp_path, shard, monkeypatch):
    """Three steps of two micro-batches under the fused AdamW (on the CPU too: it moves the masters without
    bumping their version counters, as on a GPU): the copies are refreshed after each optimizer step, so every
    step's loss and gradient norm are those of the run that casts its masters in every forward. With cflib's
    AdamW kernel writing the copies instead, the run trains as well (within the rounding of torch's FP64
    scalars), and the record says the kernel stepped."""
    import cflib.train.step
    from cflib.train.records import read_metrics

    make_optimizer = cflib.train.step.make_optimizer
    monkeypatch.setattr(cflib.train.step, "make_optimizer",  # torch's fused AdamW on the CPU too
                        lambda model, settings, fused=False, triton=False: make_optimizer(
                            model, settings, fused=not triton, triton=triton))
    copied = _copies_run(tmp_path, shard, "copies", kernel_overrides={"bf16_weight_copies": "true", "cflib_adamw": "false"})
    cast = _copies_run(tmp_path, shard, "casts", kernel_overrides={"bf16_weight_copies": "false", "cflib_adamw": "false"})
    kernel = _copies_run(tmp_path, shard, "kernel", kernel_overrides={"bf16_weight_copies": "true", "cflib_adamw": "true"})
    assert copied["kernel_path"]["weights"] == "bf16_copies" and "weights" not in cast["kernel_path"]
    assert kernel["kernel_path"]["optimizer"] == "cflib_triton" and copied["kernel_path"]["optimizer"] == "torch_fused"
    if DEVICE.type == "cuda":  # the copies are read by graphs replayed after the optimizer wrote them
        assert copied["step_capture"]["replayed"] > 0 and cast["step_capture"]["replayed"] > 0
    rows = {name: [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name / "metrics.jsonl")
                   if r["event"] == "train"] for name in ("copies", "casts", "kernel")}
    assert len(rows["copies"]) == 3
    if DEVICE.type == "cpu":
        assert rows["copies"] == rows["casts"]
    else:  # FlashAttention's backward adds into dQ atomically: the bits vary between runs on a GPU
        assert rows["copies"] == [pytest.approx(row, rel=1e-3) for row in rows["casts"]]
    # The kernel's FP32 step scalars against torch's FP64 ones: the third step's gradient norm differs by up to
    # 2e-4 on some CPUs (1e-4 on others); a stale copy would move the loss by percents.
    assert rows["kernel"] == [pytest.approx(row, rel=1e-3) for row in rows["casts"]]


@pytest.mark.parametrize("flags, problem", [
    ({"bf16": False}, "bf16 is off"),
    ({"use_custom_kernels": "false"}, "cflib's kernels are off"),
])
def test_bf16_weight_copies_true_where_they_do_not_apply_stops_before_any_step(tmp_path, shard, flags, problem):
    with pytest.raises(KernelUnavailable, match=f"bf16_weight_copies: true, but {problem}"):
        _copies_run(tmp_path, shard, "refused", kernel_overrides={"bf16_weight_copies": "true"}, **flags)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_the_weight_copies_problem_names_why_a_run_reads_none():
    """The one reason the trainer (which attaches the copies) and the kernel plan (whose `auto` SwiGLU epilogue
    reads them) share, for the run as configured."""
    cuda = torch.device("cuda")

    def problem(custom=True, strategy="single", device=cuda, **flags):
        params = TrainParams.from_dict({"model": "smoke", "bf16": True, **flags})
        return weight_copies_problem(params, custom, strategy, device)

    assert problem() is None
    assert problem(bf16=False) == "bf16 is off"
    assert problem(custom=False) == "cflib's kernels are off"
    assert problem(full_parameter=False, init_checkpoint="base") == "LoRA adapts the weights"
    assert problem(strategy="fsdp", nproc_per_node=2) == "FSDP shards the masters"
    assert problem(nproc_per_node=2) == "2 processes (auto: one)"
    assert problem(device=torch.device("cpu")) == "the device is cpu, not CUDA"
    assert problem(kernel_overrides={"bf16_weight_copies": "true"}, nproc_per_node=2) is None
    assert problem(kernel_overrides={"bf16_weight_copies": "false"}) == "bf16_weight_copies: false"


def test_the_execution_plan_is_resolved_before_step_1_and_the_record_writes_it(tmp_path, shard):
    """Off a GPU every speed switch's auto stays off, each with its reason; a switch set to false says so; the plan
    is in the run's description and, whole, in the record."""
    params = {"model": "smoke", "data": str(shard), "device": "cpu", "seq_len": 32, "micro_batch_per_rank": 2,
              "global_batch": 2, "max_steps": 1, "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False}
    run = prepare(TrainParams.from_dict({**params, "out_dir": str(tmp_path / "auto")}))
    plan = run.plan
    assert (plan.optimizer, plan.weight_copies, plan.cuda_graphs, plan.grad_ckpt) == ("torch", False, False, False)
    # cflib's AdamW says why in Triton's words where a GPU machine runs this without the interpreter.
    assert "the device is cpu" in plan.reasons["cflib_adamw"]
    assert {name: reason for name, reason in plan.reasons.items() if name != "cflib_adamw"} == {
        "bf16_weight_copies": "bf16 is off", "cuda_graphs": "the device is cpu, not CUDA"}
    assert plan.kept_swiglu_layers == run.model.config.num_hidden_layers and plan.supervised_rows_only
    assert f"plan         {plan.describe()}" in run.describe() and "cuda_graphs: the device is cpu" in plan.describe()
    overridden = prepare(TrainParams.from_dict({**params, "out_dir": str(tmp_path / "off"),
                                                "kernel_overrides": {"cuda_graphs": False, "kept_swiglu_layers": 1}}))
    assert overridden.plan.reasons["cuda_graphs"] == "cuda_graphs: false" and overridden.plan.kept_swiglu_layers == 1
    record = train({**params, "out_dir": str(tmp_path / "trained"), "grad_ckpt": True}, progress=False)
    assert record["execution_plan"]["grad_ckpt"] is True and record["execution_plan"]["optimizer"] == "torch"
    assert record["execution_plan"]["reasons"]["cuda_graphs"].startswith("the device is cpu")
    assert record["execution_plan"]["kernels"]["attention"] == "auto" and record["kernel_path"]["optimizer"] == "torch"
    assert record["step_capture"] == {"cuda_graphs": False, "reason": "the device is cpu, not CUDA"}
