"""Tenants never share cache blocks; keys are checked; the salt only narrows a namespace."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import httpx
import pytest
from conftest import KEYS, Server

from prefixcache.sidecar.http.errors import APIError
from prefixcache.sidecar.http.tenancy import KeyStore, cache_namespace

PROMPT = [
    {"role": "system", "content": "You are the archive assistant of tenant-neutral docs. " * 6},
    {"role": "user", "content": "Where is the contract from March?"},
]


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]['key']}"}


def cached(server: Server, who: str, salt: str | None = None) -> int:
    body = {"messages": PROMPT, "max_tokens": 2}
    if salt:
        body["cache_salt"] = salt
    response = httpx.post(
        f"{server.url}/chat/completions", json=body, headers=auth(who), timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenant_b_gets_nothing_from_tenant_a(tenant_server: Server) -> None:
    assert cached(tenant_server, "a") < 16  # only the template's opening could be shared
    assert cached(tenant_server, "a") >= 100  # A's own second request hits
    assert cached(tenant_server, "b") == 0  # same prompt, other tenant: no block shared
    assert cached(tenant_server, "b") >= 100  # B hits its own blocks


def test_cache_salt_narrows_a_tenants_namespace(tenant_server: Server) -> None:
    cached(tenant_server, "a")
    assert cached(tenant_server, "a", salt="user-1") == 0
    assert cached(tenant_server, "a", salt="user-1") >= 100
    assert cached(tenant_server, "a", salt="user-2") == 0
    assert cached(tenant_server, "b", salt="user-1") == 0  # a salt never reaches across tenants


def test_keys_are_required_and_admin_is_separate(tenant_server: Server) -> None:
    root = tenant_server.root
    missing = httpx.get(f"{root}/v1/models")
    wrong = httpx.get(f"{root}/v1/models", headers={"Authorization": "Bearer sk-wrong-key-123"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{root}/v1/models", headers=auth("a")).status_code == 200
    stats = httpx.get(f"{root}/v1/cache/stats", headers=auth("a"))
    assert stats.status_code == 403 and stats.json()["error"]["type"] == "permission_error"
    evict = httpx.post(f"{root}/v1/cache/evict", json={}, headers=auth("b"))
    assert evict.status_code == 403
    assert httpx.get(f"{root}/v1/cache/stats", headers=auth("admin")).status_code == 200
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(f"{root}/health").status_code == 200
    assert httpx.get(f"{root}/metrics").status_code == 200


def test_only_an_admin_key_resets_the_prefix_cache(tenant_server: Server) -> None:
    """vLLM's /reset_prefix_cache needs no key there; here it drops every tenant's blocks,
    so it is a cache admin route: a tenant's key cannot wipe another tenant's cache."""
    url = f"{tenant_server.root}/reset_prefix_cache"
    cached(tenant_server, "a", salt="reset")
    assert cached(tenant_server, "a", salt="reset") >= 100
    assert httpx.post(url).status_code == 401
    for who in ("a", "b"):
        refused = httpx.post(url, headers=auth(who))
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert cached(tenant_server, "a", salt="reset") >= 100  # nothing was dropped
    reset = httpx.post(url, headers=auth("admin"), timeout=60)
    assert reset.status_code == 200 and reset.json()["success"] is True, reset.text
    assert cached(tenant_server, "a", salt="reset") == 0


def test_namespace_is_an_hmac_chain() -> None:
    secret = b"s" * 32
    tenant_key = hmac.new(secret, b"acme", hashlib.sha256).digest()
    assert cache_namespace(secret, "acme") == tenant_key.hex()
    salted = hmac.new(tenant_key, b"u1", hashlib.sha256).hexdigest()
    assert cache_namespace(secret, "acme", "u1") == salted
    assert cache_namespace(secret, "acme") != cache_namespace(secret, "other")
    assert cache_namespace(secret, "acme") != cache_namespace(b"t" * 32, "acme")


def test_key_store(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-abcdefgh", "tenant": "t1", "admin": True}]}))
    store = KeyStore.from_file(path)
    assert store.enabled and store.authenticate("Bearer sk-abcdefgh").name == "t1"
    with pytest.raises(APIError) as info:
        store.authenticate("Basic sk-abcdefgh")
    assert info.value.status == 401
    assert KeyStore().authenticate(None).admin  # no keys configured: open, one tenant
    for bad in ({"keys": []}, {"keys": [{"key": "short", "tenant": "t"}]}, [1]):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            KeyStore.from_file(path)
