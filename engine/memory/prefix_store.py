"""Pinned prefixes on disk: save them, load them at start-up, skip their prefill.

A file is one safetensors file: per layer the KV pages of every block on a pinned prefix
(``kv.<layer>``, ``[n, 2, block_size, kv_heads, head_dim]``, the cache's own layout and dtype)
and the tree around them (``tokens``, ``parents``, ``pins``, ``roots``: parents before
children; a root is the namespace root digest of a top block). Its metadata carries the
format, a digest of the engine identity (model and tokenizer fingerprints, dtype), the block
size, and an HMAC-SHA256 over everything else keyed by a key the caller passes (the
sidecar derives it from the server secret: tenancy.cache_file_key), so a file from another model, tokenizer, dtype or
block size, a damaged one, or one edited and re-signed without the key, is refused with a
message before any page is touched; so are pages that are not finite.

Split by thread: ``snapshot``/``restore`` touch the block manager (through
``pinned_blocks.py``) and the pages (the engine thread); ``write``/``read`` do the file work and
its checks (any thread).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..api import LoadResult, PrefixStoreError, SaveResult
from .block_manager import BlockManager
from .kv_cache import KVCache
from .pinned_blocks import SavedBlock, restore_blocks, saved_blocks

FORMAT = "prefixcache-pinned-prefixes/2"  # /2: HMAC-authenticated
DIGEST_BYTES = 16  # the prefix tree's blake2b-128 digests


@dataclass(slots=True)
class Snapshot:
    """Pinned prefixes with their KV, detached from the pages (safe to use on any thread)."""

    blocks: list[SavedBlock]
    kv: list[torch.Tensor]  # one per layer: [len(blocks), 2, block_size, kv_heads, head_dim]
    identity: str  # sha256 hex of the engine identity
    block_size: int
    path: str = ""  # the file it was read from ("": taken from the pages)

    @property
    def num_prefixes(self) -> int:
        return sum(1 for b in self.blocks if b.pins)


def _refuse_hybrid(cache: KVCache) -> None:
    if cache.local_layers:
        raise PrefixStoreError("pinned-prefix files do not carry a hybrid model's local pages yet")


def identity_digest(identity: bytes) -> str:
    return hashlib.sha256(identity).hexdigest()


def snapshot(manager: BlockManager, cache: KVCache) -> Snapshot:
    """Copy out every pinned prefix (engine thread)."""
    _refuse_hybrid(cache)
    blocks = saved_blocks(manager)
    pages = torch.tensor([b.page for b in blocks], dtype=torch.long, device=cache.spec.device)
    kv = [cache.select_pages(layer, pages).cpu() for layer in cache.layers]
    return Snapshot(blocks, kv, identity_digest(manager.identity), manager.block_size)


def restore(snap: Snapshot, manager: BlockManager, cache: KVCache) -> LoadResult:
    """Cache and pin what a snapshot holds (engine thread). Checks were done by ``read``."""

    def write(index: int, page: int) -> None:  # page by page: no second copy of the file
        for layer, kv in zip(cache.layers, snap.kv, strict=True):
            layer[page].copy_(kv[index])

    restored = restore_blocks(manager, snap.blocks, write)
    return LoadResult(
        snap.path,
        snap.num_prefixes,
        len(snap.blocks),
        restored.restored_blocks,
        restored.reused_blocks,
        restored.skipped_blocks,
        restored.pinned_prefixes,
    )


def write(snap: Snapshot, path: str | Path, key: bytes) -> SaveResult:
    """Write a snapshot atomically (a temporary file renamed over ``path``), signed with
    ``key``."""
    path = Path(path)
    tensors = _tensors(snap)
    metadata = {
        "format": FORMAT,
        "identity": snap.identity,
        "block_size": str(snap.block_size),
        "num_layers": str(len(snap.kv)),
    }
    metadata["hmac"] = sign(key, metadata, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)  # unique: concurrent saves to one name never share a temporary file
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return SaveResult(str(path), snap.num_prefixes, len(snap.blocks), path.stat().st_size)


def read(path: str | Path, identity: bytes, cache: KVCache, key: bytes) -> Snapshot:
    """A file's snapshot, refused unless it was signed with ``key`` and made by this engine
    identity and layout. Every refusal is a ``PrefixStoreError`` (a ValueError)."""
    _refuse_hybrid(cache)
    source, path = str(path), Path(path)
    if not path.is_file():
        raise PrefixStoreError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise PrefixStoreError(f"{path}: not a readable safetensors file ({e})") from e
    if metadata.get("format") != FORMAT:
        raise PrefixStoreError(f"{path}: not a pinned-prefix file of this version ({FORMAT})")
    mac = metadata.pop("hmac", "")
    if not hmac.compare_digest(mac, sign(key, metadata, tensors)):
        raise PrefixStoreError(
            f"{path}: checksum mismatch: the file is damaged, or was not saved by a server "
            "with this secret"
        )
    try:
        return _checked(source, metadata, tensors, identity, cache)
    except PrefixStoreError as e:
        raise PrefixStoreError(f"{path}: {e}") from None
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:  # signed, yet odd
        raise PrefixStoreError(f"{path}: malformed ({type(e).__name__}: {e})") from None


def _checked(
    source: str,
    metadata: dict[str, str],
    tensors: dict[str, torch.Tensor],
    identity: bytes,
    cache: KVCache,
) -> Snapshot:
    if metadata.get("identity") != identity_digest(identity):
        raise PrefixStoreError(
            "saved by another model, tokenizer or dtype; its KV does not apply here"
        )
    spec = cache.spec
    if int(metadata["block_size"]) != spec.block_size:
        raise PrefixStoreError(
            f"block size {metadata['block_size']}, this engine uses {spec.block_size}"
        )
    num_layers = int(metadata["num_layers"])
    page_shape = tuple(cache.layers[0].shape[1:])
    kv = [tensors.get(f"kv.{i}") for i in range(num_layers)]
    if num_layers != len(cache.layers) or any(
        t is None or tuple(t.shape[1:]) != page_shape or t.dtype != spec.dtype for t in kv
    ):
        raise PrefixStoreError("its KV layout differs from this engine's cache")
    blocks = _blocks(tensors, spec.block_size)
    if any(t.shape[0] != len(blocks) for t in kv):  # type: ignore[union-attr]
        raise PrefixStoreError("its KV and its tree disagree on the number of blocks")
    if not all(bool(torch.isfinite(_wide(t)).all()) for t in kv):  # type: ignore[arg-type]
        raise PrefixStoreError("its KV pages hold non-finite values (NaN or inf)")
    return Snapshot(blocks, kv, metadata["identity"], spec.block_size, source)  # type: ignore[arg-type]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp8 pages as float32 (torch's isfinite takes no fp8); others as they are."""
    return t.float() if t.element_size() == 1 else t


