"""Who owns which KV page: reference counts, the free list, and the LRU of idle cached pages.

Every page is in exactly one of three states, and the three always add up to the pool size:

    free          no cached content, ref 0    handed out first
    cached-idle   cached content, ref 0       findable by a prefix match until evicted
    in use        ref > 0 (cached or not)     never handed out again, never evicted

Cached-idle pages wait in one of two LRU lists (``OrderedDict``: O(1) touch and remove,
oldest first). Unpinned pages are evicted first; pinned ones only when no unpinned page is
left. The pool knows nothing about the prefix tree: the block manager keeps the order
"children before parents" in these lists (see ``BlockManager``), and asserts it on eviction.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count: list[int] = [0] * num_blocks
        self.pin_count: list[int] = [0] * num_blocks  # pins on this page or any page below it
        self.cached: list[bool] = [False] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: lowest id on top
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._idle_pinned: OrderedDict[int, None] = OrderedDict()
        self.num_used = 0
        self.num_pinned = 0  # cached pages with pin_count > 0, in use or idle

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle) + len(self._idle_pinned)

    @property
    def num_available(self) -> int:
        """Pages a request could get: free ones, then evicted idle ones."""
        return len(self._free) + len(self._idle) + len(self._idle_pinned)

    @property
    def num_available_unpinned(self) -> int:
        """Pages to be had without evicting a pinned block."""
        return len(self._free) + len(self._idle)

    def take_free(self) -> int | None:
        """A page with no cached content, ref count 1; None when there is none."""
        if not self._free:
            return None
        block = self._free.pop()
        self.ref_count[block] = 1
        self.num_used += 1
        return block

    def oldest_idle(self, include_pinned: bool = True) -> int | None:
        """The least recently used idle cached page, unpinned ones first."""
        if self._idle:
            return next(iter(self._idle))
        if include_pinned and self._idle_pinned:
            return next(iter(self._idle_pinned))
        return None

    def evict(self, block: int) -> None:
        """Drop an idle page's cached content: it becomes free (and is handed out next)."""
        assert self.ref_count[block] == 0 and self.cached[block]
        self._idle_list(block).pop(block)
        if self.pin_count[block]:
            self.pin_count[block] = 0
            self.num_pinned -= 1
        self.cached[block] = False
        self._free.append(block)

    def ref(self, block: int) -> None:
        """Take a reference on a page already in use or cached (a hit, a fork, a dedupe)."""
        if self.ref_count[block] == 0:
            assert self.cached[block], f"block {block} is free: it cannot be shared"
            self._idle_list(block).pop(block)
            self.num_used += 1
        self.ref_count[block] += 1

    def ref_all(self, blocks: list[int]) -> None:
        """``ref`` each block (a match's hit blocks), in one loop."""
        ref_count, cached = self.ref_count, self.cached
        for block in blocks:
            if ref_count[block] == 0:
                assert cached[block], f"block {block} is free: it cannot be shared"
                self._idle_list(block).pop(block)
                self.num_used += 1
            ref_count[block] += 1

    def deref(self, block: int) -> None:
        """Drop a reference; at 0 a cached page becomes the most recently used idle page."""
        assert self.ref_count[block] > 0, f"block {block} freed twice"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.num_used -= 1
            if self.cached[block]:
                self._idle_list(block)[block] = None
            else:
                self._free.append(block)

    def mark_cached(self, block: int) -> None:
        """The page's content was inserted into the prefix tree (it is in use right now)."""
        assert self.ref_count[block] > 0 and not self.cached[block]
        self.cached[block] = True

    def pin(self, block: int) -> None:
        """Count one more pin on a cached page; an idle page moves to the pinned list's tail."""
        assert self.cached[block]
        idle = self.ref_count[block] == 0
        if idle:
            self._idle_list(block).pop(block)
        self.pin_count[block] += 1
        if self.pin_count[block] == 1:
            self.num_pinned += 1
        if idle:
            self._idle_pinned[block] = None

    def unpin(self, block: int) -> None:
        assert self.cached[block] and self.pin_count[block] > 0
        self.pin_count[block] -= 1
        if self.pin_count[block] == 0:
            self.num_pinned -= 1
            if self.ref_count[block] == 0:
                self._idle_pinned.pop(block)
                self._idle[block] = None

    def idle_order(self, pinned: bool) -> list[int]:
        """The idle pages in eviction order (for invariant checks)."""
        return list(self._idle_pinned if pinned else self._idle)

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        idle, pinned = set(self._idle), set(self._idle_pinned)
        assert not (free & idle) and not (free & pinned) and not (idle & pinned)
        used = 0
        for block in range(self.num_blocks):
            ref, cached = self.ref_count[block], self.cached[block]
            assert ref >= 0
            if ref > 0:
                used += 1
                assert block not in free and block not in idle and block not in pinned
            elif cached:
                assert block in (pinned if self.pin_count[block] else idle), block
            else:
                assert block in free, f"block {block} leaked"
            assert cached or self.pin_count[block] == 0
        assert used == self.num_used
        assert len(free) + len(idle) + len(pinned) + used == self.num_blocks
        assert self.num_pinned == sum(1 for c in self.pin_count if c > 0)

    def _idle_list(self, block: int) -> OrderedDict[int, None]:
        return self._idle_pinned if self.pin_count[block] else self._idle
