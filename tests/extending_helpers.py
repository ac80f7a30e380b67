"""The loss, the metric and the attention backend of docs/architecture.md ("Extending the package"), in a module
of their own: a run on several processes needs them importable by its workers (cflib.train.registered), as a
user's would be from a .py file beside the notebook."""
from __future__ import annotations

import re

import torch.nn.functional as F

from cflib.ops.attention import Backend, Kernel
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


def causal_math(q, k, v, batch):  # the page's attention kernel: q [B, Hq, T, hd], k/v [B, Hkv, T, hd]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# The page's backend, bound to a name at module level as a run on several processes needs it.
math_backend = Backend("math", "SDPA's math over repeated KV heads", Kernel("math_sdpa", causal_math), None,
                       lambda device, head_dim, packed: None)
# The same kernel tried by `auto` for dense rows: a worker without it would attend with SDPA without a word.
auto_math_backend = Backend("auto_math", "SDPA's math, tried by auto", Kernel("auto_math_sdpa", causal_math), None,
                            lambda device, head_dim, packed: None, auto_for=(False,))
