"""The OpenAI-compatible HTTP sidecar over the embedded engine (``prefixcache serve``).

``create_app(engine, settings)`` builds the Starlette app; docs/sidecar.md describes the wire.
"""

from .app import SidecarSettings, create_app
from .tenancy import KeyStore

__all__ = ["KeyStore", "SidecarSettings", "create_app"]
