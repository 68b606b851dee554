"""Pinned prefixes on disk: save them, load them at start-up, skip their prefill.

A file is one safetensors file: per layer the KV pages of every block on a pinned prefix
(``kv.<layer>``, ``[n, 2, block_size, kv_heads, head_dim]``, the cache's own layout and dtype)
and the tree around them (``tokens``, ``parents``, ``pins``, ``roots``: parents before
children; a root is the namespace root digest of a top block). A hybrid model's sliding
layers (metadata ``local_layers``) keep only the blocks ``local_blocks`` lists: each pinned
prefix's last window (``HybridBlockManager.hit_window``), all a hit on it reads. The metadata
carries the format, a digest of the engine identity (model and tokenizer fingerprints, dtype),
the block size, and an HMAC-SHA256 over everything else keyed by a key the caller passes (the
sidecar derives it from the server secret: tenancy.cache_file_key), so a file from another
model, tokenizer, dtype or block size, a damaged one, or one edited and re-signed without the
key, is refused with a message before any page is touched; so are pages that are not finite.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..api import LoadResult, PrefixStoreError, SaveResult
from .block_manager import BlockManager
from .hybrid.manager import HybridBlockManager
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
    local_layers: tuple[int, ...] = ()  # hybrid: their kv has a row per local_blocks entry
    local_blocks: list[int] = field(default_factory=list)  # indices into blocks, ascending

    @property
    def num_prefixes(self) -> int:
        return sum(1 for b in self.blocks if b.pins)


def identity_digest(identity: bytes) -> str:
    return hashlib.sha256(identity).hexdigest()


def snapshot(manager: BlockManager, cache: KVCache) -> Snapshot:
    """Copy out every pinned prefix (engine thread)."""
    blocks = saved_blocks(manager)
    local_blocks: list[int] = []
    local_pages: list[int] = []
    if cache.local_layers:
        assert isinstance(manager, HybridBlockManager)
        local_blocks = _last_windows(blocks, manager)
        local_pages = [manager.local.page_of[blocks[i].page] for i in local_blocks]
    device = cache.spec.device
    pages = torch.tensor([b.page for b in blocks], dtype=torch.long, device=device)
    local = torch.tensor(local_pages, dtype=torch.long, device=device)
    kv = [
        cache.select_pages(layer, local if i in cache.local_layers else pages).cpu()
        for i, layer in enumerate(cache.layers)
    ]
    identity = identity_digest(manager.identity)
    return Snapshot(blocks, kv, identity, manager.block_size, "", cache.local_layers, local_blocks)


def _last_windows(blocks: list[SavedBlock], manager: HybridBlockManager) -> list[int]:
    """The saved blocks whose local pages a hit on a pinned prefix reads (its last window,
    or that of the longest hit whose window is complete, as ``fit`` finds it)."""
    out: set[int] = set()
    for i, block in enumerate(blocks):
        if not block.pins:
            continue
        chain = [i]
        while blocks[chain[-1]].parent >= 0:
            chain.append(blocks[chain[-1]].parent)
        chain.reverse()  # root first: chain[j] is block j of the prefix
        index = {blocks[j].page: j for j in chain}
        out.update(index[b] for b in manager.hit_window([blocks[j].page for j in chain]))
    return sorted(out)


def restore(snap: Snapshot, manager: BlockManager, cache: KVCache) -> LoadResult:
    """Cache and pin what a snapshot holds (engine thread). Checks were done by ``read``."""
    local = set(snap.local_layers)
    local_row = {index: row for row, index in enumerate(snap.local_blocks)}

    def write(index: int, page: int) -> None:  # page by page: no second copy of the file
        for i, (layer, kv) in enumerate(zip(cache.layers, snap.kv, strict=True)):
            if i not in local:
                layer[page].copy_(kv[index])
        if local:
            assert isinstance(manager, HybridBlockManager)
            row = local_row.get(index)
            if row is None:
                manager.local.drop(page)  # no saved KV: no hit may count on this page
            else:
                write_local(row, manager.local.page_of[page])

    def write_local(row: int, local_page: int) -> None:
        for i in snap.local_layers:
            cache.layers[i][local_page].copy_(snap.kv[i][row])

    def reused(index: int, block: int) -> None:  # cached here, maybe without its local page
        row = local_row.get(index)
        if row is not None:
            assert isinstance(manager, HybridBlockManager)
            manager.fill_local(block, lambda local_page: write_local(row, local_page))

    restored = restore_blocks(manager, snap.blocks, write, reused if local else None)
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
    if snap.local_layers:
        metadata["local_layers"] = ",".join(map(str, snap.local_layers))
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
    local_layers = tuple(int(i) for i in metadata.get("local_layers", "").split(",") if i)
    if local_layers != cache.local_layers:
        raise PrefixStoreError(
            f"saved with sliding-window layers {list(local_layers)}, this engine has "
            f"{list(cache.local_layers)} (another --max-model-len?)"
        )
    blocks = _blocks(tensors, spec.block_size)
    local_blocks = tensors["local_blocks"].tolist() if local_layers else []
    if any(not 0 <= b < len(blocks) for b in local_blocks) or local_blocks != sorted(
        set(local_blocks)
    ):
        raise PrefixStoreError("its local blocks are malformed")
    rows = [len(local_blocks) if i in local_layers else len(blocks) for i in range(num_layers)]
    if any(t.shape[0] != n for t, n in zip(kv, rows, strict=True)):  # type: ignore[union-attr]
        raise PrefixStoreError("its KV and its tree disagree on the number of blocks")
    if not all(bool(torch.isfinite(_wide(t)).all()) for t in kv):  # type: ignore[arg-type]
        raise PrefixStoreError("its KV pages hold non-finite values (NaN or inf)")
    return Snapshot(
        blocks,
        kv,  # type: ignore[arg-type]
        metadata["identity"],
        spec.block_size,
        source,
        local_layers,
        local_blocks,
    )


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
    if snap.local_layers:
        out["local_blocks"] = torch.tensor(snap.local_blocks, dtype=torch.int64)
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
