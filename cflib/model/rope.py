"""RoPE's frequencies, plain or scaled to extend a model's context (transformers' `rope_scaling` types).

A config's `rope_scaling` (cflib.model.config validates it) is None for plain
RoPE, or one of the dicts transformers reads, in its names:

- `linear`: Position Interpolation (Chen et al. 2023): every frequency divided
  by `factor`, so `factor` times the positions span the angles the model knows.
- `yarn`: YaRN (Peng et al. 2023): the high frequencies kept, the low ones
  interpolated by `factor`, a ramp between (`beta_fast`, `beta_slow` rotations
  over `original_max_position_embeddings`), and cos and sin scaled by the
  attention factor (`attention_factor`, by default 0.1 ln(factor) + 1).
- `llama3`: Llama 3.1's: wavelengths longer than `original_max_position_embeddings`
  / `low_freq_factor` divided by `factor`, shorter than ... / `high_freq_factor`
  kept, a smooth blend between.

Each is computed in float64 and rounded once to float32, as plain RoPE is here and
in the bundle's modeling code; transformers computes in float32, a few ulps away
(tests/model/test_rope.py checks every type against transformers' own functions).
The frequencies depend on the config alone, never on the length of the sequence at
hand, so training, evaluation and decoding with a KV cache rotate alike.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

# YaRN's defaults (the paper's, and transformers'): the ramp between beta_fast and beta_slow rotations.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def plain_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / head_dim) for i < head_dim / 2, in float64."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _linear(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    return inv_freq / scaling["factor"]


def _correction_dim(rotations: float, head_dim: int, theta: float, positions: int) -> float:
    """The dimension whose frequency turns `rotations` times over `positions` (YaRN's inverse formula)."""
    return head_dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    original = scaling["original_max_position_embeddings"]
    low = _correction_dim(scaling.get("beta_fast", YARN_BETA_FAST), head_dim, theta, original)
    high = _correction_dim(scaling.get("beta_slow", YARN_BETA_SLOW), head_dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0: the dimension keeps its frequency (extrapolates); 1: it is interpolated by factor.
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


# rope_type -> the scaled frequencies from the plain ones (float64), as transformers' ROPE_INIT_FUNCTIONS.
SCALED_INV_FREQ: dict[str, Callable[[torch.Tensor, int, float, dict], torch.Tensor]] = {
    "linear": _linear, "yarn": _yarn, "llama3": _llama3}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's [head_dim / 2] frequencies in float32: plain, or scaled by a validated `rope_scaling` dict."""
    inv_freq = plain_inv_freq(head_dim, theta)
    if scaling is not None:
        inv_freq = SCALED_INV_FREQ[scaling["rope_type"]](inv_freq, head_dim, theta, scaling)
    return inv_freq.float()


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (so q.k by its square), 1 otherwise."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if "attention_factor" in scaling:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def scaled_cos_sin(freqs: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `freqs` [..., hd / 2] as [..., hd] tables (rotate-half layout), times the attention factor
    (skipped at 1, so plain RoPE's tables are those it always had)."""
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)
