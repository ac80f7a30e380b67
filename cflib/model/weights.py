"""The weight protocol: how an adapter reaches the decoder's computation without the decoder naming it.

An adapter of a linear module is the module itself (an nn.Linear whose forward adds its update); an adapter
of an expert tensor sits in its engine's `expert_adapters()` under the tensor's name; an embedding may offer
its effective weight. Each adapter offers:

- `folds() -> bool`: whether its update may join the weight (false when each token sees its own dropout mask);
- `delta() -> Tensor`: the update in the adapted weight's layout (linear [out, in]; experts [E, in, out]);
- `branch(x)` (linear) or `branch_in(x)` / `branch_out(hidden)` (experts): the update applied to an input;
- `last_form`, for the run record: "branch" where its forward or branch ran, "effective_weight" or
  "separate_branch" as the fused path that computed with it last says.

The reference modules call the adapted module (or add an expert adapter's branch); the fused paths
(cflib.model.fast) read `effective_weight` or add branches where an update cannot fold. cflib.model.lora
implements the protocol; the decoder imports only this module's protocol, never the adapters.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ExpertAdapter(Protocol):
    last_form: str

    def folds(self) -> bool: ...

    def delta(self) -> torch.Tensor: ...

    def branch_in(self, x: torch.Tensor) -> torch.Tensor: ...

    def branch_out(self, hidden: torch.Tensor) -> torch.Tensor: ...


def is_adapted(module: nn.Module) -> bool:
    """Whether a linear module carries an adapter (offers the protocol's delta)."""
    return callable(getattr(module, "delta", None))


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight a computation reads for `module`: its own, or the effective weight the module offers
    (an adapted linear module: weight + delta; an embedding, and so the tied head, with trainable rows)."""
    own = getattr(module, "effective_weight", None)
    return own() if callable(own) else module.weight
