"""The optimizer's parameter groups and hyperparameters as the run's parameters set them (cflib.train.optim):
`adam_epsilon` in every AdamW the execution plan can choose, and LoRA+'s groups (`lora_plus_ratio`), the B matrices
(and DoRA's magnitudes) at ratio x the A matrices' rate, each group named in the record."""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE, tiny_model

from cflib.model.lora import LoraSettings, attach_lora
from cflib.train.optim import OptimizerSettings, describe_groups, make_optimizer
from cflib.train.params import TrainParams
from cflib.train.step import optimizer_settings

LORA = {"full_parameter": False, "init_checkpoint": "some/checkpoint"}


@pytest.mark.parametrize("implementation", ["torch", "torch_fused", "cflib_adamw"])
def test_adam_epsilon_reaches_every_optimizer_and_its_step(implementation):
    """A first step moves a weight by lr x g / (|g| + eps) (the moments' bias corrected, no decay): with |g| = eps
    that is half of lr, where the default epsilon would move it by all of lr."""
    layer = torch.nn.Linear(4, 3, bias=False, device=KERNEL_DEVICE)
    start = layer.weight.detach().clone()
    settings = OptimizerSettings(lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-3)
    optimizer = make_optimizer(layer, settings, fused=implementation == "torch_fused",
                               triton=implementation == "cflib_adamw")
    assert {group["eps"] for group in optimizer.param_groups} == {1e-3}
    assert [group["eps"] for group in describe_groups(optimizer)] == [1e-3]
    layer.weight.grad = torch.full_like(layer.weight, -1e-3)
    optimizer.step()
    torch.testing.assert_close(layer.weight.detach() - start, torch.full_like(start, 0.05), rtol=1e-4, atol=0)


def test_the_run_s_parameters_reach_the_optimizer_s_settings():
    settings = optimizer_settings(TrainParams.from_dict({**LORA, "adam_epsilon": "1e-6", "lora_plus_ratio": 16}))
    assert (settings.eps, settings.lora_plus_ratio) == (1e-6, 16.0)
    defaults = optimizer_settings(TrainParams.from_dict({}))
    assert (defaults.eps, defaults.lora_plus_ratio) == (1e-8, 1.0)  # torch's epsilon, and one group for A and B
    default_optimizer = make_optimizer(torch.nn.Linear(2, 2), defaults)
    assert default_optimizer.param_groups[0]["eps"] == torch.optim.AdamW([torch.zeros(1)]).defaults["eps"]


def _groups(model: torch.nn.Module, **settings: float) -> dict[str, dict]:
    optimizer = make_optimizer(model, OptimizerSettings(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), **settings))
    return {group["name"]: group for group in describe_groups(optimizer)}


def _lora_model(**settings: object) -> torch.nn.Module:
    return attach_lora(tiny_model(), LoraSettings(rank=2, alpha=2.0, **settings))


def test_lora_plus_trains_the_b_matrices_at_the_ratio_of_the_a_matrices_rate():
    groups = _groups(_lora_model(targets=("q_proj", "expert_gate")), lora_plus_ratio=16.0, lora_lr_multiplier=2.0,
                     expert_lr_multiplier=0.5)
    rates = {name: group["lr"] for name, group in groups.items()}
    assert rates == pytest.approx({"decay+lora_A": 2e-3, "decay+lora_B": 32e-3,  # two layers' q_proj
                                   "decay+experts+lora_A": 1e-3, "decay+experts+lora_B": 16e-3})
    assert {name: group["tensors"] for name, group in groups.items()} == dict.fromkeys(groups, 2)
    # Off (None or 1 in the run's parameters), A and B share one group, as without LoRA+.
    assert set(_groups(_lora_model(targets=("q_proj",)), lora_lr_multiplier=2.0)) == {"decay+lora"}


def test_under_dora_the_magnitudes_go_with_b_and_trainable_tokens_keep_lr():
    """As PEFT's create_loraplus_optimizer groups them: every vector with B (DoRA's magnitude), an adapter's other
    matrices with A; trainable embedding rows are no adapter and keep lr."""
    groups = _groups(_lora_model(targets=("q_proj",), dora=True, trainable_tokens=(1, 2)), lora_plus_ratio=4.0)
    rates = {name: group["lr"] for name, group in groups.items()}
    assert rates == pytest.approx({"decay": 1e-3, "decay+lora_A": 1e-3, "decay+lora_B": 4e-3,
                                   "no_decay+lora_B": 4e-3})
    assert groups["no_decay+lora_B"]["tensors"] == 2 and groups["no_decay+lora_B"]["weight_decay"] == 0.0
    assert groups["decay"]["tensors"] == 1  # the trainable token rows
