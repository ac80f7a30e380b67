"""The loss and the metric of docs/architecture.md ("Extending the package"), in a module of their own: a run on
several processes needs them importable by its workers (cflib.train.registered), as a user's would be from a .py
file beside the notebook."""
from __future__ import annotations

import re

from cflib.ops.loss import chunked_cross_entropy_sum


class SmoothedLoss:
    """Cross-entropy plus a small penalty on the hidden states' scale."""
    last_backend = "none"

    def __init__(self, kernels):
        self.kernels = kernels

    def __call__(self, hidden, head_weight, labels, loss_chunk_tokens, fp32_loss, token_weights=None,
                 supervised=None):
        self.last_backend = "smoothed_chunked_ce"
        loss, count = chunked_cross_entropy_sum(hidden, head_weight, labels, loss_chunk_tokens, fp32_loss,
                                                token_weights=token_weights, supervised=supervised)
        return loss + 1e-3 * count * hidden.float().pow(2).mean(), count


def first_number_right(answer: str, reference: str) -> float:  # the page's metric, as it shows it
    found = re.search(r"-?\d+", answer)
    return float(found is not None and int(found.group(0)) == int(reference))


class SmoothedFactory:
    """A loss factory registered as an instance: its module binds it to a name (smoothed_factory)."""

    def __call__(self, kernels):
        return SmoothedLoss(kernels)


smoothed_factory = SmoothedFactory()


def _number_metric():
    def score(answer: str, reference: str) -> float:
        return first_number_right(answer, reference)
    return score


number_right = _number_metric()  # a closure bound at module level
