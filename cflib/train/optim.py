"""AdamW with weight decay on matrices only, and the released schedule: linear warm-up, then one cosine.

The routed experts and the LoRA adapters may learn at their own rates (`expert_lr_multiplier`,
`lora_lr_multiplier`: lr x multiplier, both for an adapter on an expert); each combination is a parameter group,
named, so the record can show every group's learning rate.
"""
from __future__ import annotations

import math

import torch

from cflib.train.params import TrainParams


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to the peak, then one cosine to zero at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, decay_steps) / decay_steps))


def _group_of(name: str, parameter: torch.nn.Parameter, params: TrainParams) -> tuple[str, float]:
    """The parameter's group name and learning-rate multiplier."""
    # Norm gains are scale parameters; decaying them toward 0 fights the normalisation.
    parts = ["decay" if parameter.dim() >= 2 else "no_decay"]
    multiplier = 1.0
    if ".expert_" in name and params.expert_lr_multiplier != 1.0:
        parts.append("experts")
        multiplier *= params.expert_lr_multiplier
    if "lora_" in name and params.lora_lr_multiplier != 1.0:
        parts.append("lora")
        multiplier *= params.lora_lr_multiplier
    return "+".join(parts), multiplier


def make_optimizer(model: torch.nn.Module, params: TrainParams, device: torch.device,
                   fused: bool = True) -> torch.optim.AdamW:
    groups: dict[str, dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        group, multiplier = _group_of(name, parameter, params)
        groups.setdefault(group, {"name": group, "params": [], "lr": params.lr * multiplier,
                                  "weight_decay": params.weight_decay if group.startswith("decay") else 0.0})
        groups[group]["params"].append(parameter)
    return torch.optim.AdamW(list(groups.values()), lr=params.lr, betas=(params.beta1, params.beta2),
                             fused=fused and device.type == "cuda")


def describe_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's name, size and peak learning rate, for the record."""
    return [{"name": group.get("name", str(index)), "tensors": len(group["params"]),
             "params": sum(p.numel() for p in group["params"]), "lr": group.get("initial_lr", group["lr"]),
             "weight_decay": group["weight_decay"]}
            for index, group in enumerate(optimizer.param_groups)]


def clip_in_fused_step(optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter],
                       max_norm: float | None) -> torch.Tensor:
    """The gradients' total norm, their clipping left to the fused AdamW's next step: it divides each gradient
    by `grad_scale` as it reads it (GradScaler's unscaling), so no separate pass rewrites every gradient, not
    even to multiply by 1 when unclipped. The factor is clip_grad_norm_'s: max(1, (norm + 1e-6) / max_norm)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    optimizer.grad_scale = None if max_norm is None else torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm

