"""The OpenAI-compatible HTTP sidecar: engine mode over the embedded engine (server/,
``prefixcache serve``) and upstream mode in front of other servers (router/,
``prefixcache route``), sharing http/, wire/ and chat/; cli/ holds both commands.

``create_app(engine, settings)`` builds the engine-mode Starlette app; docs/sidecar.md
describes the wire.
"""

from .http.tenancy import KeyStore
from .server.app import SidecarSettings, create_app

__all__ = ["KeyStore", "SidecarSettings", "create_app"]
