"""Gradient clipping inside the fused AdamW step (cflib.train.optim.clip_in_fused_step) against clipping the
gradients first (torch.nn.utils.clip_grad_norm_) and stepping the same optimizer: the same weights and state.

torch's fused AdamW runs on the CPU too, so this runs everywhere, and on the GPU where there is one."""
from __future__ import annotations

import pytest
import torch

from cflib.train.optim import clip_in_fused_step


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _parameters(scale: float, device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
                  for shape in ((7, 5), (5,), (3, 4, 2))]
    for parameter in parameters:
        parameter.grad = (torch.randn(parameter.shape, generator=generator) * scale).to(device)
    return parameters


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale,max_norm", [(10.0, 1.0), (0.01, 1.0), (10.0, None)],
                         ids=["clipped", "under-the-limit", "unclipped"])
def test_clipping_in_the_fused_step_moves_the_weights_as_clipping_first(scale, max_norm, device):
    results = []
    for inside in (False, True):
        parameters = _parameters(scale, device)
        optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1, fused=True)
        for _ in range(3):
            for parameter, fresh in zip(parameters, _parameters(scale, device)):
                parameter.grad = fresh.grad
            if inside:
                norm = clip_in_fused_step(optimizer, parameters, max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf"))
            optimizer.step()
        results.append((norm, [p.detach().clone() for p in parameters],
                        [optimizer.state[p]["exp_avg_sq"].clone() for p in parameters]))
    (norm, weights, second), (norm_inside, weights_inside, second_inside) = results
    assert float(norm_inside) == pytest.approx(float(norm), rel=1e-6)
    for a, b in zip(weights + second, weights_inside + second_inside):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
