"""The optimizer's parameter groups and hyperparameters as the run's parameters set them (cflib.train.optim):
`adam_epsilon` in every AdamW the execution plan can choose."""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.train.optim import AdamWSettings, describe_groups, make_optimizer
from cflib.train.params import TrainParams
from cflib.train.step import adamw_settings


@pytest.mark.parametrize("implementation", ["torch", "torch_fused", "cflib_adamw"])
def test_adam_epsilon_reaches_every_optimizer_and_its_step(implementation):
    """A first step moves a weight by lr x g / (|g| + eps) (the moments' bias corrected, no decay): with |g| = eps
    that is half of lr, where the default epsilon would move it by all of lr."""
    layer = torch.nn.Linear(4, 3, bias=False, device=KERNEL_DEVICE)
    start = layer.weight.detach().clone()
    settings = AdamWSettings(lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-3)
    optimizer = make_optimizer(layer, settings, fused=implementation == "torch_fused",
                               triton=implementation == "cflib_adamw")
    assert {group["eps"] for group in optimizer.param_groups} == {1e-3}
    assert [group["eps"] for group in describe_groups(optimizer)] == [1e-3]
    layer.weight.grad = torch.full_like(layer.weight, -1e-3)
    optimizer.step()
    torch.testing.assert_close(layer.weight.detach() - start, torch.full_like(start, 0.05), rtol=1e-4, atol=0)


def test_the_run_s_parameters_reach_the_optimizer_s_settings():
    assert adamw_settings(TrainParams.from_dict({"adam_epsilon": "1e-6"})).eps == 1e-6
    defaults = adamw_settings(TrainParams.from_dict({}))
    assert defaults.eps == 1e-8  # torch's epsilon
    default_optimizer = make_optimizer(torch.nn.Linear(2, 2), defaults)
    assert default_optimizer.param_groups[0]["eps"] == torch.optim.AdamW([torch.zeros(1)]).defaults["eps"]
