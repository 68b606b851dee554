"""The AMX paths. The bf16 GEMM (``cpu_gemm_amx.cpp``): each row is a function of that row
alone, at every M, offset, width and row stride; close to a float64 reference; a weight keeps
the kernel it was given; from a GGUF Q8_0 source, the same bits as from its bf16 weight. The row attention's AMX step agrees with its AVX-512 step (the
bitwise invariance of either is test_row_partitions.py's, on whichever this CPU runs).
Skipped where the CPU has no AMX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine import settings as engine_settings
from prefixcache.engine.kernels import cpu_gemm, gemm_blocks
from prefixcache.engine.kernels.linear import Gemm
from prefixcache.engine.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not cpu_gemm.amx_available(), reason="no AMX here (or its kernel cannot load)"
)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    k_steps=st.integers(1, 40),
    n=st.integers(1, 200),
    m=st.one_of(st.integers(1, 90), st.sampled_from([300, 700, 1100])),  # several row chunks
    with_bias=st.booleans(),
    extra_stride=st.integers(0, 40),
)
def test_amx_rows_do_not_depend_on_their_batch(
    seed: int, k_steps: int, n: int, m: int, with_bias: bool, extra_stride: int
) -> None:
    k = cpu_gemm.AMX_K_STEP * k_steps
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16() if with_bias else None
    gemm = cpu_gemm.PackedLinear(w, bias)
    assert gemm.kernel == "amx"
    # rows of a wider buffer: the kernel reads x at its row stride, not k
    x = torch.randn(m, k + extra_stride, generator=gen).bfloat16()[:, :k]
    whole = gemm(x)
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(m)])
    assert torch.equal(whole, alone)
    for cut in {1, m // 2, m - 1} - {0}:
        assert torch.equal(gemm(x[cut:]), alone[cut:])
        assert torch.equal(gemm(x[:cut]), alone[:cut])
    # one bf16 rounding of an fp32 sum: within a few bf16 ulps of the exact value
    exact = reference(x, w, bias)
    torch.testing.assert_close(whole.double(), exact, atol=0.02, rtol=0.02)


def test_amx_matches_the_reference_at_the_serving_shapes() -> None:
    gen = torch.Generator().manual_seed(7)
    for k, n in [(576, 1728), (1536, 576), (512, 2203), (640, 4096)]:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        gemm = cpu_gemm.PackedLinear(w, None)
        x = torch.randn(300, k, generator=gen).bfloat16()
        exact = reference(x, w, None)
        got = gemm(x).double()
        # the rounding to bf16 is the only loss: at most half an ulp beyond the fp32 sum
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
        assert ((got - exact).abs() <= ulp + 1e-3).float().mean() > 0.999, (k, n)


def test_a_row_of_infinities_leaves_the_other_rows_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    gemm = cpu_gemm.PackedLinear(w, None)
    x = torch.randn(20, 96, generator=gen).bfloat16()
    clean = gemm(x)
    x[5] = float("inf")
    dirty = gemm(x)
    keep = [i for i in range(20) if i != 5]
    assert torch.equal(dirty[keep], clean[keep])


def test_a_weight_keeps_its_kernel_and_other_widths_keep_avx512(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cpu_gemm.PackedLinear(torch.zeros(8, 48, dtype=torch.bfloat16), None).kernel == (
        "avx512"
    )
    assert cpu_gemm.PackedLinear(torch.zeros(8, 64), None).kernel == "f32"
    gemm = cpu_gemm.PackedLinear(torch.ones(8, 64, dtype=torch.bfloat16), None)
    monkeypatch.setenv(engine_settings.CPU_AMX_ENV, "0")
    cpu_gemm._amx_lib.cache_clear()
    try:
        assert not cpu_gemm.amx_available()
        off = cpu_gemm.PackedLinear(torch.ones(8, 64, dtype=torch.bfloat16), None)
        assert off.kernel == "avx512" and gemm.kernel == "amx"
        x = torch.ones(3, 64, dtype=torch.bfloat16)
        assert torch.equal(gemm(x), off(x))  # exact sums here: both kernels give 64
    finally:
        cpu_gemm._amx_lib.cache_clear()


# Row attention with the AMX step off, in a child process (the choice is made once per
# process): the same inputs as `_row_case`, the output saved for the parent to compare.
_ROW_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_cpu_amx import _row_case
from prefixcache.engine.attention import row_kernels
assert not row_kernels.rows_on_amx()
torch.save(row_kernels.row_attention(*_row_case()), sys.argv[1])
"""


