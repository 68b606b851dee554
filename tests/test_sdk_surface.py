"""What the SDK offers its users: every name the docs use is importable from
``prefixcache.sdk``, and the package says it is typed (PEP 561's ``py.typed``)."""

from __future__ import annotations

import builtins
import importlib.resources
import re
import tomllib
from pathlib import Path

import pytest

import prefixcache.sdk

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["docs/sdk.md", "docs/prompt-layout.md", "README.md"]
# A CapWords name at the start of a code span, then a call, an attribute or the span's end
# (not a header such as `Authorization: Bearer` or `Retry-After`).
_NAME = re.compile(r"`([A-Z]\w*[a-z]\w*)(?=[(.`])")
_IMPORT = re.compile(r"from prefixcache\.sdk import ([\w, ]+)")


def _documented_names(doc: str) -> set[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    names = set(_NAME.findall(text))
    for imported in _IMPORT.findall(text):
        names |= {name.strip() for name in imported.split(",") if name.strip()}
    return {name for name in names if not hasattr(builtins, name)}  # None, ValueError


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_docs_use_is_exported(doc: str) -> None:
    names = _documented_names(doc)
    assert names, f"no SDK names found in {doc}: the pattern is stale"
    missing = sorted(name for name in names if name not in prefixcache.sdk.__all__)
    assert not missing, f"{doc} names these, prefixcache.sdk does not export them: {missing}"


def test_every_exported_name_exists() -> None:
    assert [n for n in prefixcache.sdk.__all__ if not hasattr(prefixcache.sdk, n)] == []


def test_the_package_is_marked_typed() -> None:
    assert importlib.resources.files("prefixcache.sdk").joinpath("py.typed").is_file()


def test_the_wheel_declares_the_typed_marker() -> None:
    """The installed check above reads the source folder in an editable install; what the
    wheel ships is package-data (tests/test_wheel.py builds one and compares its files)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_data = config["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data.get("prefixcache.sdk", [])
