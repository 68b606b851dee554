"""A GGUF file's header, parsed once: its metadata, its tensor table and its rebuilt tokenizer,
kept in ``$PREFIXCACHE_HOME/gguf-index`` and keyed by the file's identity.

The ``gguf`` package's reader builds a Python object for every element of every metadata
array, so opening a file with a large vocabulary costs seconds before a byte of weights is
read (Gemma 3's 262K tokens: 18.7 s on a 2-vCPU box), and rebuilding the tokenizer from that
metadata as long again. Both depend on the header alone. ``open_index(path)`` parses the
header with the reader on the first open and writes what the loader reads from it (msgpack,
atomically); later opens of the same file read that and map the tensors straight from the
file (numpy ``memmap``, each tensor's view in the dtype and shape the reader gave it).

A file's identity is its resolved path, device, inode, size and mtime, plus a hash of its
first and last 64 KiB, the ``gguf`` package's version and this module's format version: a
file rewritten in place, or read by another version of the reader, parses anew. A cache entry
that cannot be read is ignored and rewritten. At most ``MAX_ENTRIES`` entries are kept (the
oldest go first). Big-endian files are parsed every time (the reader byte-swaps them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .. import settings
from .tokenizer import Tokenizer, TokenizerError, TokenizerSpec

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

log = logging.getLogger("prefixcache.engine")

FORMAT_VERSION = 1
MAX_ENTRIES = 32
_EDGE = 64 * 1024  # bytes hashed at each end of the file


class TensorEntry(msgspec.Struct, array_like=True):
    """One tensor of the table: where its bytes are and how the reader viewed them."""

    name: str
    type_code: int  # gguf.GGMLQuantizationType value
    dims: list[int]  # GGUF order (ne0 first), as ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    view_dtype: str  # numpy dtype string of the reader's view
    view_shape: list[int]


class GGUFIndex(msgspec.Struct):
    """What the loader reads from a GGUF file's header."""

    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    data_offset: int  # where the tensor data begins
    tokenizer: TokenizerSpec | None  # None: the metadata's tokenizer could not be built


def file_identity(path: Path) -> str:
    """The cache key of ``path`` as it is now (see the module docstring)."""
    from importlib.metadata import version

    real = path.resolve()
    st = real.stat()
    h = hashlib.sha256()
    h.update(f"{FORMAT_VERSION}|{version('gguf')}|{real}|{st.st_dev}|{st.st_ino}".encode())
    h.update(f"|{st.st_size}|{st.st_mtime_ns}|".encode())
    with open(real, "rb") as fh:
        h.update(fh.read(_EDGE))
        fh.seek(max(0, st.st_size - _EDGE))
        h.update(fh.read())
    return h.hexdigest()[:32]


def index_dir() -> Path:
    return settings.home_dir() / "gguf-index"


def build_index(reader: GGUFReader) -> GGUFIndex:
    """The index of an open reader (its tokenizer rebuilt from the metadata, once)."""
    metadata = {name: f.contents() for name, f in reader.fields.items() if f.types}
    tensors = [
        TensorEntry(
            name=t.name,
            type_code=int(t.tensor_type),
            dims=[int(d) for d in t.shape.tolist()],
            n_elements=int(t.n_elements),
            n_bytes=int(t.n_bytes),
            data_offset=int(t.data_offset),
            view_dtype=t.data.dtype.str,
            view_shape=list(t.data.shape),
        )
        for t in reader.tensors
    ]
    try:
        spec: TokenizerSpec | None = Tokenizer.from_gguf(metadata).to_spec()
    except TokenizerError:
        spec = None  # the loader rebuilds it from the metadata, and reports why it cannot
    return GGUFIndex(metadata, tensors, int(reader.data_offset), spec)


def read_cached(key: str) -> GGUFIndex | None:
    path = index_dir() / f"{key}.msgpack"
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        index = msgspec.msgpack.decode(raw, type=GGUFIndex)
    except (msgspec.DecodeError, msgspec.ValidationError):
        log.info("GGUF index %s unreadable: parsing the file again", path)
        return None
    os.utime(path)  # recently used: pruned last
    return index


def write_cached(key: str, index: GGUFIndex) -> None:
    folder = index_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".msgpack.tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(msgspec.msgpack.encode(index))
        os.replace(tmp, folder / f"{key}.msgpack")  # atomic: a reader sees all or nothing
        entries = sorted(folder.glob("*.msgpack"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-MAX_ENTRIES]:
            old.unlink(missing_ok=True)
    except (OSError, TypeError, msgspec.EncodeError) as exc:  # e.g. a read-only home
        log.info("GGUF index not written to %s: %s", folder, exc)  # every open parses


def open_index(path: Path, parse: Any) -> GGUFIndex:
    """``path``'s index: the cached one, or ``parse(path)`` (a ``GGUFReader``) indexed and
    cached. ``parse`` raises for a file that is not GGUF."""
    key = file_identity(path)
    cached = read_cached(key)
    if cached is not None:
        return cached
    reader = parse(path)
    index = build_index(reader)
    if reader.byte_order == "I":  # native (little-endian) files only: views need no swap
        write_cached(key, index)
    return index


def tensor_views(index: GGUFIndex, path: Path) -> list[ReaderTensor]:
    """The tensors as the reader gives them (``ReaderTensor``s over one read-only memmap),
    without their header field."""
    from gguf import GGMLQuantizationType, ReaderTensor

    mapped = np.memmap(path, mode="r")
    views = []
    for e in index.tensors:
        data = mapped[e.data_offset : e.data_offset + e.n_bytes]
        data = data.view(np.dtype(e.view_dtype)).reshape(e.view_shape)
        views.append(
            ReaderTensor(
                name=e.name,
                tensor_type=GGMLQuantizationType(e.type_code),
                shape=np.array(e.dims, dtype=np.uint64),
                n_elements=e.n_elements,
                n_bytes=e.n_bytes,
                data_offset=e.data_offset,
                data=data,
                field=None,
            )
        )
    return views
