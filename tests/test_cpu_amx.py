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
from prefixcache.engine.kernels import cpu_gemm
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
    m=st.integers(1, 90),
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


def q8_weights(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """GGUF Q8_0-like integers and fp16-valued scales, and the dequantized bf16 weight."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    scale = (rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
    w = torch.from_numpy(q).float().view(n, -1, 32) * torch.from_numpy(scale)[..., None]
    return q, scale, w.view(n, k).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(1000, 640), (33, 64), (96, 2048)])
@pytest.mark.parametrize("float_out", [True, False])
def test_a_q8_source_gives_the_bf16_kernels_bits(n: int, k: int, float_out: bool) -> None:
    """``PackedLinear.from_q8`` (the int8 blocks converted in the kernel) against the bf16 AMX
    kernel on their dequantized weight: equal at every M, one row tile, one block of two or
    many chunks, on 1 and 2 threads."""
    q, scale, w = q8_weights(n, k, n + k)
    ref = cpu_gemm.PackedLinear(w, None, float_out)
    q8 = cpu_gemm.PackedLinear.from_q8(w, q, scale, float_out)
    assert q8 is not None and q8.kernel == "q8_amx" and ref.kernel == "amx"
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in (1, 2, 15, 16, 17, 31, 32, 33, 64, 70, 257, 300):
                assert torch.equal(q8(x[:m]), ref(x[:m])), (t, m)
    finally:
        torch.set_num_threads(threads)


def test_a_q8_source_that_is_not_the_weight_is_refused() -> None:
    q, scale, w = q8_weights(64, 64, 1)
    other = w.clone()
    other[3, 5] = other[3, 5] * 2 + 1
    assert cpu_gemm.PackedLinear.from_q8(other, q, scale) is None
    assert cpu_gemm.PackedLinear.from_q8(w.float(), q, scale) is None  # bf16 weights only
    assert cpu_gemm.PackedLinear.from_q8(w, q, scale) is not None


def test_a_gguf_q8_head_runs_from_its_blocks(tmp_path: Path) -> None:
    """A dequantized bf16 GGUF model whose head is Q8_0: the head's GEMM reads the blocks, and
    its logits are the bf16 kernel's on the loaded weight."""
    test_gguf = pytest.importorskip("test_gguf")
    model = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    test_gguf.write_gguf(path, model, test_gguf.Q.Q8_0)
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    loaded.model.prepare()
    head = loaded.model.head
    assert isinstance(head, Gemm) and head.invariant is not None
    assert head.invariant.kernel == "q8_amx"
    assert not hasattr(loaded.model.lm_head, "q8_source")  # packed; the arrays let go
    ref = cpu_gemm.PackedLinear(loaded.model.lm_head.weight, None, float_out=True)
    x = torch.randn(5, loaded.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(head(x), ref(x))
