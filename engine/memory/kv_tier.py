"""The KV tier below the pool: evicted blocks' KV kept in host memory or in a disk file.

A tier is a fixed number of block-sized slots (its byte budget) and an index over them::

    entry = digest -> (slot, parent digest, token bytes, checksum of the slot, written?)

The key is the block's chained digest (prefix_tree.py), which already names the model,
tokenizer, dtype and namespace, and the whole prefix before the block: a tenant can only ever
find its own entries. A lookup still compares the parent digest and the exact token bytes
(the same collision guard as the tree). The index has its own LRU: a spill into a full tier
drops the least recently used entry. A read checks the slot's checksum (XXH3-64): a corrupt,
missing or unwritten slot is a miss (the entry is dropped), never wrong KV.

Writes never stall a step: ``spill`` copies the page out (one block) into a staging buffer
and a writer thread checksums it and stores it in the slot; a spill that finds the writer
``max_pending_bytes`` of staged copies behind is refused (counted as a drop; an admin
``evict_all`` waits instead). ``writer=False`` writes inline
(tests). The pool's pages are read and written through ``PageIO`` (``KVCache`` implements it),
so this module knows nothing about layers.

Storage: ``HostSlots`` (a uint8 tensor, pinned when the pool is on CUDA) or ``DiskSlots`` (one
preallocated file, memory-mapped, removed at close unless kept).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import xxhash

from ..config import TierSpec


def checksum(data: np.ndarray) -> int:
    """A slot's checksum: XXH3-64 of its bytes. It is verified on every reload, on the
    request's critical path: XXH3 runs at memory speed (≈ 20 GB/s here) where zlib's crc32
    ran at 2.5-3.4 GB/s and capped a reload below 2 GB/s."""
    return xxhash.xxh3_64_intdigest(data)


class PageIO(Protocol):
    """The pool's side: copy whole pages out as bytes, and bytes back into pages."""

    @property
    def bytes_per_block(self) -> int: ...

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A copy of the pages' KV: uint8 ``[len(pages), bytes_per_block]``."""
        ...

    def write_pages(self, pages: list[int], data: np.ndarray | Sequence[np.ndarray]) -> None:
        """Fill ``pages`` from bytes as ``read_pages`` gives them, or one row per page."""
        ...


class SlotStorage(Protocol):
    kind: str  # "host" | "disk"
    num_slots: int
    slots: np.ndarray  # uint8 [num_slots, slot_bytes]

    def close(self) -> None: ...


class HostSlots:
    kind = "host"

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool) -> None:
        self.num_slots = num_slots
        self._tensor = torch.empty(
            (num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self.slots = self._tensor.numpy()

    def close(self) -> None:
        pass


def _preallocate(fd: int, size: int, directory: str) -> None:
    """Reserve the file's blocks: a full disk is an error now, not a fault at the mmap's
    first write there (a sparse file killed the engine); else check the free space."""
    why = f"--kv-offload: cannot reserve {size} bytes in {directory}"
    try:
        return os.posix_fallocate(fd, 0, size)
    except AttributeError:  # no posix_fallocate on this OS
        pass
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise OSError(exc.errno, f"{why}: {exc.strerror}") from None
    stat = os.statvfs(directory)
    if stat.f_bavail * stat.f_frsize < size:
        raise OSError(errno.ENOSPC, f"{why}: {stat.f_bavail * stat.f_frsize} bytes free")


class DiskSlots:
    kind = "disk"

    def __init__(self, num_slots: int, slot_bytes: int, directory: str, keep: bool) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="prefixcache-kv-", suffix=".slots", dir=directory)
        self.path = Path(name)
        size = num_slots * slot_bytes
        try:
            _preallocate(fd, size, directory)
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        self.num_slots = num_slots
        self.slots = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(num_slots, slot_bytes))
        # the file goes at close, at garbage collection or at interpreter exit, unless kept
        self._remove = None if keep else weakref.finalize(self, _unlink, self.path)

    def close(self) -> None:
        self.slots.flush()
        if self._remove is not None:
            self._remove()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@dataclass(slots=True, eq=False)
