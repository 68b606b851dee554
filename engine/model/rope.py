"""RoPE: each pair's rotation frequency (``rope_inv_freq``: plain, linear, llama3 or YaRN, as
transformers computes them), the step's cos and sin (``RotaryEmbedding``, with YaRN's
attention factor), and moving stored keys to other positions: rotations compose, so a key
rotated for position p becomes the key for position p + delta after one more rotation by
delta (``shift_rotation`` / ``shift_keys``: float32 math, the rotate-half pairing the model
applies, the result cast back to the keys' dtype).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies (float32, CPU), with linear, llama3 or YaRN scaling
    applied (transformers' formulas)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(in_band, blended, scaled)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config, scaling)
    return inv_freq


def _yarn_inv_freq(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN (static, as transformers computes it): pairs that turn fewer than ``beta_slow``
    times over the original context are interpolated by ``factor``, those turning more than
    ``beta_fast`` times kept, a linear ramp between (its ends truncated to whole pairs unless
    ``truncate`` is false)."""
    dim, base = config.head_dim, config.rope_theta
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each pair left unscaled
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise): given, or
    from ``mscale`` / ``mscale_all_dim``, or ``0.1 ln(factor) + 1``, as transformers does."""
    scaling = config.rope_scaling or {}
    if config.rope_type != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq_cpu = rope_inv_freq(config)
        self.attention_factor = rope_attention_factor(config)  # YaRN's scale of cos and sin
        self._inv_freq: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` for the step's positions, computed once for all layers."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self.inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # in float32, then rounded: as transformers
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


Rotation = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) from RotaryEmbedding


def shift_rotation(inv_freq: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[D/2]`` (float32) of a rotation by ``delta`` positions."""
    angles = float(delta) * inv_freq.to(torch.float32)
    return angles.cos(), angles.sin()


def shift_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[..., D]`` (already rotated for their old positions) rotated once more by
    the angle ``shift_rotation`` gave: the keys of the new positions."""
    half = keys.shape[-1] // 2
    k = keys.to(torch.float32)
    cos, sin = cos.to(k.device), sin.to(k.device)
    k1, k2 = k[..., :half], k[..., half:]
    return torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1).to(keys.dtype)
