"""Deterministic route tables: token id -> experts, no learned router.

A table is built once when a model is created and then persisted in every
checkpoint; a loaded table is authoritative and never rebuilt.
"""
from __future__ import annotations

import math

import torch

from cflib.model.config import ConfigError, ModelConfig

# Odd multipliers from the golden ratio family: coprime with any vocabulary
# size once adjusted below, so each multiplicative hash is a bijection.
_HASH_MULTIPLIERS = (2654435761, 2246822519, 3266489917, 668265263, 374761393)


def modulo_cyclic(vocab_size: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Route k of token t is expert (t + k) mod E: balanced and distinct per token."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64)
    return torch.stack([(token_ids + k) % num_experts for k in range(top_k)])


def _bijective_hash(token_ids: torch.Tensor, vocab_size: int, salt: int) -> torch.Tensor:
    # a * t + b mod V permutes [0, V) whenever gcd(a, V) == 1.
    multiplier = _HASH_MULTIPLIERS[salt % len(_HASH_MULTIPLIERS)] % vocab_size or 1
    while math.gcd(multiplier, vocab_size) != 1:
        multiplier += 1
    return (token_ids * multiplier + 7919 * (salt + 1)) % vocab_size


def token_id_multi_hash(vocab_size: int, num_experts: int, top_k: int, hash_count: int = 2) -> torch.Tensor:
    """Balanced hash routing with distinct experts per token.

    The primary expert comes from a permutation of the vocabulary, so every
    expert is the primary of the same number of tokens (up to V mod E). Each
    further route draws its expert from the experts not yet chosen, by an
    independent hash (``hash_count`` hashes, reused cyclically).
    """
    token_ids = torch.arange(vocab_size, dtype=torch.int64)
    chosen = [_bijective_hash(token_ids, vocab_size, 0) % num_experts]
    for k in range(1, top_k):
        salt = k % hash_count
        remaining = num_experts - k
        pick = _bijective_hash(token_ids, vocab_size, salt + k) % remaining
        # Walk the experts in order, skipping those already taken, to the pick-th free one.
        taken = torch.stack(chosen)  # [k, V]
        expert = torch.full_like(token_ids, -1)
        free_seen = torch.zeros_like(token_ids)
        for candidate in range(num_experts):
            is_free = (taken != candidate).all(dim=0)
            hit = is_free & (free_seen == pick) & (expert < 0)
            expert = torch.where(hit, torch.full_like(expert, candidate), expert)
            free_seen = free_seen + is_free.long()
        chosen.append(expert)
    return torch.stack(chosen)


ROUTING_STRATEGIES = ("token_id_multi_hash", "modulo_cyclic")


def build_route_table(config: ModelConfig) -> torch.Tensor:
    """The int64 [top_k, vocab_size] table of a new model (each layer stores its own copy)."""
    if config.routing_strategy == "modulo_cyclic":
        return modulo_cyclic(config.vocab_size, config.num_experts, config.num_experts_per_tok)
    if config.routing_strategy == "token_id_multi_hash":
        return token_id_multi_hash(config.vocab_size, config.num_experts, config.num_experts_per_tok,
                                   config.route_hash_count)
    raise ConfigError(f"routing_strategy {config.routing_strategy!r} is not one of {ROUTING_STRATEGIES}: cflib "
                      "cannot build a new route table for it (a checkpoint's own tables load regardless)")