def _row_case() -> tuple[torch.Tensor, ...]:
    """Two sequences (a 700-token prefill chunk after 300 cached keys, and a decode over 2,100
    keys), 8 query / 2 KV heads of 64, bf16, pages of 16 in shuffled order."""
    gen = torch.Generator().manual_seed(11)
    bs, hk, hq, d, lens, rows = 16, 2, 8, 64, [1000, 2100], [700, 1]
    blocks = [(n + bs - 1) // bs for n in lens]
    kv = torch.randn(sum(blocks), 2, bs, hk, d, generator=gen).bfloat16()
    order = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(2, max(blocks), dtype=torch.int32)
    tables[0, : blocks[0]], tables[1, : blocks[1]] = order[: blocks[0]], order[blocks[0] :]
    q = torch.randn(sum(rows), hq, d, generator=gen).bfloat16()
    qo = torch.tensor([0, rows[0], sum(rows)], dtype=torch.int64)
    return q, kv, tables, qo, torch.tensor(lens, dtype=torch.int64), d**-0.5


def test_row_attention_on_amx_agrees_with_the_avx512_step(tmp_path: Path) -> None:
    from prefixcache.engine.attention import row_kernels

    if not row_kernels.rows_on_amx():
        pytest.skip("the row kernel does not run on AMX here")
    case = _row_case()
    amx = row_kernels.row_attention(*case)
    saved = tmp_path / "avx512.pt"
    env = {**os.environ, engine_settings.CPU_AMX_ENV: "0"}
    subprocess.run(
        [sys.executable, "-c", _ROW_CHILD, str(saved), str(Path(__file__).parent)],
        env=env, check=True, timeout=300,
    )  # fmt: skip
    avx512 = torch.load(saved)
    # Two roundings of P and O in bf16 either way: the steps agree to a few bf16 ulps.
    torch.testing.assert_close(amx.float(), avx512.float(), atol=2e-2, rtol=2e-2)
    assert (amx.float() - avx512.float()).abs().mean() < 1e-3


def block_source(
    n: int, k: int, seed: int, form: str
) -> tuple[gemm_blocks.BlockSource, torch.Tensor]:
    """GGUF-like block integers with fp16-valued scales (and minimums), and the dequantized
    bf16 weight: ``q8`` (Q8_0, Q5_0: int8, no minimum), ``q4_1`` (Q4_1: 0..15, + m), ``q4_k``
    (Q4_K: 0..15, - dmin m with 17-bit scales), ``q4_0`` (Q4_0: -8..7, no minimum), ``q6_k``
    (Q6_K: -32..31 with a scale per 16 k)."""
    rng = np.random.default_rng(seed)

    def half(scale: float) -> np.ndarray:
        return (rng.random((n, k // 32)) * scale).astype(np.float16).astype(np.float32)

    minimum = None
    if form == "q6_k":  # a scale per 16 k: fp16 d times an int8, q in -32..31
        q = rng.integers(-32, 32, size=(n, k), dtype=np.int8)
        d = (rng.random((n, k // 16)) * 0.001).astype(np.float16).astype(np.float32)
        scale = d * rng.integers(-128, 128, size=d.shape).astype(np.float32)
        return (q, scale, None), gemm_blocks.block_weights(q, scale, None)
    if form == "q8":
        q = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    elif form == "q4_0":
        q = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    else:
        q = rng.integers(0, 16, size=(n, k), dtype=np.int8)
        minimum = -half(0.1)
    scale = half(0.02)
    if form == "q4_k":  # d * sc and dmin * m: an fp16 times a 6-bit integer
        scale = scale * rng.integers(0, 64, size=scale.shape).astype(np.float32)
        minimum = minimum * rng.integers(0, 64, size=scale.shape).astype(np.float32)
    source = (q, scale, minimum)
    return source, gemm_blocks.block_weights(*source)


FORMS = {
    "q8": "q8_amx",
    "q4_0": "q4f16_amx",
    "q4_1": "q4f16_amx",
    "q4_k": "q4_amx",
    "q6_k": "q8h_amx",
}


@pytest.mark.parametrize(("n", "k"), [(1000, 640), (33, 64), (96, 2048)])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("float_out", [True, False])
def test_a_block_source_gives_the_bf16_kernels_bits(
    n: int, k: int, form: str, float_out: bool
) -> None:
    """``PackedLinear.from_blocks`` (the blocks converted in the kernel) against the bf16
    AMX kernel on their dequantized weight: equal at every M, one row tile, one chunk of
    rows or several, the last one partial (``X_CHUNK_BYTES`` of x: 800 rows at K 640, 256 at
    2,048, all of them at 64), with a bias, on 1 and 2 threads."""
    source, w = block_source(n, k, n + k, form)
    bias = None if float_out else torch.randn(n, generator=torch.Generator().manual_seed(n))
    ref = cpu_gemm.PackedLinear(w, bias, float_out)
    blocks = cpu_gemm.PackedLinear.from_blocks(w, bias, source, float_out)
    assert blocks is not None and ref.kernel == "amx"
    assert blocks.kernel == FORMS[form]
    x = torch.randn(1700, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    rows = (1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 70, 257, 300, 513, 1700)
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in rows if k < 2048 or t == threads else rows[:-1]:
                assert torch.equal(blocks(x[:m]), ref(x[:m])), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("n", "k"), [(20, 96), (65, 32), (5, 2048), (32800, 64)])
@pytest.mark.parametrize("form", ["q8", "q4_k", "q6_k"])
def test_block_calls_of_one_chunk_on_more_threads_than_even_groups(
    n: int, k: int, form: str
) -> None:
    """33-256 rows run each thread's column groups in turn, the next group converted during
    this one's row blocks: the bf16 kernel's bits where the groups split unevenly over 3 and
    5 threads, or leave a thread none (one group of 32 columns). A head-wide weight (1,025
    groups) copies a partial row tile's rows once per call (``XPAD_GROUPS``): 1, 5, 17 rows."""
    source, w = block_source(n, k, n * k, form)
    ref = cpu_gemm.PackedLinear(w, None, True)
    blocks = cpu_gemm.PackedLinear.from_blocks(w, None, source, True)
    assert blocks is not None
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in (3, 5):
            torch.set_num_threads(t)
            for m in (1, 5, 17, 33, 47, 64, 100, 256):
                assert torch.equal(blocks(x[:m]), ref(x[:m])), (t, m)
    finally:
        torch.set_num_threads(threads)


def test_a_block_source_that_is_not_the_weight_is_refused() -> None:
    source, w = block_source(64, 64, 1, "q4_1")
    other = w.clone()
    other[3, 5] = other[3, 5] * 2 + 1
    assert cpu_gemm.PackedLinear.from_blocks(other, None, source) is None
    assert cpu_gemm.PackedLinear.from_blocks(w.float(), None, source) is None  # bf16 only
    q, scale, minimum = source
    wide = (q.astype(np.int16) * 2).astype(np.int8)  # 0..30 with a minimum: no kernel's form
    assert cpu_gemm.PackedLinear.from_blocks(
        gemm_blocks.block_weights(wide, scale, minimum), None, (wide, scale, minimum)
    ) is None  # fmt: skip
    full = scale * np.float32(1.0 + 2**-20)  # 24 significant bits: q * scale not exact
    assert cpu_gemm.PackedLinear.from_blocks(
        gemm_blocks.block_weights(q, full, minimum), None, (q, full, minimum)
    ) is None  # fmt: skip
    assert cpu_gemm.PackedLinear.from_blocks(w, None, source) is not None


def test_int8_blocks_keep_fp16_scales_where_they_are_fp16_values() -> None:
    """Q8_0 / Q5_0 scales are fp16 values, packed as fp16 (1.06 bytes a weight); a per-32
    scale that is not (12 significant bits: q * scale still exact in fp32) takes the per-16
    layout with each scale twice, fp32: the same bits either way, every fp16 value included
    (subnormals, negatives)."""
    rng = np.random.default_rng(7)
    every = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    every = every[np.isfinite(every)]
    n = len(every) // 64 * 64
    for scale in (every[:n].reshape(-1, 1), (rng.random((96, 3)) * 0.01).astype(np.float32)):
        if scale.shape[0] == 96:  # 12 significant bits: not fp16 values
            scale = (scale.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
        q = rng.integers(-128, 128, size=(scale.shape[0], 32 * scale.shape[1])).astype(np.int8)
        q[:, :2] = (-128, 127)  # the int8 range: never the 4-bit form
        w = gemm_blocks.block_weights(q, scale, None)
        blocks = cpu_gemm.PackedLinear.from_blocks(w, None, (q, scale, None), float_out=True)
        assert blocks is not None
        assert blocks.kernel == ("q8_amx" if gemm_blocks.fp16_exact(scale) else "q8h_amx")
        x = torch.randn(70, q.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
        assert torch.equal(blocks(x), cpu_gemm.PackedLinear(w, None, float_out=True)(x))
        assert torch.equal(blocks.weight_rows(torch.arange(q.shape[0])), w)
    assert gemm_blocks.fp16_exact(every) and not gemm_blocks.fp16_exact(scale)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K"])
def test_a_gguf_models_linears_run_from_their_blocks(tmp_path: Path, qtype: str) -> None:
    """A dequantized bf16 GGUF model, every weight ``qtype``: each projection and the tied
    head read their blocks (llama's q/k rows permuted back, q/k/v and
    gate/up fused), and the logits are the bf16 panels' on the loaded weights, bit for
    bit, at one row and over a prompt."""
    test_gguf = pytest.importorskip("test_gguf")
    loaded, panels = test_gguf.with_and_without_blocks(tmp_path, qtype)
    # Q4_0's and Q4_1's scales and minimums are fp16 values; Q4_K's (d * sc) mostly not
    kernel = {"Q8_0": "q8_amx", "Q5_0": "q8_amx", "Q4_K": "q4_amx"}.get(qtype, "q4f16_amx")
    for layer in loaded.model.model.layers:
        for proj in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down):
            assert isinstance(proj, Gemm) and proj.invariant is not None
            assert proj.invariant.kernel == kernel
    assert loaded.model.head.invariant.kernel == kernel  # the tied embedding's blocks
    assert not any(hasattr(m, "block_source") for m in loaded.model.modules())  # let go
    assert panels.model.head.invariant.kernel == "amx"
    ids = list(range(3, 40))
    assert torch.equal(test_gguf.run_logits(loaded, ids), test_gguf.run_logits(panels, ids))
    assert torch.equal(test_gguf.run_logits(loaded, ids[:1]), test_gguf.run_logits(panels, ids[:1]))


def test_gguf_blocks_off_packs_bf16_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PREFIXCACHE_GGUF_BLOCKS=0``: the same model keeps no blocks and runs the bf16 panels."""
    test_gguf = pytest.importorskip("test_gguf")
    model = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    test_gguf.write_gguf(path, model, test_gguf.Q.Q4_1)
    monkeypatch.setenv(engine_settings.GGUF_BLOCKS_ENV, "0")
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    assert not any(hasattr(m, "block_source") for m in loaded.model.modules())
    loaded.model.prepare()
    assert loaded.model.head.invariant.kernel == "amx"
    assert {layer.mlp.down.invariant.kernel for layer in loaded.model.model.layers} == {"amx"}


def test_q6_k_blocks_split_as_gguf_dequantizes_them() -> None:
    """``split_q6_k`` over random Q6_K bytes (a finite fp16 d each): its ``q * scale`` per 16
    weights is ``gguf.dequantize``'s value exactly."""
    gguf = pytest.importorskip("gguf")
    from prefixcache.engine.model.gguf_blocks import split_q6_k

    rng = np.random.default_rng(0)
    n, k = 48, 512
    raw = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    d = (rng.random(n * k // 256) * 0.01).astype(np.float16)
    raw[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    ints = split_q6_k(raw, n, k)
    assert ints is not None and ints.scale.shape == (n, k // 16)
    ours = (ints.q.astype(np.float32).reshape(n, k // 16, 16) * ints.scale[..., None]).reshape(n, k)
    want = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k)
    assert np.array_equal(ours, want)


def test_fused_parts_with_per_16_and_per_32_scales_share_one_kernel() -> None:
    """A Q6_K part (Gemma's ffn_down in some layers, many files' attn_v) fused with Q5_0-like
    ones: the per-32 scales repeated per 16, one ``q8h_amx`` weight, the parts' bits."""
    from prefixcache.engine.model.llama import _fuse_sources

    a, wa = block_source(64, 256, 1, "q8")
    b, wb = block_source(32, 256, 2, "q6_k")
    fused = _fuse_sources([a, b])
    assert fused is not None and fused[1].shape == (96, 256 // 16)
    w = torch.cat([wa, wb])
    kernel = cpu_gemm.PackedLinear.from_blocks(w, None, fused)
    assert kernel is not None and kernel.kernel == "q8h_amx"
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(kernel(x), cpu_gemm.PackedLinear(w, None)(x))
    c, _ = block_source(32, 256, 3, "q4_1")  # a minimum beside per-16 scales: no one form
    assert _fuse_sources([b, c]) is None
