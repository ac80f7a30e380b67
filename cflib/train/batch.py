"""A micro-batch as the training step consumes it, collated on the host and moved to the device without waiting."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cflib.ops.attention import PackedDocuments


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]
    documents: PackedDocuments | None  # packed windows' documents; None: one example per row
    token_weights: torch.Tensor | None  # [B, T] under loss weighting
    supervised: torch.Tensor  # flat indices of the supervised labels (cflib.ops.loss.supervised_positions)
    row_mask: torch.Tensor | None = None  # 1.0 per real supervised position, 0.0 per padding (a static shape)
    # [B, T] int32: the token count of each position's example, where NEFTune's noise reads it (cflib.model.neftune)
    example_lengths: torch.Tensor | None = None

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "MicroBatch":
        """The batch with `move` applied to each of its tensors."""
        each = lambda t: None if t is None else move(t)  # noqa: E731
        return MicroBatch(each(self.input_ids), each(self.labels),
                          None if self.documents is None else self.documents.moved(each),
                          each(self.token_weights), each(self.supervised), each(self.row_mask),
                          each(self.example_lengths))

    def to(self, device: torch.device | str) -> "MicroBatch":
        return self.moved(lambda t: to_device(t, device))

    def pinned(self) -> "MicroBatch":
        """The batch in pinned host memory, which a copy to the GPU reads without the host waiting."""
        return self.moved(torch.Tensor.pin_memory)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A batch tensor to the GPU from pinned memory without waiting: the host goes on launching meanwhile."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
