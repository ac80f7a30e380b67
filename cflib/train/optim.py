"""AdamW with weight decay on matrices only, and the released schedule: linear warm-up, then one cosine."""
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


def make_optimizer(model: torch.nn.Module, params: TrainParams, device: torch.device,
                   fused: bool = True) -> torch.optim.AdamW:
    # Norm gains are scale parameters; decaying them toward 0 fights the normalisation.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]  # LoRA trains no norm gain: no empty group
    return torch.optim.AdamW(groups, lr=params.lr, betas=(params.beta1, params.beta2),
                             fused=fused and device.type == "cuda")
