"""cflib's AdamW kernel as the optimizer (cflib.train.optim.TritonAdamW, `cflib_adamw`) beside torch's fused AdamW:
the same weights and state step after step (clipped, skipped, two learning rates), state dicts that load
either way, the weight copies written as their masters move, and the trainer's choice checked before any step.
A run on the kernel is compared with one on torch's in tests/train/test_kernel_params.py.

Triton's interpreter runs the kernel on a CPU (tests/conftest.py), the GPU where there is one; torch's fused
AdamW runs on both.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE, random_ids, tiny_config

from cflib.model.fast import attach_weight_copies, build_model
from cflib.ops.dispatch import KernelChoice, KernelUnavailable
from cflib.train import train
from cflib.train.optim import TritonAdamW, clip_in_fused_step, optimizer_kernel

SHAPES = ((7, 5), (300,), (3, 4, 2), (6,))


def _parameters() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(KERNEL_DEVICE)) for shape in SHAPES]


def _groups(parameters: list[torch.nn.Parameter]) -> list[dict]:
    """Matrices decayed at the base rate, vectors undecayed at half of it (as the experts' multiplier does)."""
    return [{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3}]


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(shape, generator=generator) * 4).to(KERNEL_DEVICE) for shape in SHAPES]


def _train(optimizer: torch.optim.AdamW, parameters: list[torch.nn.Parameter], steps: range,
           skip: int | None = None) -> None:
    """Clipped steps as the trainer takes them: the factor and the skip flag read on the device by a fused step,
    the gradients clipped first for a non-fused one."""
    for step in steps:
        for parameter, grad in zip(parameters, _gradients(step)):
            parameter.grad = grad
        if all(group["fused"] for group in optimizer.param_groups):
            clip_in_fused_step(optimizer, parameters, max_norm=1.0)
            optimizer.found_inf = torch.tensor(float(step == skip), device=KERNEL_DEVICE)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()


def _assert_same_state(a: torch.optim.AdamW, b: torch.optim.AdamW, pa: list, pb: list) -> None:
    """Within a few FP32 roundings (torch's fused kernel computes its scalars in FP64 and may contract a multiply
    and an add), relative to each tensor's largest value where terms cancel near zero."""
    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6 * float(expected.detach().abs().max()))

    for x, y in zip(pa, pb):
        close(y, x)
        for key in ("exp_avg", "exp_avg_sq"):
            close(b.state[y][key], a.state[x][key])
        assert float(b.state[y]["step"]) == float(a.state[x]["step"])


def test_steps_as_torchs_fused_adamw_clipped_skipped_and_at_two_rates():
    torch_params, triton_params = _parameters(), _parameters()
    reference = torch.optim.AdamW(_groups(torch_params), lr=1e-2, betas=(0.9, 0.95), fused=True)
    optimizer = TritonAdamW(_groups(triton_params), lr=1e-2, betas=(0.9, 0.95))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)) for o in (reference, optimizer)]
    for step in range(5):
        for o, params, schedule in zip((reference, optimizer), (torch_params, triton_params), schedules):
            _train(o, params, range(step, step + 1), skip=2)
            schedule.step()
    _assert_same_state(reference, optimizer, torch_params, triton_params)
    assert float(optimizer.state[triton_params[0]]["step"]) == 4.0  # the skipped step did not count
    assert optimizer_kernel(optimizer) == "cflib_triton" and optimizer_kernel(reference) == "torch_fused"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "steps-on-the-host"])
def test_state_dicts_load_either_way_and_training_goes_on_as_one_run(fused):
    """torch's state dict (its steps on the device, or on the host from a non-fused AdamW) loads into cflib's
    optimizer and cflib's into torch's: three more steps after either land where six of torch's land."""
    straight = _parameters()
    reference = torch.optim.AdamW(_groups(straight), lr=1e-2, betas=(0.9, 0.95), fused=True)
    _train(reference, straight, range(6))
    first, second = _parameters(), _parameters()
    donor = torch.optim.AdamW(_groups(first), lr=1e-2, betas=(0.9, 0.95), fused=fused)
    _train(donor, first, range(3))
    optimizer = TritonAdamW(_groups(first), lr=1e-2, betas=(0.9, 0.95))
    optimizer.load_state_dict(donor.state_dict())
    # the trainer's device-side clipping and skipping still apply, and the steps are where the kernel reads them
    assert all(group["fused"] for group in optimizer.param_groups)
    _train(optimizer, first, range(3, 6))
    assert {optimizer.state[p]["step"].device for p in first} == {first[0].device}
    _assert_same_state(reference, optimizer, straight, first)
    cflib_first = TritonAdamW(_groups(second), lr=1e-2, betas=(0.9, 0.95))
    _train(cflib_first, second, range(3))
    back = torch.optim.AdamW(_groups(second), lr=1e-2, betas=(0.9, 0.95), fused=True)
    back.load_state_dict(cflib_first.state_dict())
    _train(back, second, range(3, 6))
    _assert_same_state(reference, back, straight, second)


def test_the_weight_copies_are_written_as_their_masters_move():
    """After each step every copy is the BF16 cast of its updated masters (bit for bit: rows written by the
    kernel, transposed expert slices copied after it) and counts as fresh, with no refresh in between; a copy
    first written after a step (the head's, here) is written by the next."""
    torch.manual_seed(0)
    model = build_model(tiny_config(), KernelChoice(liger=True, custom=True)).to(KERNEL_DEVICE).train()
    copies = attach_weight_copies(model, head=True)
    optimizer = TritonAdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95))
    optimizer.weight_copies = copies
    ids = random_ids(model.config.vocab_size, 2, 16).to(KERNEL_DEVICE)
    for step in range(3):
        with torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
            hidden = model(ids)
            head = copies.weight("head") if step > 0 else model.head_weight  # the head's copy from step 2 on
            loss = (hidden @ head.t()).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        written = {name: copy.tensor.clone() for name, copy in copies.copies.items() if copy.tensor is not None}
        assert "head" in written or step == 0
        assert not any(copy.stale() for copy in copies.copies.values() if copy.tensor is not None)
        copies.refresh(stale_only=False)  # what the casts from the masters give
        for name, tensor in written.items():
            assert torch.equal(tensor, copies.copies[name].tensor), (step, name)


def test_cflib_adamw_true_where_the_kernel_cannot_run_stops_before_any_step(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailable, match="cflib_adamw: true, but no GPU"):
        train({"model": "smoke", "device": "cpu", "out_dir": str(tmp_path / "refused"),
               "kernel_overrides": {"cflib_adamw": "true"}},
              progress=False)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_cflib_adamw_auto_stays_on_torchs_off_a_gpu(tmp_path):
    record = train({"model": "smoke", "seq_len": 32, "micro_batch_per_rank": 2, "global_batch": 2, "max_steps": 1,
                    "eval_at_start": False, "exact_match_limit": 0, "save_checkpoints": False, "device": "cpu",
                    "out_dir": str(tmp_path / "auto"), "kernel_overrides": {"cflib_adamw": "auto"}}, progress=False)
    assert record["kernel_path"]["optimizer"] == "torch"