class TierEntry:
    slot: int
    parent: bytes  # parent block's digest, or the namespace root digest
    tokens: bytes
    checksum: int = 0  # checksum() of the slot's bytes
    written: bool = False


@dataclass(slots=True)
class TierStats:
    kind: str = ""
    num_slots: int = 0
    slot_bytes: int = 0
    num_entries: int = 0
    writes: int = 0  # blocks written into the tier
    reloads: int = 0  # blocks copied back into the pool
    drops: int = 0  # entries dropped by the tier's LRU, or spills refused (writer behind)
    corrupt: int = 0  # reads refused by the checksum (or of a slot never written)

    @property
    def bytes_used(self) -> int:
        return self.num_entries * self.slot_bytes

    @property
    def bytes_free(self) -> int:
        return (self.num_slots - self.num_entries) * self.slot_bytes


class KVTier:
    def __init__(
        self,
        storage: SlotStorage,
        pages: PageIO,
        writer: bool = True,
        max_pending_bytes: int = 256 * 1024**2,
    ) -> None:
        if storage.num_slots < 1:
            raise ValueError("the KV tier holds no block: give it more bytes")
        self.kind = storage.kind
        self.storage = storage
        self.pages = pages
        self.slot_bytes = pages.bytes_per_block
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # LRU, oldest first
        self._free = list(range(storage.num_slots - 1, -1, -1))
        self._stats = TierStats(storage.kind, storage.num_slots, self.slot_bytes)
        self._max_pending = max(16, max_pending_bytes // max(1, self.slot_bytes))  # staged
        self._queue: queue.Queue[tuple[TierEntry, np.ndarray] | None] | None = None
        self._thread: threading.Thread | None = None
        self.on_drop: Callable[[bytes], None] | None = None  # an entry left (KV events)
        self.closed = False
        if writer:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._write_loop, name="kv-tier", daemon=True)
            self._thread.start()

    # ---- lookup

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, digest: bytes, parent: bytes, tokens: bytes) -> bool:
        """Whether the tier holds this block (read-only: no LRU touch)."""
        entry = self._entries.get(digest)
        return entry is not None and entry.parent == parent and entry.tokens == tokens

    def source(self, digest: bytes) -> tuple[bytes, bytes] | None:
        """The parent digest and token bytes an entry was stored with (None: not held)."""
        entry = self._entries.get(digest)
        return None if entry is None else (entry.parent, entry.tokens)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __iter__(self) -> Iterator[bytes]:
        """The digests held, least recently used first (a copy: drops may follow)."""
        return iter(list(self._entries))

    def touch(self, digests: list[bytes]) -> None:
        """Most recently used, in this order (a match about to be reloaded)."""
        for digest in digests:
            if digest in self._entries:
                self._entries.move_to_end(digest)

    # ---- writes

    def spill(
        self,
        digest: bytes,
        parent: bytes,
        tokens: bytes,
        page: int,
        wait: bool = False,
        coldest: bool = False,
    ) -> bool:
        """Keep an evicted page's KV under ``digest``; False if refused (the writer is
        ``max_pending_bytes`` behind; ``wait``: wait for it instead, off the step path).
        Already held: a touch. ``coldest``: enter as the least recently used entry."""
        if self.closed:
            return False
        entry = self._entries.get(digest)
        if entry is not None:
            if not coldest:  # (a cold spill does not demote what the tier holds)
                self._entries.move_to_end(digest)
            return True
        if self._queue is not None and self._queue.qsize() >= self._max_pending:
            if not wait:
                self._stats.drops += 1
                return False
            self.drain()
        if not self._free:
            self._drop(next(iter(self._entries)))
        entry = TierEntry(self._free.pop(), parent, tokens)
        self._entries[digest] = entry
        if coldest:
            self._entries.move_to_end(digest, last=False)
        data = self.pages.read_pages([page])[0]  # the page is reused right after this
        if self._queue is None:
            self._store(entry, data)
        else:
            self._queue.put((entry, data))
        return True

    def _store(self, entry: TierEntry, data: np.ndarray) -> None:
        entry.checksum = checksum(data)
        self.storage.slots[entry.slot] = data
        entry.written = True
        self._stats.writes += 1

    def _write_loop(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            try:
                self._store(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued write is in its slot."""
        if self._queue is not None:
            self._queue.join()

    # ---- reads

    def reload(self, digests: list[bytes], pages: list[int]) -> int:
        """Copy the entries' KV into ``pages``; stops at the first entry that is gone or fails
        its checksum (dropped). Returns how many were copied. Each slot is verified in place
        and handed to ``write_pages`` as a view: one memory copy per byte, slot to page."""
        if any(
            (e := self._entries.get(d)) is not None and not e.written for d in digests
        ):  # a spill still on its way: wait for it rather than recompute
            self.drain()
        slots = self.storage.slots
        rows: list[np.ndarray] = []  # views of the verified slots: no gather copy
        for digest in digests:
            entry = self._entries.get(digest)
            if entry is None:
                break
            row = slots[entry.slot]
            if not entry.written or checksum(row) != entry.checksum:
                self._stats.corrupt += 1
                self._drop(digest, count=False)
                break
            self._entries.move_to_end(digest)
            rows.append(row)
        if rows:
            self.pages.write_pages(pages[: len(rows)], rows)
            self._stats.reloads += len(rows)
        return len(rows)

    # ---- upkeep

    def discard(self, digest: bytes) -> None:
        if digest in self._entries:
            self._drop(digest, count=False)

    def clear(self) -> None:
        for digest in list(self._entries):
            self._drop(digest, count=False)

    def _drop(self, digest: bytes, count: bool = True) -> None:
        entry = self._entries.pop(digest)
        entry.written = False  # a reader holding it sees a miss
        self._free.append(entry.slot)
        if count:
            self._stats.drops += 1
        if self.on_drop is not None:
            self.on_drop(digest)

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(
            s.kind,
            s.num_slots,
            s.slot_bytes,
            len(self._entries),
            s.writes,
            s.reloads,
            s.drops,
            s.corrupt,
        )

    def corrupt_slot(self, digest: bytes) -> None:
        """Change a byte of an entry's slot (tests: a damaged slot must read as a miss)."""
        self.drain()
        slot = self._entries[digest].slot
        byte = int(self.storage.slots[slot, 0])
        self.storage.slots[slot, 0] = (byte + 1) % 256  # a second damage never repairs it

    def check(self) -> None:
        """Bytes used equal the live entries' slots; no slot is held twice or both held and free."""
        held = [e.slot for e in self._entries.values()]
        assert len(set(held)) == len(held), "a slot held by two entries"
        assert not set(held) & set(self._free), "a slot both held and free"
        assert len(held) + len(self._free) == self.storage.num_slots, "a slot leaked"
        s = self.stats()
        assert s.bytes_used == sum(self.slot_bytes for _ in self._entries.values())
        assert s.bytes_used + s.bytes_free == self.storage.num_slots * self.slot_bytes

    def close(self) -> None:
        """Stop the writer (queued writes land first) and let the storage go: the tier then
        holds nothing and refuses spills (a spill after close waited on a writer that was
        gone)."""
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self._queue = None
        self.closed = True
        self._entries.clear()
        self._free = list(range(self.storage.num_slots - 1, -1, -1))
        self.storage.close()


def create_tier(
    spec: TierSpec,
    pages: PageIO,
    device: str,
    keep_files: bool = False,
    num_slots: int | None = None,
) -> KVTier:
    """The tier ``--kv-offload`` asks for, its slots sized to the pool's pages; ``num_slots``:
    how many (default: as many as its bytes hold; a hybrid model splits them, kv_setup.py)."""
    slot_bytes = pages.bytes_per_block
    if num_slots is None:
        num_slots = spec.num_bytes // slot_bytes
    if num_slots < 1:
        raise ValueError(f"--kv-offload: {spec.num_bytes} bytes hold no {slot_bytes}-byte block")
    storage: SlotStorage
    if spec.kind == "host" or not slot_bytes:  # no bytes (no global layer): an index only
        pin = device.startswith("cuda") and torch.cuda.is_available()
        storage = HostSlots(num_slots, slot_bytes, pin_memory=pin)
    else:
        assert spec.path is not None
        storage = DiskSlots(num_slots, slot_bytes, spec.path, keep_files)
    return KVTier(storage, pages)
