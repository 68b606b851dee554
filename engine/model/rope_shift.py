"""Moving stored keys to other positions: RoPE rotations compose, so a key rotated for
position p becomes the key for position p + delta after one more rotation by delta.

Math in float32 (the rotation the model applies is the same rotate-half pairing, with
``rope_inv_freq``'s frequencies), the result cast back to the keys' dtype.
"""

from __future__ import annotations

import torch


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
