"""The LM head's GGUF blocks beside its panels on AVX-512 without AMX (``cpu_gemm.cpp``'s
``gemm_q8``, ``PackedLinear.from_blocks``): calls of up to ``FEW_ROWS`` rows read the int8
blocks, more rows the bf16 panels, and every row's logits are the panels' bits whatever its
batch. AMX is switched off for this module, so AMX boxes run the AVX-512 path too."""

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
from prefixcache.engine.model.loader import load_model

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
    """Blocks without a minimum: ``q8`` (Q8_0), ``q5`` (Q5_0: -16..15), ``q6_k`` (a scale
    per 16 k, fp32 d * sc), ``q8_f32`` (per-32 scales that are not fp16 values)."""
    rng = np.random.default_rng(seed)
    low = {"q5": -16, "q6_k": -32}.get(form, -128)
    q = rng.integers(low, -low, size=(n, k), dtype=np.int8)
    if form == "q6_k":
        d = (rng.random((n, k // 16)) * 0.001).astype(np.float16).astype(np.float32)
        scale = d * rng.integers(-128, 128, size=d.shape).astype(np.float32)
    else:
        scale = (rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
        if form == "q8_f32":  # 12 significant bits: q * scale exact, not an fp16 value
            scale = (scale * np.float32(1.0 + 2**-11)).astype(np.float32)
    return (q, scale, None), gemm_blocks.block_weights(q, scale, None)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    form=st.sampled_from(["q8", "q5", "q6_k", "q8_f32"]),
    n=st.integers(1, 300),
    k_blocks=st.integers(1, 24),
    m=st.integers(1, 14),
    with_bias=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_a_head_with_blocks_gives_the_panels_bits_at_every_batch(
    form: str, n: int, k_blocks: int, m: int, with_bias: bool, threads: int, seed: int
) -> None:
    k = 32 * k_blocks
    src, w = source(n, k, seed, form)
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=gen) if with_bias else None
    head = cpu_gemm.PackedLinear.from_blocks(w, bias, src, float_out=True)
    panels = cpu_gemm.PackedLinear(w, bias, float_out=True)
    assert head is not None and head.kernel == panels.kernel == "avx512"
    assert head.few_rows_kernel == ("q8h" if form in ("q6_k", "q8_f32") else "q8")
    x = torch.randn(m, k + 3, generator=gen).bfloat16()[:, :k]  # rows at a wider stride
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = head(x)
        assert torch.equal(whole, panels(x))
        alone = torch.cat([head(x[i : i + 1]) for i in range(m)])
        assert torch.equal(whole, alone)
    finally:
        torch.set_num_threads(before)


def test_few_rows_read_the_blocks_and_more_the_panels() -> None:
    src, w = source(100, 64, 1, "q8")
    head = cpu_gemm.PackedLinear.from_blocks(w, None, src, float_out=True)
    assert head is not None and head.blocks is not None
    lib = cpu_gemm._lib()
    for m in (1, cpu_gemm.FEW_ROWS, cpu_gemm.FEW_ROWS + 1, 40):
        x = torch.zeros(m, 64, dtype=torch.bfloat16)
        call = head.call(x, torch.empty(m, 100))
        few = m <= cpu_gemm.FEW_ROWS
        assert call.fn is (lib.pc_gemm_q8 if few else lib.pc_gemm_bf16)
        assert call.args[3] == (head.blocks.data_ptr() if few else head.packed.data_ptr())
    # 4 groups of 32 columns (the last one padded) x 2 blocks of 32 k, 34 bytes a group row
    assert head.blocks.dtype == torch.uint8 and head.blocks.numel() == 4 * 2 * (1024 + 64)


def test_layers_and_blocks_with_a_minimum_keep_their_panels_only() -> None:
    src, w = source(64, 64, 2, "q8")
    assert cpu_gemm.PackedLinear.from_blocks(w, None, src, float_out=False) is None
    q, scale, _ = src
    q4 = np.abs(q) % 16
    minimum = -scale
    w4 = gemm_blocks.block_weights(q4, scale, minimum)
    assert cpu_gemm.PackedLinear.from_blocks(w4, None, (q4, scale, minimum), True) is None
    other = w.clone()
    other[0, 0] = other[0, 0] * 2 + 1  # not the blocks' rounding
    assert cpu_gemm.PackedLinear.from_blocks(other, None, src, True) is None


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_1"])
def test_a_gguf_models_head_reads_its_blocks_for_few_rows(tmp_path: Path, qtype: str) -> None:
    """A dequantized bf16 GGUF model with a tied ``qtype`` embedding: the head keeps its
    panels and (no minimum) adds the blocks; the layers keep panels; the logits at one row
    and over a prompt are those of the same model without blocks, bit for bit."""
    test_gguf = pytest.importorskip("test_gguf")
    model = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    test_gguf.write_gguf(path, model, getattr(test_gguf.Q, qtype))
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    panels = load_model(str(path), dtype="bfloat16", device="cpu")
    for module in panels.model.modules():
        module.__dict__.pop("block_source", None)
    loaded.model.prepare()
    panels.model.prepare()
    head = loaded.model.head.invariant
    assert head.kernel == "avx512"
    assert head.few_rows_kernel == (None if qtype == "Q4_1" else "q8")
    for layer in loaded.model.model.layers:
        assert layer.mlp.down.invariant.few_rows_kernel is None
    assert not any(hasattr(m, "block_source") for m in loaded.model.modules())
    ids = list(range(3, 40))
    for rows in (ids, ids[:1], ids[:5]):
        want = test_gguf.run_logits(panels, rows)
        assert torch.equal(test_gguf.run_logits(loaded, rows), want)
