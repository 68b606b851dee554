"""An engine asked to be batch-invariant says where it cannot be: the torch reference
attention (chosen, or fallen back to for a shape the CPU kernels lack), projections on a GEMM
that is not the invariant kernel. Silent before: greedy tokens could flip between cached and
uncached runs with no word of why."""

from __future__ import annotations

import logging

import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels import cpu_gemm
from prefixcache.engine.model.loader import load_model


def engine_of(dtype: str, **overrides: object) -> LLMEngine:
    loaded = load_model("demo", dtype=dtype, device="cpu")
    config = EngineConfig(model="demo", dtype=dtype, device="cpu", num_blocks=64, **overrides)
    return LLMEngine(config, loaded)


def test_the_cpu_kernels_leave_no_gap(caplog: pytest.LogCaptureFixture) -> None:
    if not cpu_gemm.available():
        pytest.skip("the invariant GEMM does not load here")
    with caplog.at_level(logging.WARNING, logger="prefixcache.engine"):
        engine = engine_of("float32")
    assert engine.runner.invariance_gaps == []
    assert "batch invariance is off" not in caplog.text


def test_the_torch_reference_is_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixcache.engine"):
        engine = engine_of("float32", attention_backend="torch")
    (gap, *_) = engine.runner.invariance_gaps
    assert "'torch'" in gap and "head dim 64" in gap and "lack" not in gap
    assert "batch invariance is off for attention" in caplog.text


def test_a_dtype_the_kernels_lack_is_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixcache.engine"):
        engine = engine_of("float16")
    gaps = engine.runner.invariance_gaps
    assert any("float16" in g and "lack this shape" in g for g in gaps)  # the cpu one fell back
    assert any("projections" in g for g in gaps)
    assert "float16" in caplog.text


def test_asking_for_no_invariance_warns_of_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixcache.engine"):
        engine = engine_of("float32", attention_backend="torch", batch_invariant=False)
    assert engine.runner.invariance_gaps == []
    assert "batch invariance is off" not in caplog.text
