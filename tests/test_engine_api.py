"""The sidecar–engine seam: ``EngineAPI`` is what the sidecar may call, and every engine the
sidecar is given (AsyncEngine, the tests' FakeEngine) provides all of it, in the same shape."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sidecar_fake_engine import FakeEngine, FakeTokenizer

from prefixcache.engine.api import EngineAPI, TokenizerAPI
from prefixcache.engine.serving.async_engine import AsyncEngine
from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sdk.cache_stats import CacheStats, TierBlockStats, TokenizerPieceStats

SIDECAR = Path(__file__).resolve().parent.parent / "sidecar"


def members(protocol: type) -> dict[str, Any]:
    return {n: v for n, v in vars(protocol).items() if not n.startswith("_")}


def kind(value: Any) -> str:
    if isinstance(value, property):
        return "property"
    returns = str(getattr(value, "__annotations__", {}).get("return", ""))
    if inspect.isasyncgenfunction(value) or returns.startswith("AsyncGenerator"):
        return "async generator"
    if inspect.iscoroutinefunction(value):
        return "coroutine"
    if callable(value):
        return "method"
    return "attribute"


def parameters(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def check_implements(protocol: type, cls: type, instance: Any = None) -> None:
    """Every member exists with the protocol's kind and parameters. An instance attribute may
    stand for a property (the fake's plain fields)."""
    for name, declared in members(protocol).items():
        want = kind(declared)
        if want == "property":
            if instance is not None:
                assert hasattr(instance, name), f"{cls.__name__}.{name} is missing"
            else:
                assert kind(inspect.getattr_static(cls, name)) in ("property", "attribute"), name
            continue
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__}.{name} is missing"
        got_kind = kind(got)
        assert got_kind == want, f"{cls.__name__}.{name} is a {got_kind}, not a {want}"
        assert parameters(got) == parameters(declared), f"{cls.__name__}.{name} signature"


def _static_conformance(real: AsyncEngine, fake: FakeEngine) -> tuple[EngineAPI, EngineAPI]:
    """Never called: a type checker (mypy, pyright) proves both are EngineAPIs here."""
    return real, fake


def test_engine_api_lists_what_the_sidecar_uses() -> None:
    assert set(members(EngineAPI)) == {
        "start",
        "shutdown",
        "is_ready",
        "error",
        "model_name",
        "max_model_len",
        "tokenizer",
        "sampling_defaults",
        "cache_identity",
        "output_identity",
        "dtype",
        "registry",
        "num_waiting",
        "generate",
        "abort",
        "abort_all",
        "warm",
        "unpin",
        "evict_all",
        "cache_stats",
        "cache_tree",
        "cache_activity",
        "save_pinned",
        "load_pinned",
    }


def test_async_engine_implements_engine_api() -> None:
    check_implements(EngineAPI, AsyncEngine)


def test_fake_engine_implements_engine_api() -> None:
    check_implements(EngineAPI, FakeEngine, FakeEngine())


def test_tokenizers_implement_tokenizer_api() -> None:
    check_implements(TokenizerAPI, Tokenizer)
    check_implements(TokenizerAPI, FakeTokenizer, FakeTokenizer())


def test_a_missing_member_is_caught() -> None:
    class Partial(FakeEngine):
        save_pinned = None  # type: ignore[assignment]

    with pytest.raises(AssertionError, match="save_pinned"):
        check_implements(EngineAPI, Partial, Partial())


def test_sidecar_imports_only_the_seam_from_the_engine() -> None:
    """Only cli/serve_command.py (which builds the AsyncEngine) may import more of the engine."""
    allowed = {"prefixcache.engine.api", "prefixcache.engine.request"}
    allowed.add("prefixcache.engine.text.tokenizer")  # ChatTemplateError, raised by the tokenizer
    allowed.add("prefixcache.engine.serving.errors")  # the engines' one error hierarchy
    allowed.add("prefixcache.engine.grammar")  # a refused schema is a 400 before a stream
    for path in sorted(SIDECAR.rglob("*.py")):
        if path.relative_to(SIDECAR).as_posix() == "cli/serve_command.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "prefixcache.engine"
            ):
                assert node.module in allowed, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                value = node.value
                assert not (isinstance(value, ast.Attribute) and value.attr == "engine"), (
                    f"{path.name} reaches through the engine (engine.engine)"
                )
        assert "getattr(self.engine" not in path.read_text(), path.name


def test_the_seam_modules_are_torch_free() -> None:
    code = (
        "import sys, prefixcache.engine.api, prefixcache.engine.serving.errors, "
        "prefixcache.sdk.cache_stats; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_stats_wire_shape() -> None:
    stats = msgspec.json.decode(msgspec.json.encode(CacheStats()))
    assert stats == {
        "block_size": 0,
        "kv_cache_dtype": "",
        "blocks": {"total": 0, "free": 0, "cached_idle": 0, "in_use": 0, "pinned": 0},
        "tokens": {"queries": 0, "hits": 0, "inserted": 0, "evicted": 0},
        "hit_rate": 0.0,
    }
    pieces = CacheStats(tokenizer_pieces=TokenizerPieceStats(1, 2, 3, 4))
    wire = msgspec.json.decode(msgspec.json.encode(pieces))
    assert wire["tokenizer_pieces"] == {"hits": 1, "misses": 2, "entries": 3, "chars": 4}
    assert msgspec.json.decode(msgspec.json.encode(pieces), type=CacheStats) == pieces


def test_cache_stats_carry_the_tier_only_where_there_is_one() -> None:
    assert "tier" not in msgspec.json.decode(msgspec.json.encode(CacheStats()))
    stats = CacheStats(tier=TierBlockStats("disk", 100, 7, 100 * 4096, 7 * 4096))
    wire = msgspec.json.decode(msgspec.json.encode(stats))
    assert wire["tier"] == {
        "kind": "disk",
        "total": 100,
        "used": 7,
        "bytes_total": 409600,
        "bytes_used": 28672,
    }
    assert msgspec.json.decode(msgspec.json.encode(stats), type=CacheStats) == stats
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=CacheStats) == stats  # pipe
