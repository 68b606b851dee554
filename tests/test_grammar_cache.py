"""engine/grammar.py's GrammarCache: compiled grammars and refusals kept per cache namespace,
bounded in bytes (a tenant sending huge distinct schemas cannot grow the server, nor learn by
timing which schemas another tenant sent)."""

from __future__ import annotations

import json

import pytest

from prefixcache.engine.grammar import GrammarCache
from prefixcache.engine.request import GrammarSpec


def spec(i: int, pad: int = 0) -> GrammarSpec:
    return GrammarSpec(
        "json_schema", json.dumps({"type": "object", "description": "x" * pad, "i": i})
    )


class Compiler:
    def __init__(self, size: int = 100, refuse: bool = False) -> None:
        self.size, self.refuse, self.calls = size, refuse, 0

    def __call__(self, s: GrammarSpec) -> str:
        self.calls += 1
        if self.refuse:
            raise ValueError(f"refused {s.digest[:6]}")
        return s.digest + "g" * self.size


def test_a_spec_compiles_once_per_namespace() -> None:
    cache, compile = GrammarCache(), Compiler()
    first = cache.get_or_compile(spec(1), compile, "tenant-a")
    assert cache.get_or_compile(spec(1), compile, "tenant-a") == first
    assert compile.calls == 1
    assert cache.lookup(spec(1), "tenant-b") is None  # another namespace sees no entry
    assert cache.get_or_compile(spec(1), compile, "tenant-b") == first
    assert compile.calls == 2


def test_a_refusal_is_kept_and_raised_again_without_compiling() -> None:
    cache, compile = GrammarCache(), Compiler(refuse=True)
    for _ in range(3):
        with pytest.raises(ValueError, match="refused"):
            cache.get_or_compile(spec(7), compile, "ns")
    assert compile.calls == 1
    with pytest.raises(ValueError, match="refused"):
        cache.lookup(spec(7), "ns")


def test_bytes_stay_under_the_bound_oldest_out() -> None:
    cache, compile = GrammarCache(max_bytes=64 * 1024), Compiler(size=4000)
    for i in range(200):
        cache.get_or_compile(spec(i), compile, "ns")
        assert cache.nbytes <= cache.max_bytes
    assert 8 <= len(cache) < 200
    assert cache.lookup(spec(199), "ns") is not None  # the newest kept
    assert cache.lookup(spec(0), "ns") is None  # the oldest gone
    cache.lookup(spec(199 - len(cache) + 1), "ns")  # touched: now the newest
    cache.get_or_compile(spec(1000), compile, "ns")
    assert cache.lookup(spec(199 - len(cache) + 1), "ns") is not None


def test_an_entry_over_an_eighth_of_the_bound_is_not_kept() -> None:
    cache, compile = GrammarCache(max_bytes=64 * 1024), Compiler(size=9000)
    cache.get_or_compile(spec(1), compile, "ns")
    cache.get_or_compile(spec(1), compile, "ns")
    assert compile.calls == 2 and len(cache) == 0 and cache.nbytes == 0
