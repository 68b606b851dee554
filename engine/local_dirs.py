"""Where prefixcache keeps files on this machine: ``$PREFIXCACHE_HOME``, else
``~/.cache/prefixcache`` (fetched models, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    home = os.environ.get("PREFIXCACHE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "prefixcache"
