"""The block manager's vocabulary: a prefix match, a block table, the counters, the listener
that hears of every change to the tree, and the error a full pool raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..paging import DEFAULT_BLOCK_SIZE
from .prefix_tree import Node

CopySlots = Callable[[int, int, int], None]


class BlockListener(Protocol):
    """Told of every change to the tree (KV events, observability/kv_events.py; the cache activity).
    A subclass keeps the no-op default of what it does not need."""

    def block_stored(self, node: Node, root: bytes) -> None: ...

    def block_removed(self, node: Node, cause: str) -> None:
        """An evicted leaf; ``cause``: "pressure", "ttl", or the admin cause of ``evict_all``."""
        ...

    def block_spilled(self, node: Node, tier: str) -> None:
        """An evicted block's KV now also lives in the tier (kind "host" or "disk")."""
        ...

    def tier_dropped(self, digest: bytes, tier: str) -> None:
        """The tier no longer holds the block ``digest`` (its LRU, a bad slot, a clear)."""
        ...


class OutOfBlocksError(RuntimeError):
    """The pool cannot serve the request; call the matching ``can_*`` first."""


@dataclass(slots=True)
class PrefixMatch:
    blocks: list[int]  # cached full blocks of the longest prefix, in order
    partial_block: int | None  # next cached block whose leading tokens also match
    partial_tokens: int  # how many of its leading tokens match (0 if none)
    block_size: int = DEFAULT_BLOCK_SIZE
    tier: list[bytes] = field(default_factory=list)  # digests of the next blocks, in the tier

    @property
    def num_tokens(self) -> int:
        return (len(self.blocks) + len(self.tier)) * self.block_size + self.partial_tokens


@dataclass(slots=True)
class BlockTable:
    namespace: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens reused from the cache at allocation (full + partial)
    num_committed_blocks: int  # leading blocks already in the tree (shared or inserted)
    hashes: list[bytes] = field(default_factory=list)  # digests of the committed blocks
    block_size: int = DEFAULT_BLOCK_SIZE
    num_reloaded_tokens: int = 0  # of num_cached_tokens, copied back from the KV tier
    num_released_blocks: int = 0  # hybrid: leading blocks out of the window (local pages let go)
    num_interior_blocks: int = 0  # hybrid: prompt blocks more than a window before its end

    @property
    def num_slots(self) -> int:
        return len(self.block_ids) * self.block_size


@dataclass(slots=True)
class ManagerStats:
    query_tokens: int = 0
    hit_tokens: int = 0  # includes reloaded_tokens
    reloaded_tokens: int = 0  # hits copied back from the KV tier
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    num_free_blocks: int = 0
    num_cached_idle_blocks: int = 0
    num_used_blocks: int = 0
    num_pinned_blocks: int = 0
    num_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    num_ttl_pins: int = 0
    num_local_pages: int = 0  # hybrid models: the sliding layers' pool (0: not hybrid)
    num_local_held: int = 0  # held by running sequences' windows
    num_local_idle: int = 0  # attached to a cached block, held by none (evictable)
