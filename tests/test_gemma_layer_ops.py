"""Gemma's fused norms (cpu_layer_ops) give transformers' Gemma3RMSNorm arithmetic bit for
bit: ``rnd(x / rms(x) * (1 + w))`` in fp32, the post-norm's residual add rounded where
torch rounds it, and the per-head q/k norms inside the rotary pass; in each dtype the ops
compute here (bf16 on AVX512_BF16, fp32 on AVX2 + FMA too)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_ops_cases import DTYPES, REASON, rand

from prefixcache.engine.kernels import cpu_layer_ops
from prefixcache.engine.model import layer_ops

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU layer ops: {REASON}")


def transformers_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward, written out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def scale_of(weight: torch.Tensor) -> torch.Tensor:
    return (1.0 + weight.float()).contiguous()


SHAPES = [(1, 640), (7, 640), (64, 640), (5, 100), (3, 256), (33, 1152), (2112, 640)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_gemma_rms_norm_is_transformers_bit_for_bit(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    x = rand(rows, cols, seed=rows * cols, scale=4.0, dtype=dtype)
    weight = rand(cols, seed=cols, scale=0.5, dtype=dtype)
    for eps in (1e-6, 1e-5):
        want = transformers_norm(x, weight, eps)
        assert torch.equal(cpu_layer_ops.gemma_rms_norm(x, scale_of(weight), eps), want)
        assert torch.equal(layer_ops.TORCH_OPS.gemma_rms_norm(x, scale_of(weight), eps), want)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 80),
    cols=st.integers(1, 700),
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 3e3]),
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_add_norms_is_add_then_two_norms(
    rows: int, cols: int, seed: int, scale: float, dtype: torch.dtype
) -> None:
    """The post-norm of h added to the residual (rounded), then the next pre-norm of the sum,
    any row count and width (ragged tails, the parallel path), any magnitude."""
    h = rand(rows, cols, seed=seed, scale=scale, dtype=dtype)
    residual = rand(rows, cols, seed=seed + 1, dtype=dtype)
    post = rand(cols, seed=seed + 2, scale=0.7, dtype=dtype)
    pre = rand(cols, seed=seed + 3, scale=0.7, dtype=dtype)
    want_residual = residual + transformers_norm(h, post, 1e-6)
    want = transformers_norm(want_residual, pre, 1e-6)
    kept = residual.data_ptr()
    got, got_residual = cpu_layer_ops.gemma_add_norms(
        h, residual, scale_of(post), scale_of(pre), 1e-6
    )
    assert got_residual.data_ptr() == kept, "the residual is updated in place"
    assert torch.equal(got_residual, want_residual) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "d"), [(1, 4, 1, 256), (37, 4, 1, 256), (9, 3, 1, 80)]
)
def test_rotary_with_gemma_qk_norms(
    tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype
) -> None:
    """q and k as views of the QKV output, each head through Gemma's norm, then rotated."""
    qkv = rand(tokens, (hq + 2 * hk) * d, seed=tokens, scale=3.0, dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    angles = torch.rand(tokens, 1, d // 2, generator=torch.Generator().manual_seed(d)) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_w, k_w = rand(d, seed=1, scale=0.5, dtype=dtype), rand(d, seed=2, scale=0.5, dtype=dtype)
    want_q = layer_ops._rotate(transformers_norm(q, q_w, 1e-6), cos, sin)
    want_k = layer_ops._rotate(transformers_norm(k, k_w, 1e-6), cos, sin)
    norms = (scale_of(q_w), scale_of(k_w), 1e-6)
    torch_q, torch_k = layer_ops.TORCH_OPS.gemma_rotary(q, k, cos, sin, norms)
    assert torch.equal(torch_q, want_q) and torch.equal(torch_k, want_k)
    v_before = qkv[:, (hq + hk) * d :].clone()
    cpu_layer_ops.rotary_(q, k, cos, sin, norms, gemma_norms=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v untouched"


def test_the_norm_kinds_are_checked() -> None:
    """Qwen3's bf16 weights are not taken as Gemma's fp32 scales, nor the reverse; a bf16
    scale is refused in fp32 too."""
    with pytest.raises(ValueError):
        cpu_layer_ops.gemma_rms_norm(
            rand(2, 64, seed=5, dtype=torch.float32), rand(64, seed=4), 1e-6
        )
    if not cpu_layer_ops.computes(torch.bfloat16):
        return
    q, k = rand(2, 1, 64, seed=1), rand(2, 1, 64, seed=2)
    cos = sin = rand(2, 1, 32, seed=3)
    bf16_w = rand(64, seed=4)
    with pytest.raises(ValueError):
        cpu_layer_ops.rotary_(q, k, cos, sin, (bf16_w, bf16_w, 1e-6), gemma_norms=True)
    with pytest.raises(ValueError):
        cpu_layer_ops.rotary_(q, k, cos, sin, (scale_of(bf16_w), scale_of(bf16_w), 1e-6))
    with pytest.raises(ValueError):
        cpu_layer_ops.gemma_rms_norm(rand(2, 64, seed=5), bf16_w, 1e-6)
