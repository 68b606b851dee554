"""The quantized-weight GEMM (bf16 activations on AVX512_BF16, fp32 on AVX2 + FMA): GGUF
blocks split into exactly the values the ``gguf`` dequantizer gives, rows gathered as the
dequantizing loader casts them, products close to a float64 reference, and every row's bits
independent of its batch and threads, in each dtype the kernel computes here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.kernels import cpu_qgemm
from prefixcache.engine.model.gguf_blocks import QUANTIZABLE_TYPES, split_blocks

gguf = pytest.importorskip("gguf")

REASON = cpu_qgemm.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU quantized GEMM: {REASON}")
DTYPES = [
    pytest.param(
        dtype,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(
            REASON is not None or not cpu_qgemm.computes(dtype),
            reason=f"CPU quantized GEMM, {dtype}: {REASON or cpu_qgemm.dtype_reason(dtype)}",
        ),
    )
    for dtype in (torch.bfloat16, torch.float32)
]
# the output's rounding (half an ulp) and the fp32 accumulation, relative
OUTPUT_ULP = {torch.bfloat16: 2**-8, torch.float32: 2**-22}

# bytes a block, weights a block, offsets of its fp16 fields
LAYOUTS = {
    "Q8_0": (34, 32, (0,)),
    "Q4_0": (18, 32, (0,)),
    "Q4_1": (20, 32, (0, 2)),
    "Q5_0": (22, 32, (0,)),
    "Q4_K": (144, 256, (0, 2)),
}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in the type's layout, its fp16 scales finite and small."""
    size, per, halves = LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off in halves:
        d = (rng.standard_normal((n, k // per, 1)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[type_name]
    return np.asarray(gguf.dequantize(raw, kind), dtype=np.float32).reshape(n, k)


def linear_of(
    type_name: str, n: int, k: int, seed: int
) -> tuple[cpu_qgemm.QuantizedLinear, np.ndarray]:
    raw = random_blocks(type_name, n, k, seed)
    ints = split_blocks(raw, type_name, n, k)
    assert ints is not None
    weight = cpu_qgemm.QuantizedWeight.pack(ints.q, ints.scale, ints.minimum)
    return cpu_qgemm.QuantizedLinear(weight), dequantized(raw, type_name, n, k)


def test_layouts_cover_the_quantizable_types() -> None:
    assert set(LAYOUTS) == set(QUANTIZABLE_TYPES)
    assert split_blocks(np.zeros(100, np.uint8), "Q6_K", 1, 256) is None


@pytest.mark.parametrize("type_name", QUANTIZABLE_TYPES)
def test_split_gives_the_dequantizers_values(type_name: str) -> None:
    n, k = 24, 512
    raw = random_blocks(type_name, n, k, seed=1)
    ints = split_blocks(raw, type_name, n, k)
    assert ints is not None
    values = ints.scale.repeat(32, axis=1) * ints.q.astype(np.float32)
    if ints.minimum is not None:
        assert ints.q.min() >= 0 and ints.q.max() <= 15
        values = values + ints.minimum.repeat(32, axis=1)
    np.testing.assert_array_equal(values, dequantized(raw, type_name, n, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", QUANTIZABLE_TYPES)
def test_gather_equals_the_dequantizing_loader(type_name: str, dtype: torch.dtype) -> None:
    n, k = 70, 256
    lin, ref = linear_of(type_name, n, k, seed=2)
    ids = torch.tensor([[0, 69, 17], [16, 15, 33]])
    expect = torch.from_numpy(ref)[ids].to(dtype)
    assert torch.equal(lin.gather(ids, dtype), expect)
    with pytest.raises(IndexError):
        lin.gather(torch.tensor([n]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", QUANTIZABLE_TYPES)
# (1, 240) and (2, 272): a few rows over 15 and 17 groups take four groups a task (3 and 1 at
# the tail); the others two
@pytest.mark.parametrize(
    ("m", "n"), [(1, 48), (1, 100), (2, 40), (3, 100), (9, 32), (70, 77), (1, 240), (2, 272)]
)
def test_product_matches_float64(type_name: str, m: int, n: int, dtype: torch.dtype) -> None:
    k = 512
    lin, ref = linear_of(type_name, n, k, seed=3)
    bias = torch.randn(n)
    lin = cpu_qgemm.QuantizedLinear(lin.weight, bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    w64 = torch.from_numpy(ref).double()
    exact = x.double() @ w64.T + bias.double()
    magnitude = x.double().abs() @ w64.abs().T
    got = lin(x)
    assert got.dtype == dtype
    err = (got.double() - exact).abs()
    assert (err <= OUTPUT_ULP[dtype] * exact.abs() + 1e-5 * magnitude + 1e-6).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    type_name=st.sampled_from(["Q8_0", "Q4_1", "Q5_0", "Q4_K"]),
    m=st.integers(1, 70),
    n=st.sampled_from([16, 40, 80, 100, 240, 272]),  # 240, 272: four groups a task at m <= 2
    data=st.data(),
    threads=st.integers(1, 3),
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_their_batch(
    type_name: str, m: int, n: int, data: st.DataObject, threads: int, dtype: torch.dtype
) -> None:
    k = 256
    lin, _ = linear_of(type_name, n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    row = data.draw(st.integers(0, m - 1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = lin(x[row : row + 1])
        torch.set_num_threads(threads)
        batched = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched[row], alone[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_equals_the_parts(dtype: torch.dtype) -> None:
    a, _ = linear_of("Q5_0", 48, 256, seed=6)
    b, _ = linear_of("Q5_0", 20, 256, seed=7)
    fused = cpu_qgemm.QuantizedWeight.concat([a.weight, b.weight])
    assert fused is not None and fused.n == 68
    x = torch.randn(5, 256).to(dtype)
    both = cpu_qgemm.QuantizedLinear(fused)(x)
    assert torch.equal(both, torch.cat([a(x), b(x)], dim=1))
    assert cpu_qgemm.QuantizedWeight.concat([b.weight, a.weight]) is None  # 20: a half group
    u, _ = linear_of("Q4_1", 48, 256, seed=8)
    assert cpu_qgemm.QuantizedWeight.concat([a.weight, u.weight]) is None  # formats differ


@needs_kernel
def test_refuses_what_it_cannot_compute() -> None:
    lin, _ = linear_of("Q8_0", 16, 64, seed=9)
    with pytest.raises(ValueError):
        lin(torch.randn(2, 64).half())
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(ValueError):
            lin(torch.randn(2, 32).to(dtype))  # k
        if not cpu_qgemm.computes(dtype):  # e.g. bf16 on the AVX2 build: refused, not emulated
            with pytest.raises(ValueError, match="AVX512_BF16"):
                lin(torch.randn(2, 64).to(dtype))
    with pytest.raises(ValueError):
        cpu_qgemm.QuantizedWeight.pack(np.zeros((4, 48), np.int8), np.zeros((4, 1), np.float32))
