"""A micro-batch as the training step consumes it, collated on the host and moved to the device without waiting."""
from __future__ import annotations

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

    def to(self, device: torch.device | str) -> "MicroBatch":
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.labels),
                          None if self.documents is None else self.documents.moved(move),
                          move(self.token_weights), move(self.supervised), move(self.row_mask))

    def pinned(self) -> "MicroBatch":
        """The batch in pinned host memory, which a copy to the GPU reads without the host waiting."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return MicroBatch(pin(self.input_ids), pin(self.labels),
                          None if self.documents is None else self.documents.moved(pin),
                          pin(self.token_weights), pin(self.supervised), pin(self.row_mask))


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A batch tensor to the GPU from pinned memory without waiting: the host goes on launching meanwhile."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
