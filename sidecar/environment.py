"""The ``PREFIXCACHE_*`` environment variables the sidecar reads, read here only, once per
command (docs/sidecar.md lists them; the engine reads its own, the SDK its own).

A variable set to the empty string counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SECRET = "PREFIXCACHE_SECRET"
UPSTREAM_API_KEY = "PREFIXCACHE_UPSTREAM_API_KEY"


@dataclass(frozen=True, slots=True)
class SidecarEnvironment:
    # `serve`: the secret cache namespaces are derived from, when no --secret-file is given.
    secret: bytes | None = None
    # `route`: the default of --upstream-api-key, the bearer key sent to the upstreams.
    upstream_api_key: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> SidecarEnvironment:
        secret = environ.get(SECRET) or None
        return cls(
            secret=secret.encode() if secret is not None else None,
            upstream_api_key=environ.get(UPSTREAM_API_KEY) or None,
        )
