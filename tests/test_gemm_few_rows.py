"""A GGUF weight's blocks beside its bf16 panels on AVX-512 without AMX (``cpu_gemm.cpp``'s
``gemm_blocks``, ``PackedLinear.from_blocks``): calls of up to ``few_rows`` rows (12; 6 for
a scale per 16 k) read the blocks (int8 or 4-bit), more rows the panels, and every row's
outputs are the panels' bits whatever its batch. AMX is switched off for this module, so AMX
boxes run this path too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine import settings as engine_settings
from prefixcache.engine.kernels import cpu_gemm, gemm_blocks

pytestmark = pytest.mark.skipif(
    not cpu_gemm.avx512_blocks_available(), reason="no native AVX-512 BF16 GEMM here"
)


@pytest.fixture(autouse=True, scope="module")
def amx_off() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(engine_settings.CPU_AMX_ENV, "0")
        cpu_gemm._amx_lib.cache_clear()
        try:
            yield
        finally:
            cpu_gemm._amx_lib.cache_clear()


def source(n: int, k: int, seed: int, form: str) -> tuple[gemm_blocks.BlockSource, torch.Tensor]:
    """Blocks in each form a kernel takes: ``q8`` (Q8_0), ``q5`` (Q5_0: -16..15), ``q6_k`` (a
    scale per 16 k, fp32 d * sc), ``q8_f32`` (per-32 scales that are not fp16 values),
    ``q4_0`` (-8..7), ``q4_1`` (0..15 + an fp16 minimum), ``q4_k`` (fp32 d * sc, dmin * m)."""
    rng = np.random.default_rng(seed)

    def half(size: float) -> np.ndarray:
        return (rng.random((n, k // 32)) * size).astype(np.float16).astype(np.float32)

    minimum = None
    if form == "q6_k":
        q = rng.integers(-32, 32, size=(n, k), dtype=np.int8)
        d = (rng.random((n, k // 16)) * 0.001).astype(np.float16).astype(np.float32)
        scale = d * rng.integers(-128, 128, size=d.shape).astype(np.float32)
        return (q, scale, None), gemm_blocks.block_weights(q, scale, None)
    low, high = {"q5": (-16, 16), "q4_0": (-8, 8), "q4_1": (0, 16), "q4_k": (0, 16)}.get(
        form, (-128, 128)
    )
    q = rng.integers(low, high, size=(n, k), dtype=np.int8)
    scale = half(0.02)
    if form == "q8_f32":  # 12 significant bits: q * scale exact, not an fp16 value
        scale = (scale * np.float32(1.0 + 2**-11)).astype(np.float32)
    if form in ("q4_1", "q4_k"):
        minimum = -half(0.1)
    if form == "q4_k":  # an fp16 times a 6-bit integer
        scale = scale * rng.integers(0, 64, size=scale.shape).astype(np.float32)
        minimum = minimum * rng.integers(0, 64, size=scale.shape).astype(np.float32)
    return (q, scale, minimum), gemm_blocks.block_weights(q, scale, minimum)


KERNELS = {"q8": "q8", "q5": "q8", "q6_k": "q8h", "q8_f32": "q8h", "q4_0": "q4f16"}
KERNELS |= {"q4_1": "q4f16", "q4_k": "q4"}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    form=st.sampled_from(list(KERNELS)),
    n=st.integers(1, 300),
    k_blocks=st.integers(1, 24),
    m=st.integers(1, 30),
    with_bias=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
    float_out=st.booleans(),
)
def test_a_weight_with_blocks_gives_the_panels_bits_at_every_batch(
    form: str,
    n: int,
    k_blocks: int,
    m: int,
    with_bias: bool,
    threads: int,
    seed: int,
    float_out: bool,
) -> None:
    k = 32 * k_blocks
    src, w = source(n, k, seed, form)
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=gen) if with_bias else None
    head = cpu_gemm.PackedLinear.from_blocks(w, bias, src, float_out)
    panels = cpu_gemm.PackedLinear(w, bias, float_out)
    assert head is not None and head.kernel == panels.kernel == "avx512"
    assert head.few_rows_kernel == KERNELS[form]
    x = torch.randn(m, k + 3, generator=gen).bfloat16()[:, :k]  # rows at a wider stride
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = head(x)
        assert torch.equal(whole, panels(x))
        alone = torch.cat([head(x[i : i + 1]) for i in range(m)])
        assert torch.equal(whole, alone)
        assert head._few is not None  # the blocks at every row count: tiles of 12 and a rest
        head._few = (*head._few[:2], 64)
        assert torch.equal(head(x), whole)
    finally:
        torch.set_num_threads(before)


def test_few_rows_read_the_blocks_and_more_the_panels() -> None:
    src, w = source(100, 64, 1, "q8")
    head = cpu_gemm.PackedLinear.from_blocks(w, None, src, float_out=True)
    assert head is not None and head.blocks is not None
    lib = cpu_gemm._lib()
    assert head.few_rows == cpu_gemm.FEW_ROWS
    src_h, w_h = source(100, 64, 1, "q6_k")  # a scale per 16 k: fewer rows pay
    halves = cpu_gemm.PackedLinear.from_blocks(w_h, None, src_h)
    assert halves is not None and halves.few_rows == cpu_gemm.FEW_ROWS_OF_FORM["q8h"] == 6
    for m in (1, cpu_gemm.FEW_ROWS, head.few_rows, head.few_rows + 1, 40):
        x = torch.zeros(m, 64, dtype=torch.bfloat16)
        call = head.call(x, torch.empty(m, 100))
        few = m <= head.few_rows
        assert call.fn is (lib.pc_gemm_q8 if few else lib.pc_gemm_bf16)
        assert call.args[3] == (head.blocks.data_ptr() if few else head.packed.data_ptr())
    # 4 groups of 32 columns (the last one padded) x 2 blocks of 32 k, 34 bytes a group row
    assert head.blocks.dtype == torch.uint8 and head.blocks.numel() == 4 * 2 * (1024 + 64)


def test_blocks_no_kernel_takes_or_not_the_weight_are_refused() -> None:
    src, w = source(64, 64, 2, "q4_1")
    q, scale, minimum = src
    wide = (q.astype(np.int16) * 2).astype(np.int8)  # 0..30 with a minimum: no kernel's form
    w_wide = gemm_blocks.block_weights(wide, scale, minimum)
    assert cpu_gemm.PackedLinear.from_blocks(w_wide, None, (wide, scale, minimum)) is None
    other = w.clone()
    other[0, 0] = other[0, 0] * 2 + 1  # not the blocks' rounding
    assert cpu_gemm.PackedLinear.from_blocks(other, None, src) is None
    assert cpu_gemm.PackedLinear.from_blocks(w.float(), None, src) is None  # bf16 only
    assert cpu_gemm.PackedLinear.from_blocks(w, None, src) is not None


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K"])
def test_a_gguf_models_linears_read_their_blocks_for_few_rows(tmp_path: Path, qtype: str) -> None:
    """A dequantized bf16 GGUF model, every weight ``qtype``, the embedding tied: each
    projection and the head keep their panels and add their blocks; the logits at one row, a
    few and over a prompt are those of the same model without blocks, bit for bit."""
    test_gguf = pytest.importorskip("test_gguf")
    loaded, panels = test_gguf.with_and_without_blocks(tmp_path, qtype)
    # Q4_0's and Q4_1's scales and minimums are fp16 values; Q4_K's (d * sc) mostly not
    form = {"Q8_0": "q8", "Q5_0": "q8", "Q4_K": "q4"}.get(qtype, "q4f16")
    for layer in loaded.model.model.layers:
        for proj in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down):
            assert proj.invariant.kernel == "avx512" and proj.invariant.few_rows_kernel == form
    head = loaded.model.head.invariant
    assert head.kernel == "avx512" and head.few_rows_kernel == form
    assert panels.model.head.invariant.few_rows_kernel is None
    assert not any(hasattr(m, "block_source") for m in loaded.model.modules())
    ids = list(range(3, 40))
    for rows in (ids, ids[:1], ids[:5]):
        want = test_gguf.run_logits(panels, rows)
        assert torch.equal(test_gguf.run_logits(loaded, rows), want)
