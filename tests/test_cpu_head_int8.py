"""The integer LM head (``kernels/cpu_head_int8.cpp``, ``$PREFIXCACHE_INT8_HEAD=1``): a row's
logits are a function of that row alone (at every row count, so across its VNNI and AMX
paths, and on 1 or 2 threads); nearer the exact ``q * scale . x`` than the bf16 kernels; a
row of NaN, infinity or zeros harms no other row; a GGUF model asked for it serves with it,
batched runs equal to lone ones. Skipped where the CPU has no AVX512_VNNI (or the kernel
cannot load)."""

from __future__ import annotations

import hashlib
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
from prefixcache.engine.kernels import cpu_gemm, cpu_head_int8, gemm_blocks

pytestmark = pytest.mark.skipif(
    not cpu_head_int8.available(), reason="no AVX512_VNNI here (or the kernel cannot load)"
)


def q8_source(n: int, k: int, seed: int) -> tuple[gemm_blocks.BlockSource, torch.Tensor]:
    """Q8_0-like blocks (int8, an fp16-valued scale per 32 k) and their bf16 weight."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    scale = (rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
    return (q, scale, None), gemm_blocks.block_weights(q, scale, None)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows like a final norm's output: normal values, a few outlier dimensions 30x larger,
    some blocks 2^-12 smaller than the rest (the per-block exponent), bf16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[: max(1, k // 64)]] *= 30.0
    quiet = torch.rand(m, k // 32, generator=gen) < 0.2
    x.view(m, k // 32, 32)[quiet] *= 2.0**-12
    return x.to(torch.bfloat16)


def exact(x: torch.Tensor, source: gemm_blocks.BlockSource) -> torch.Tensor:
    q, scale, _ = source
    n, k = q.shape
    w = (
        torch.from_numpy(q).double().view(n, k // 32, 32)
        * torch.from_numpy(scale).double()[..., None]
    )
    return x.double() @ w.view(n, k).T


def head(source: gemm_blocks.BlockSource, w: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = True) -> cpu_gemm.PackedLinear:  # fmt: skip
    lin = cpu_head_int8.head_from_blocks(w, bias, source, float_out)
    assert lin is not None and lin.kernel == "q8_int"
    return lin


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    blocks=st.integers(1, 24),
    n=st.integers(1, 200),
    m=st.integers(2, 40),
    threads=st.sampled_from([1, 2]),
)
def test_rows_do_not_depend_on_their_batch(
    seed: int, blocks: int, n: int, m: int, threads: int
) -> None:
    """Each row computed alone (the VNNI path) equals that row in calls of every size (AMX
    from 9 rows where it runs), on one thread or two."""
    k = 32 * blocks
    source, w = q8_source(n, k, seed)
    lin = head(source, w)
    x = activations(m, k, seed)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = lin(x)
        for i in range(m):
            assert torch.equal(lin(x[i : i + 1]), full[i : i + 1]), i
        start = seed % m
        assert torch.equal(lin(x[start:]), full[start:])
    finally:
        torch.set_num_threads(saved)


def test_nearer_the_exact_product_than_the_bf16_kernels() -> None:
    """Against float64 on the exact weights: the bf16 kernels round every weight to 8
    significant bits; the integer head rounds only activations smaller than 2^-6 of their
    block's largest (at 2^-15 of it) and the fp32 sums."""
    source, w = q8_source(1000, 640, 5)
    x = activations(64, 640, 6)
    ref = exact(x, source)
    ints = (head(source, w)(x).double() - ref).abs()
    bf16 = cpu_gemm.PackedLinear.from_blocks(w, None, source, True)
    if bf16 is None:
        bf16 = cpu_gemm.PackedLinear(w, None, True)
    floats = (bf16(x).double() - ref).abs()
    assert ints.mean() < floats.mean() / 10, (ints.mean(), floats.mean())
    assert ints.max() < floats.max() / 5, (ints.max(), floats.max())
    # The bound by construction: each activation off by at most 2^-14 of its block's
    # largest, then a rounding to fp32 per block's sum and per accumulation.
    k = w.shape[1]
    top = x.double().abs().view(-1, k // 32, 32).amax(dim=2).repeat_interleave(32, dim=1)
    weights = exact_abs(source)
    rounding = (top * 2.0**-14) @ weights.T
    accumulation = (k // 32 + 2) * 2.0**-24 * (x.double().abs() @ weights.T)
    assert (ints <= rounding + accumulation).all()


def exact_abs(source: gemm_blocks.BlockSource) -> torch.Tensor:
    q, scale, _ = source
    n, k = q.shape
    w = torch.from_numpy(q).double().abs().view(n, k // 32, 32)
    return (w * torch.from_numpy(scale).double().abs()[..., None]).view(n, k)


def test_tiny_and_huge_activations_keep_their_accuracy() -> None:
    """A row accumulates in units of its largest block's exponent: activations of 2^-126
    (whose per-block factor scale * 2^(e - 13) alone would be subnormal) keep fp32's
    accuracy, and one near bf16's largest over a block of zero weights and a large scale
    (a factor of inf alone, times a sum of 0) gives the finite exact logits."""
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, size=(4, 32), dtype=np.int8)
    scale = np.full((4, 1), 0.004, dtype=np.float32)
    lin = head((q, scale, None), gemm_blocks.block_weights(q, scale, None))
    signs = torch.from_numpy(rng.choice([-1.0, 1.0], size=(1, 32)))
    for power in (-100, -115, -120, -126):
        x = (signs * 2.0**power).to(torch.bfloat16)
        ref = exact(x, (q, scale, None))
        assert ((lin(x).double() - ref).abs() <= 1e-5 * ref.abs()).all(), power
    q2 = rng.integers(-128, 128, size=(2, 64), dtype=np.int8)
    q2[:, :32] = 0
    scale2 = np.array([[32768.0, 0.01]] * 2, dtype=np.float32)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32:] = 3.0e38, 1.0
    x = x.to(torch.bfloat16)
    out = head((q2, scale2, None), gemm_blocks.block_weights(q2, scale2, None))(x)
    torch.testing.assert_close(out.double(), exact(x, (q2, scale2, None)), rtol=1e-6, atol=0)


def test_non_finite_and_zero_rows_stay_in_their_row() -> None:
    source, w = q8_source(100, 96, 1)
    lin = head(source, w)
    x = activations(12, 96, 2)
    x[3] = 0.0
    x[5, 40] = float("nan")
    x[9, 7] = float("inf")
    out = lin(x)
    assert torch.equal(out[3], torch.zeros(100))
    assert out[5].isnan().all() and out[9].isnan().all()
    for i in (0, 1, 2, 4, 6, 7, 8, 10, 11):
        assert torch.equal(out[i], lin(x[i : i + 1])[0]), i
        assert out[i].isfinite().all()


def test_bias_and_bf16_outputs() -> None:
    """``+ bias`` then one rounding to bf16 where ``float_out`` is off: the fp32 outputs'
    rounding, at every row count; N not a multiple of 32 (a padded group)."""
    source, w = q8_source(77, 128, 3)
    bias = torch.randn(77, generator=torch.Generator().manual_seed(3))
    f32, b16 = head(source, w, bias), head(source, w, bias, float_out=False)
    without = head(source, w)
    x = activations(20, 128, 4)
    for m in (1, 3, 20):
        assert torch.equal(f32(x[:m]), without(x[:m]) + bias)
        assert torch.equal(b16(x[:m]), f32(x[:m]).to(torch.bfloat16))


def test_other_forms_are_refused() -> None:
    source, w = q8_source(64, 64, 1)
    q, scale, _ = source
    assert cpu_head_int8.head_from_blocks(w.float(), None, source) is None
    assert cpu_head_int8.head_from_blocks(w, None, (q, scale, scale)) is None  # a min
    per16 = np.repeat(scale, 2, axis=1)  # Q6_K's scale per 16 k
    assert cpu_head_int8.head_from_blocks(w, None, (q, per16, None)) is None
    other = w.clone()
    other[3, 5] = other[3, 5] * 2 + 1
    assert cpu_head_int8.head_from_blocks(other, None, source) is None


# The same call with AMX off, in a child process (the choice is made once per process).
_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_cpu_head_int8 import activations, head, q8_source
source, w = q8_source(300, 320, 9)
torch.save(head(source, w)(activations(40, 320, 9)), sys.argv[1])
"""


def test_the_amx_path_gives_the_vnni_bits(tmp_path: Path) -> None:
    """A 40-row call with AMX-INT8 on and with ``$PREFIXCACHE_CPU_AMX=0`` (VNNI only)."""
    from prefixcache.engine.kernels import cpu_library

    if not cpu_library.amx_int8_wanted():
        pytest.skip("no AMX-INT8 here: every call runs VNNI")
    source, w = q8_source(300, 320, 9)
    amx = head(source, w)(activations(40, 320, 9))
    saved = tmp_path / "vnni.pt"
    env = {**os.environ, engine_settings.CPU_AMX_ENV: "0"}
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(saved), str(Path(__file__).parent)],
        env=env, check=True, timeout=300,
    )  # fmt: skip
    assert torch.equal(torch.load(saved), amx)


def test_a_gguf_model_asked_for_it_serves_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$PREFIXCACHE_INT8_HEAD=1``: a Q8_0 GGUF model at bf16 takes the integer head (the
    default keeps the bf16 kernels), its logits near the fp32 model's, and an engine's batched
    greedy run gives each request's lone tokens and logprobs."""
    test_gguf = pytest.importorskip("test_gguf")
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.request import EngineRequest, SamplingParams
    from prefixcache.engine.serving.engine_core import ready_message

    model = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    test_gguf.write_gguf(path, model, test_gguf.Q.Q8_0)
    default = load_model(str(path), dtype="bfloat16", device="cpu")
    default.model.prepare()
    assert default.model.head.invariant.kernel != "q8_int"
    assert default.output_variant == ""
    monkeypatch.setenv(engine_settings.INT8_HEAD_ENV, "1")
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    loaded.model.prepare()
    assert loaded.model.head.invariant.kernel == "q8_int"
    assert loaded.output_variant == "head:q8_int"  # it changes the system_fingerprint
    reference = load_model(str(path), dtype="float32", device="cpu")
    ids = list(range(3, 40))
    torch.testing.assert_close(
        test_gguf.run_logits(loaded, ids), test_gguf.run_logits(reference, ids), atol=0.3, rtol=0
    )
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="bfloat16", device="cpu", num_blocks=128)
    )
    try:
        assert engine.runner.model.head.invariant.kernel == "q8_int"
        ready = ready_message(engine, with_metrics=False)
        assert ready.cache_identity == LLMEngine.cache_identity(loaded)  # the same KV
        assert (
            ready.output_identity == hashlib.sha256(ready.cache_identity + b"|head:q8_int").digest()
        )
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 1000, size=int(rng.integers(5, 60))).tolist() for _ in range(6)]
        params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
        alone = [engine.generate([EngineRequest(f"a{i}", p, params)])[0] for i, p in enumerate(prompts)]  # fmt: skip
        engine.evict_all()
        together = engine.generate(
            [EngineRequest(f"b{i}", p, params) for i, p in enumerate(prompts)]
        )
        for a, b in zip(alone, together, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs
    finally:
        engine.close()
