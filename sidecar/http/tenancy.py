"""API keys, tenants and cache namespaces.

The namespace is derived on the server, never taken from the client:
``HMAC-SHA256(secret, tenant)``, then ``HMAC-SHA256(that, cache_salt)`` when a salt is given.
A salt can only narrow a tenant's namespace; two tenants never share one, so ``cached_tokens``
never reveals another tenant's prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import forbidden, unauthorized

DEFAULT_TENANT = "default"


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    admin: bool


@dataclass(slots=True, frozen=True)
class _Key:
    digest: bytes  # sha256 of the key: compared in constant time, same length for every key
    tenant: Tenant


class KeyStore:
    """Maps bearer keys to tenants. With no keys, everyone is the default admin tenant."""

    def __init__(self, keys: list[tuple[str, str, bool]] | None = None) -> None:
        self._keys = [
            _Key(hashlib.sha256(key.encode()).digest(), Tenant(tenant, admin))
            for key, tenant, admin in keys or []
        ]

    @classmethod
    def from_file(cls, path: str | Path) -> KeyStore:
        """Read ``{"keys": [{"key": "sk-...", "tenant": "acme", "admin": false}, ...]}``."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected {{'keys': [...]}} with at least one key")
        keys = []
        for i, entry in enumerate(entries):
            key, tenant = entry.get("key"), entry.get("tenant")
            if not isinstance(key, str) or len(key) < 8:
                raise ValueError(f"{path}: keys[{i}].key must be a string of >= 8 chars")
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"{path}: keys[{i}].tenant must be a non-empty string")
            keys.append((key, tenant, bool(entry.get("admin", False))))
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(
        self, authorization: str | None, how: str = "'Authorization: Bearer <key>'"
    ) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header; raises 401 when unknown
        (a missing key's message says ``how`` to send one)."""
        if not self._keys:
            return Tenant(DEFAULT_TENANT, admin=True)
        if not authorization or not authorization.startswith("Bearer "):
            raise unauthorized(f"Missing API key: send {how}")
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        found: Tenant | None = None
        for key in self._keys:  # no early exit: the time taken does not depend on which key
            if hmac.compare_digest(key.digest, digest):
                found = key.tenant
        if found is None:
            raise unauthorized("Invalid API key")
        return found

    def authenticate_admin(self, authorization: str | None) -> Tenant:
        tenant = self.authenticate(authorization)
        if not tenant.admin:
            raise forbidden("This endpoint needs an admin API key")
        return tenant


def cache_namespace(secret: bytes, tenant: str, salt: str | None = None) -> str:
    """HMAC(secret, tenant), narrowed by HMAC(that, salt). Hex, so it is a plain str."""
    key = hmac.new(secret, tenant.encode(), hashlib.sha256).digest()
    if salt:
        key = hmac.new(key, salt.encode(), hashlib.sha256).digest()
    return key.hex()


def cache_file_key(secret: bytes) -> bytes:
    """The HMAC key of pinned-prefix files: only a server with this secret signs or loads them."""
    return hmac.new(secret, b"prefixcache: pinned-prefix files", hashlib.sha256).digest()