def _tensors(snap: Snapshot) -> dict[str, torch.Tensor]:
    n, bs = len(snap.blocks), snap.block_size
    tokens = array("I", b"".join(b.tokens for b in snap.blocks))
    roots = b"".join(b.root or bytes(DIGEST_BYTES) for b in snap.blocks)
    out = {
        "tokens": torch.tensor(tokens.tolist(), dtype=torch.int64).reshape(n, bs),
        "parents": torch.tensor([b.parent for b in snap.blocks], dtype=torch.int64),
        "pins": torch.tensor([b.pins for b in snap.blocks], dtype=torch.int64),
        "roots": torch.tensor(list(roots), dtype=torch.uint8).reshape(n, DIGEST_BYTES),
    }
    for i, layer in enumerate(snap.kv):
        out[f"kv.{i}"] = layer.contiguous()
    return out


def _blocks(tensors: dict[str, torch.Tensor], block_size: int) -> list[SavedBlock]:
    try:
        tokens, parents = tensors["tokens"], tensors["parents"].tolist()
        pins, roots = tensors["pins"].tolist(), tensors["roots"]
    except KeyError as e:
        raise PrefixStoreError(f"the file has no {e.args[0]!r} tensor") from None
    n = len(parents)
    if (
        tuple(tokens.shape) != (n, block_size)
        or tuple(roots.shape) != (n, DIGEST_BYTES)
        or len(pins) != n
        or any(p < 0 for p in pins)
        or (n and not 0 <= int(tokens.min()) <= int(tokens.max()) < 2**32)
    ):
        raise PrefixStoreError("the file's tree tensors are malformed")
    blocks = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise PrefixStoreError("the file's tree is malformed (a parent after its child)")
        root = bytes(roots[i].tolist()) if parent == -1 else b""
        data = array("I", tokens[i].tolist()).tobytes()
        blocks.append(SavedBlock(root, parent, data, int(pins[i]), -1))
    return blocks


def sign(key: bytes, metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """HMAC-SHA256 (hex) of the metadata and every tensor's name, dtype, shape and bytes."""
    h = hmac.new(key, json.dumps(metadata, sort_keys=True).encode(), hashlib.sha256)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # the buffer itself, no copy
    return h.hexdigest()
