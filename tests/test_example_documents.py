"""The examples' document is exact and can be checked (issue 30, item 4).

examples/documents/apache-license-2.0.txt is the Apache License 2.0 byte for byte as an
installed dependency of ``prefixcache[serve]`` ships it: prometheus_client's
``*.dist-info/licenses/LICENSE`` (safetensors' is the same file), sha256 below. A RAG example
must quote its source exactly; the old document had been typed from memory.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "examples" / "documents" / "apache-license-2.0.txt"
SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"
SOURCES = ("prometheus_client", "safetensors")  # [serve] dependencies that ship this file


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def installed_copies() -> dict[str, bytes]:
    """Each source distribution's licence file, where it is installed."""
    copies = {}
    for name in SOURCES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for file in dist.files or []:
            if file.name == "LICENSE" and "dist-info" in str(file.parent):
                copies[f"{name}: {file}"] = Path(str(dist.locate_file(file))).read_bytes()
    return copies


def test_the_document_is_the_file_its_comment_names() -> None:
    assert sha256(DOCUMENT.read_bytes()) == SHA256


def test_the_document_still_matches_its_installed_source() -> None:
    copies = installed_copies()
    assert copies, f"none of {SOURCES} is installed with a LICENSE file"
    assert copies[next(k for k in copies if k.startswith("prometheus_client"))] == (
        DOCUMENT.read_bytes()
    ), "prometheus_client's LICENSE changed: replace the example document and its sha256"
    assert all(sha256(data) == SHA256 for data in copies.values()), {
        k: sha256(v) for k, v in copies.items()
    }


def test_the_example_names_the_same_source() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import rag_pipeline
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert rag_pipeline.DOCUMENT == DOCUMENT
    assert rag_pipeline.DOCUMENT_SHA256 == SHA256
    assert rag_pipeline.DOCUMENT_SOURCE[0] == SOURCES[0]
    sections = rag_pipeline.documents()
    assert len(sections) == len(rag_pipeline.SECTIONS)
    # the sections cover the whole file, in order, apart from the whitespace between them
    text = DOCUMENT.read_text(encoding="utf-8")
    assert "".join(text.split()) == "".join("".join(s.split()) for s in sections.values())
