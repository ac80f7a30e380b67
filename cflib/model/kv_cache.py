"""A static key/value cache: every layer's keys and values for B rows of up to `length` positions.

Preallocated once ([layers][B, Hkv, length, hd]) and written in place, so a
decode step has fixed shapes and addresses and can be replayed as one CUDA
graph (cflib.model.generate). Rows are right-padded: each row's tokens sit at
their own positions 0, 1, ... and the cache slot of a token is its position.

Prefill (`positions` None) writes the prompt's keys and values to slots
0..T-1 and attends exactly as the model does without a cache (causal SDPA):
no real token sees a later pad. A decode step (`positions` [B, 1], each row's
position) writes one token per row into its slot and attends over the slots
up to it; slots past a row's position (pads, stale entries) are masked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cflib.model.config import ModelConfig


class LayerCache:
    """One layer's keys and values; `attend` stores this step's and returns the attention output."""

    def __init__(self, cache: "KVCache", keys: torch.Tensor, values: torch.Tensor) -> None:
        self.cache, self.keys, self.values = cache, keys, values

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, hd], k and v [B, Hkv, T, hd] -> [B, Hq, T, hd]."""
        batch, q_heads, seq, head_dim = q.shape
        kv_heads = k.shape[1]
        positions = self.cache.positions
        if positions is None:  # prefill from position 0
            self.keys[:, :, :seq].copy_(k)
            self.values[:, :, :seq].copy_(v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q_heads != kv_heads)
        if seq != 1:
            raise ValueError(f"a decode step takes one token per row, got {seq}")
        slots = positions.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, head_dim)
        self.keys.scatter_(2, slots, k.to(self.keys.dtype))
        self.values.scatter_(2, slots, v.to(self.values.dtype))
        # The query heads sharing a key head attend as that head's rows: GQA without copying keys or values.
        grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, self.keys, self.values, attn_mask=self.cache.mask)
        return out.reshape(batch, q_heads, 1, head_dim)


class KVCache:
    """Keys and values of every layer of a model for `batch` rows of up to `length` positions."""

    backend = "sdpa_kv_cache"  # what TRMoEModel.kernel_path() reports for attention while decoding

    def __init__(self, config: ModelConfig, batch: int, length: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (batch, config.num_key_value_heads, length, config.head_dim)
        self.batch, self.length = batch, length
        self.layers = [LayerCache(self, torch.zeros(shape, device=device, dtype=dtype),
                                  torch.zeros(shape, device=device, dtype=dtype))
                       for _ in range(config.num_hidden_layers)]
        self.slots = torch.arange(length, device=device)
        self.positions: torch.Tensor | None = None  # [B, 1] while decoding; None during prefill
        self.mask: torch.Tensor | None = None

    def decode_at(self, positions: torch.Tensor | None) -> None:
        """Point the next forward at each row's position ([B, 1]), or at prefill (None)."""
        self.positions = positions
        # Computed once per step for every layer: slot s is visible to a row at position p when s <= p.
        self.mask = None if positions is None else (self.slots[None, :] <= positions).view(
            self.batch, 1, 1, self.length)

    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
