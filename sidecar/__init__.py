"""The OpenAI-compatible HTTP sidecar: engine mode over the embedded engine (server/,
``prefixcache serve``) and upstream mode in front of other servers (router/,
``prefixcache route``), sharing http/, wire/ and chat/; cli/ holds both commands.

``create_app(engine, settings)`` builds the engine-mode Starlette app; docs/sidecar.md
describes the wire. The names below load on first use, so that the ``prefixcache`` command
of an SDK-only install (no ``[serve]`` extras) can say what is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .http.tenancy import KeyStore
    from .server.app import SidecarSettings, create_app

__all__ = ["KeyStore", "SidecarSettings", "create_app"]
_HOMES = {
    "KeyStore": ".http.tenancy",
    "SidecarSettings": ".server.app",
    "create_app": ".server.app",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
