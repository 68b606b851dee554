"""transformers' reference outputs for the real-model fidelity tests, computed once per input
and kept in ``$PREFIXCACHE_HOME/test-references``.

A reference (prompt ids, greedy continuations) depends only on the model file, the prompts, the
generation settings and the versions of transformers, torch and gguf; the key hashes all of
them (the file by its full sha256), so any change computes it afresh. Computing one takes
transformers minutes on a 2-vCPU box; what the tests check (our engine) runs every time.
``PREFIXCACHE_FRESH_REFERENCES=1`` ignores what is kept and recomputes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from prefixcache.engine import settings

FORMAT = 1
FRESH_ENV = "PREFIXCACHE_FRESH_REFERENCES"
Reference = tuple[list[list[int]], list[list[int]]]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def reference_key(model_file: Path, inputs: object) -> str:
    h = hashlib.sha256()
    versions = {lib: version(lib) for lib in ("transformers", "torch", "gguf", "tokenizers")}
    h.update(json.dumps([FORMAT, versions, inputs], sort_keys=True).encode())
    h.update(file_sha256(model_file).encode())
    return h.hexdigest()[:32]


def memoized(
    name: str, model_file: Path, inputs: object, compute: Callable[[], Reference]
) -> Reference:
    """``compute()`` for ``inputs`` on ``model_file``, or what it returned last time."""
    folder = settings.home_dir() / "test-references"
    path = folder / f"{name}-{reference_key(model_file, inputs)}.json"
    if path.exists() and os.environ.get(FRESH_ENV) != "1":
        prompts, answers = json.loads(path.read_text(encoding="utf-8"))
        return prompts, answers
    prompts, answers = compute()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps([prompts, answers]), encoding="utf-8")
    tmp.replace(path)
    return prompts, answers
