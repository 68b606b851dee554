"""``SidecarSettings``: how the engine-mode app is configured (the CLI fills it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..http.tenancy import KeyStore


@dataclass(slots=True)
class SidecarSettings:
    keys: KeyStore = field(default_factory=KeyStore)
    secret: bytes = field(default_factory=lambda: os.urandom(32))  # namespace HMAC key
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting: int = 1024  # admitted requests without output yet; over it: 429
    retry_after_s: int = 1
    manage_engine: bool = True  # start the engine on app start-up, shut it down at the end
    # Further names the served model answers to (vLLM-style clients send the --model path).
    model_aliases: tuple[str, ...] = ()
    use_generation_config: bool = True  # unset sampling fields take the model's values
    cache_dir: Path | None = None  # where /v1/cache/save and /load keep pinned-prefix files
    load_on_start: tuple[str, ...] = ()  # files in cache_dir loaded once the engine is up
    tool_call_parser: str | None = None  # hermes / llama3_json / mistral; None: from the template
