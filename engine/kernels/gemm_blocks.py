"""A weight's GGUF blocks in the layouts of the GEMM kernels that read them (``cpu_gemm``'s
``PackedLinear.from_blocks``, ``cpu_head_int8``): the packings, and the bf16 weight a block
source stands for (``block_weights``, ``rounds_to``), which the kernels reproduce bit for bit."""

from __future__ import annotations

import numpy as np
import torch

# A weight's GGUF blocks: q int8 [N, K], scale and minimum (or None) fp32 [N, K / 32]
BlockSource = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def q8_pack(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """``pc_gemm_q8_amx``'s layout of ``q`` int8 ``[N, K]`` and ``scale`` ``[N, K / 32]`` (each
    an fp16 value: ``fp16_exact``): per group of 32 columns (N padded with zero columns) and
    block of 32 k, the integers as ``[16 k-pairs][32 columns][2]``, then the block's 32 scales
    as fp16. A ``scale`` per 16 k (``[N, K / 16]``, ``pc_gemm_q8h_amx``) puts the block's first
    halves' 32 fp32 scales, then the second's."""
    ints, groups, blocks = _tile_order(q)
    ints = ints.view(np.uint8).reshape(groups, blocks, 1024)
    if scale.shape[1] == blocks:
        return with_column_values(groups, blocks, ints, scale, dtype=np.float16)
    return with_column_values(groups, blocks, ints, scale[:, 0::2], scale[:, 1::2])


def fp16_exact(values: np.ndarray) -> bool:
    """Whether every value is an fp16 value (a Q8_0 or Q5_0 block's d always is)."""
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def q4_pack(
    q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, dtype: type[np.floating] = np.float32
) -> torch.Tensor:
    """``pc_gemm_q4_amx``'s layout of ``q`` in 0..15 ``[N, K]``, ``scale`` and ``minimum``
    ``[N, K / 32]``: per group of 32 columns and block of 32 k, for each k-pair and tile of
    16 columns 16 bytes (byte j: the tile row's value j, low nibble, and j + 16, high), then
    the block's 32 scales and 32 minimums as ``dtype`` (fp16: ``pc_gemm_q4f16_amx``'s)."""
    ints, groups, blocks = _tile_order(q)
    rows = ints.astype(np.uint8).reshape(groups, blocks, 16, 2, 2, 16)
    nibbles = rows[..., 0, :] | (rows[..., 1, :] << 4)
    nibbles = nibbles.reshape(groups, blocks, 512)
    return with_column_values(groups, blocks, nibbles, scale, minimum, dtype=dtype)


def _tile_order(q: np.ndarray) -> tuple[np.ndarray, int, int]:
    """``q`` ``[N, K]`` as ``[groups][blocks][16 k-pairs][32 columns][2]`` (zero columns pad N)."""
    n, k = q.shape
    groups, blocks = -(-n // 32), k // 32
    qp = np.zeros((groups * 32, k), dtype=q.dtype)
    qp[:n] = q
    # each k-pair's two bytes moved as one int16 by torch's copy: 2.7x numpy's strided one
    pairs = torch.from_numpy(qp).view(torch.int16).view(groups, 32, blocks, 16)
    ints = pairs.permute(0, 2, 3, 1).contiguous().view(torch.int8).numpy()
    return ints.reshape(groups, blocks, 16, 32, 2), groups, blocks


def with_column_values(
    groups: int,
    blocks: int,
    ints: np.ndarray,
    *per_column: np.ndarray,
    dtype: type[np.floating] = np.float32,
) -> torch.Tensor:
    """Each block's integers, then its 32 columns' values (``dtype``) from each of
    ``per_column``."""
    parts = [ints]
    for values in per_column:
        vp = np.zeros((groups * 32, blocks), dtype=dtype)
        vp[: values.shape[0]] = values
        cols = np.ascontiguousarray(vp.reshape(groups, 32, blocks).transpose(0, 2, 1))
        parts.append(cols.view(np.uint8).reshape(groups, blocks, 32 * vp.itemsize))
    return torch.from_numpy(np.concatenate(parts, axis=2).reshape(-1))


def block_weights(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None) -> torch.Tensor:
    """The bf16 weights ``[N, K]`` that the block kernels form: ``q * scale (+ minimum)`` per
    32 (or, with a scale per 16, 16) k in fp32 (the product exact, one rounding for the sum),
    rounded to bf16."""
    n, k = q.shape
    g = k // scale.shape[1]
    w = torch.from_numpy(q).float().view(n, k // g, g) * torch.from_numpy(scale)[..., None]
    if minimum is not None:
        w += torch.from_numpy(minimum)[..., None]
    return w.view(n, k).to(torch.bfloat16)


def rounds_to(weight: torch.Tensor, source: BlockSource) -> bool:
    """Whether ``weight`` is ``source``'s blocks as the block kernels form them, exactly."""
    q, scale, minimum = source
    for start in range(0, q.shape[0], 8192):
        rows = slice(start, start + 8192)
        part = None if minimum is None else minimum[rows]
        if not torch.equal(block_weights(q[rows], scale[rows], part), weight[rows]):
            return False
    return True


def pack_blocks(
    q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None
) -> tuple[torch.Tensor, str] | None:
    """A source's packing for the block kernels and its form: ``q8`` (int8, fp16 scales per
    32 k: Q8_0, Q5_0), ``q8h`` (int8, fp32 scales per 16 k: Q6_K, or per-32 scales that are
    not fp16 values, each twice), ``q4f16`` (0..15 with fp16 scales and minimums: Q4_0 as
    q + 8 with -8 scale, Q4_1) or ``q4`` (fp32 ones: Q4_K's d * sc, dmin * m). None for a
    form no kernel takes (wider integers with a minimum)."""
    n, k = q.shape
    halves = scale.shape == (n, k // 16)
    low, high = int(q.min(initial=0)), int(q.max(initial=0))
    if minimum is None and low >= -8 and high <= 7 and not halves:  # Q4_0: q + 8, -8 scale
        q, minimum, low, high = q + np.int8(8), scale * np.float32(-8), low + 8, high + 8
    # 0..15 times a scale of at most 20 significant bits is exact in fp32, so the kernel's
    # one fma rounds as torch's product and sum (which rounds_to compared only after the
    # bf16 rounding)
    exact = not (scale.view(np.uint32) & np.uint32(0xF)).any()
    if halves:
        return q8_pack(q, scale), "q8h"
    if minimum is not None and low >= 0 and high <= 15 and exact:
        if fp16_exact(scale) and fp16_exact(minimum):  # Q4_0, Q4_1: 0.625 bytes a weight
            return q4_pack(q, scale, minimum, np.float16), "q4f16"
        return q4_pack(q, scale, minimum), "q4"  # Q4_K
    if minimum is None and fp16_exact(scale):
        return q8_pack(q, scale), "q8"
    if minimum is None:  # fp32 scales: each one for both halves of its block
        return q8_pack(q, np.repeat(scale, 2, axis=1)), "q8h"
    return None
