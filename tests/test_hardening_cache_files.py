"""Regression tests of issue 18's cache-file defect: files are authenticated (HMAC keyed from
the server secret), non-finite pages are refused, every refused file is a 4xx. Each test
failed on the code before the fix (checksummed, not authenticated)."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import ServerLoop, demo_engine, serve
from safetensors import safe_open
from safetensors.torch import save_file

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.prefix_store import PrefixStoreError
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.sidecar.http.tenancy import cache_file_key
from prefixcache.sidecar.server.app import SidecarSettings, create_app

KEY = cache_file_key(b"the server secret, 32 bytes long")


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=128), loaded
    )


def saved_file(loaded, path: Path, key: bytes = KEY) -> Path:
    engine = make_engine(loaded)
    prefix = [random.Random(1).randrange(3, loaded.config.vocab_size) for _ in range(48)]
    engine.generate([EngineRequest("p", prefix, SamplingParams(1, ignore_eos=True))])
    assert engine.pin(prefix, "") == 3
    engine.save_pinned(path, key)
    return path


def resigned(path: Path, out: Path, edit: Any) -> Path:
    """Edit a file and re-sign it as an attacker without the key can: the public sha256
    checksum of the old format, and an HMAC under a guessed key."""
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    metadata.pop("checksum", None)
    metadata.pop("hmac", None)
    edit(metadata, tensors)

    def digest(h: Any) -> str:
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
            if t.numel():
                h.update(t.view(torch.uint8).numpy())
        return h.hexdigest()

    body = json.dumps(metadata, sort_keys=True).encode()
    metadata["hmac"] = digest(hmac.new(b"guessed", body, hashlib.sha256))
    metadata["checksum"] = digest(hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()))
    save_file(tensors, str(out), metadata=metadata)
    return out


def drop_identity(metadata: dict, tensors: dict) -> None:
    metadata.pop("identity")


def nan_pages(metadata: dict, tensors: dict) -> None:
    tensors["kv.0"][0, 0, 0, 0, 0] = float("nan")


@pytest.mark.parametrize("edit", [drop_identity, nan_pages], ids=["no identity", "NaN pages"])
def test_a_re_signed_file_is_refused(demo_loaded, tmp_path: Path, edit: Any) -> None:
    path = saved_file(demo_loaded, tmp_path / "p.safetensors")
    forged = resigned(path, tmp_path / "forged.safetensors", edit)
    engine = make_engine(demo_loaded)
    with pytest.raises(PrefixStoreError):
        engine.load_pinned(forged, KEY)
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.stats().num_pinned_blocks == 0


def test_a_file_signed_with_another_secret_is_refused(demo_loaded, tmp_path: Path) -> None:
    path = saved_file(demo_loaded, tmp_path / "p.safetensors", key=cache_file_key(b"x" * 32))
    with pytest.raises(PrefixStoreError, match="secret"):
        make_engine(demo_loaded).load_pinned(path, KEY)
    assert (
        make_engine(demo_loaded).load_pinned(path, cache_file_key(b"x" * 32)).restored_blocks == 3
    )


def test_non_finite_pages_are_refused_even_when_signed_with_the_key(
    demo_loaded, tmp_path: Path
) -> None:
    from prefixcache.engine.memory import prefix_store

    path = saved_file(demo_loaded, tmp_path / "p.safetensors")
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    metadata.pop("hmac")
    tensors["kv.1"][1, 1, 2] = float("inf")
    metadata["hmac"] = prefix_store.sign(KEY, metadata, tensors)
    save_file(tensors, str(tmp_path / "inf.safetensors"), metadata=metadata)
    with pytest.raises(PrefixStoreError, match="non-finite"):
        make_engine(demo_loaded).load_pinned(tmp_path / "inf.safetensors", KEY)


@pytest.mark.timeout(180)
def test_every_refused_file_is_a_4xx(server_loop: ServerLoop, demo_loaded, tmp_path: Path) -> None:
    secret = b"the server secret, 32 bytes long"
    settings = SidecarSettings(secret=secret, cache_dir=tmp_path)
    server = serve(server_loop, create_app(demo_engine(demo_loaded), settings))
    try:
        warm = {"messages": [{"role": "system", "content": "A system prompt " * 8}], "pin": True}
        assert httpx.post(f"{server.url}/cache/warm", json=warm, timeout=60).status_code == 200
        saved = httpx.post(f"{server.url}/cache/save", json={"name": "good"}, timeout=60)
        assert saved.status_code == 200, saved.text
        good = tmp_path / "good.safetensors"
        resigned(good, tmp_path / "noid.safetensors", drop_identity)
        resigned(good, tmp_path / "nan.safetensors", nan_pages)
        for name in ("noid", "nan"):
            response = httpx.post(f"{server.url}/cache/load", json={"name": name}, timeout=60)
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["code"] == "cache_file_refused"
        ok = httpx.post(f"{server.url}/cache/load", json={"name": "good"}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    finally:
        server.stop()
