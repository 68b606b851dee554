"""The kept transformers references are recomputed whenever an input, the model file or the
setting asks for it, and reused otherwise."""

from __future__ import annotations

from pathlib import Path

import hf_reference
import pytest


def test_a_reference_is_kept_per_input_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(hf_reference.FRESH_ENV, raising=False)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights one")
    calls: list[int] = []

    def compute() -> hf_reference.Reference:
        calls.append(1)
        return [[1, 2, len(calls)]], [[3, len(calls)]]

    first = hf_reference.memoized("t", model, {"prompts": ["a"]}, compute)
    assert first == ([[1, 2, 1]], [[3, 1]]) and len(calls) == 1
    assert hf_reference.memoized("t", model, {"prompts": ["a"]}, compute) == first
    assert len(calls) == 1  # kept
    hf_reference.memoized("t", model, {"prompts": ["b"]}, compute)
    assert len(calls) == 2  # another input
    model.write_bytes(b"weights two")
    hf_reference.memoized("t", model, {"prompts": ["a"]}, compute)
    assert len(calls) == 3  # another file
    monkeypatch.setenv(hf_reference.FRESH_ENV, "1")
    assert hf_reference.memoized("t", model, {"prompts": ["a"]}, compute)[1] == [[3, 4]]
    assert len(calls) == 4  # asked to recompute
    assert not list((tmp_path / "home" / "test-references").glob("*.tmp"))
