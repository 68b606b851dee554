"""GGUF block-quantized tensors split into integers and per-32 scales, for ``cpu_qgemm``.

Each supported type becomes ``w = scale * q`` (``q`` int8) or ``w = scale * q + minimum``
(``q`` in 0..15) per 32 consecutive k, with scale and minimum float32 and exact: the
products the ``gguf`` package's dequantizer forms (fp16 d times a small integer) are exact in
float32, so ``scale * q (+ minimum)`` in float32 is the value it gives. Layouts (ggml's):
Q8_0 ``[d fp16][32 int8]``; Q4_0 ``[d][16 bytes]`` w = d (q - 8); Q4_1 ``[d][m][16 bytes]``
w = d q + m; Q5_0 ``[d][qh u32][16 bytes]`` w = d (q - 16), bit 4 of weight j from qh bit
j; Q4_K: 256 weights ``[d][dmin][12 bytes of 6-bit scales and mins][128 bytes]``, sub-block
j (32 weights) w = d sc_j q - dmin m_j. In the 16-byte forms weight j < 16 is byte j's low
nibble and weight j + 16 its high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTIZABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K")


@dataclass(frozen=True, slots=True)
class BlockInts:
    q: np.ndarray  # int8 [n, k]
    scale: np.ndarray  # float32 [n, k / 32]
    minimum: np.ndarray | None  # float32 [n, k / 32], or None where w = scale * q


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 weights: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def split_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> BlockInts | None:
    """``data``: the tensor's raw bytes (any shape) for a ``[n, k]`` weight; None for a type
    kept dequantized."""
    if type_name not in QUANTIZABLE_TYPES or k % 32:
        return None
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if type_name == "Q4_K":
        return _split_q4_k(raw, n, k)
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22}[type_name]
    blocks = raw.reshape(n, k // 32, block_bytes)
    d = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":
        return BlockInts(blocks[..., 2:].view(np.int8).reshape(n, k), d, None)
    if type_name == "Q4_1":
        q = _nibbles(blocks[..., 4:]).astype(np.int8)
        return BlockInts(q.reshape(n, k), d, _f16(blocks[..., 2:4]))
    if type_name == "Q4_0":
        q = _nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)
        return BlockInts(q.reshape(n, k), d, None)
    qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # Q5_0
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_nibbles(blocks[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
    return BlockInts(q.reshape(n, k), d, None)


def _split_q4_k(raw: np.ndarray, n: int, k: int) -> BlockInts | None:
    if k % 256:
        return None
    blocks = raw.reshape(n, k // 256, 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.uint8)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high ones 2c + 1
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).astype(np.int8)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 32)
    minimum = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, k // 32)
    return BlockInts(q.reshape(n, k), scale.astype(np.float32), minimum.astype(np.float32))


def split_q6_k(data: np.ndarray, n: int, k: int) -> BlockInts | None:
    """Q6_K (256 weights: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16
    d): ``w = (d * scale_j) * (q - 32)`` per 16 weights, so this ``scale`` is per 16 k
    (``[n, k / 16]``), exact in fp32 (11 + 8 bits). For the bf16 GEMM's blocks only
    (``cpu_gemm.PackedLinear.from_blocks``); ``cpu_qgemm`` takes per-32 scales."""
    if k % 256:
        return None
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(-1, 210)
    nb = blocks.shape[0]
    lo = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    hi = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = ((lo & 0x0F).reshape(nb, 8, 32) | ((hi & 0x03).reshape(nb, 8, 32) << 4)).astype(np.int8)
    scale = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return BlockInts((q - np.int8(32)).reshape(n, k), scale.reshape(n, k // 16), None)


def block_ints(data: np.ndarray, type_name: str, n: int, k: int) -> BlockInts | None:
    """``split_blocks``, or ``split_q6_k`` for Q6_K (per-16 scales); None for other types."""
    return split_q6_k(data, n, k) if type_name == "Q6_K" else split_blocks(data, type_name, n, k)


def dequantize_ints(ints: BlockInts) -> np.ndarray:
    """The weights as float32 ``[n, k]``: ``q * scale (+ minimum)`` per group, the values the
    ``gguf`` package's dequantizer gives (its products are exact in float32, as here, and it
    adds the minimum with one rounding, as here), without its Python loop over row groups:
    Gemma 3's 236 tensors took 3.7 s there."""
    n, k = ints.q.shape
    groups = ints.scale.shape[1]
    w = ints.q.reshape(n, groups, k // groups).astype(np.float32)
    w *= ints.scale[..., None]
    if ints.minimum is not None:
        w += ints.minimum[..., None]
    return w.reshape(n, k)
