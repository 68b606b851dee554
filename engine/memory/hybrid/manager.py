"""The hybrid models' block manager: ``BlockManager`` plus the local pages of one sliding
window. A hit of length L needs the local pages covering keys [L - w + 1, L - 1]
(``HybridBlockManager.fit``). Design and invariants: docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..block_types import (
    BlockListener,
    BlockTable,
    CopySlots,
    ManagerStats,
    OutOfBlocksError,
    PrefixMatch,
)
from ..prefix_tree import token_bytes
from .local_pages import NULL_PAGE, LocalPages, WatchedPool
from .local_tier import LocalTierLink
from .pins import HybridPins

if TYPE_CHECKING:
    from ..kv_tier import KVTier


class HybridBlockManager(HybridPins):
    """``BlockManager`` plus the local pages of one sliding window; with a KV tier, a second
    one for local pages (``local_tier.py``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        identity: bytes,
        window: int,
        num_local_pages: int,
        copy_slots: CopySlots | None = None,
        copy_local_slots: CopySlots | None = None,
        enable_caching: bool = True,
        clock: Callable[[], float] = time.monotonic,
        listener: BlockListener | None = None,
        tier: KVTier | None = None,
        local_tier: KVTier | None = None,
        spill_policy: str = "all",
    ) -> None:
        """``copy_local_slots(src, dst, k)`` copies local pages' first k slots. ``tier`` takes
        the global pages' KV, ``local_tier`` the local pages' (both or neither)."""
        if (tier is None) != (local_tier is None):
            raise ValueError("a hybrid manager's KV tier needs both its global and local parts")
        if window < 1:
            raise ValueError(f"a hybrid manager needs a sliding window >= 1, got {window}")
        super().__init__(
            num_blocks,
            block_size,
            identity,
            copy_slots=copy_slots,
            enable_caching=enable_caching,
            clock=clock,
            listener=listener,
            spill_policy=spill_policy,
        )
        self.window = window
        self.local = LocalPages(num_local_pages, num_blocks)
        self._orphans: dict[int, int] = {}
        self._pool = pool = WatchedPool(num_blocks, self.local, self._orphans)
        self.local.is_pinned = lambda block: pool.pin_count[block] > 0
        self._copy_global, self._copy_local = copy_slots, copy_local_slots
        self._copy_slots = self._copy_both if copy_slots is not None else None
        self.shrunk_tokens = 0  # hit tokens given up because a window was incomplete
        self._link_tier(tier, spill_policy)  # over the watched pool
        self._local_link: LocalTierLink | None = None
        if self.tier is not None and local_tier is not None:
            self._local_link = LocalTierLink(local_tier, spill_policy)
            self.local.on_detach = self._spill_detached

    @property
    def local_tier(self) -> KVTier | None:
        return self._local_link.tier if self._local_link is not None else None

    def window_start(self, num_tokens: int) -> int:
        """The first block a query at position ``num_tokens`` still sees a key of."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def local_table(self, table: BlockTable) -> list[int]:
        """The table's local pages: the null page for the blocks that slid out."""
        page_of, first = self.local.page_of, table.num_released_blocks
        return [NULL_PAGE] * first + [page_of[b] for b in table.block_ids[first:]]

    # ---- lookup: a hit only as long as its window is complete

    def match(self, token_ids: Sequence[int], namespace: str, max_tokens: int) -> PrefixMatch:
        return self.fit(super().match(token_ids, namespace, max_tokens))

    def fit(self, match: PrefixMatch) -> PrefixMatch:
        """The longest prefix of ``match`` whose window blocks all have a local page."""
        fitted = self._fitted(match)
        self.shrunk_tokens += match.num_tokens - fitted.num_tokens
        return fitted

    def _fitted(self, match: PrefixMatch) -> PrefixMatch:
        """Shortened to the longest hit whose window blocks have a local page, or one the
        local tier holds (then without a partial block: a refill that fails shortens a
        hit of full blocks only, ``_prefetch``)."""
        bs, blocks, tier = self.block_size, match.blocks, match.tier
        n, from_tier = match.num_tokens, False
        while n > 0:
            missing = -1
            for j in range((n - 1) // bs, self.window_start(n) - 1, -1):
                where = self._local_source(match, j)
                from_tier |= where == "tier"
                if where is None:
                    missing = j
                    break
            if missing < 0:
                break
            n = missing * bs  # every shorter hit ending after block `missing` still sees it
        if n == match.num_tokens:
            if from_tier and match.partial_tokens:
                return self._fitted(PrefixMatch(blocks, None, 0, bs, tier))
            return match
        k = n // bs
        return PrefixMatch(blocks[:k], None, 0, bs, tier[: max(0, k - len(blocks))])

    def _local_source(self, match: PrefixMatch, j: int) -> str | None:
        """Where block ``j`` of a match has its local page: "page", "tier" or nowhere."""
        blocks, link = match.blocks, self._local_link
        if j >= len(blocks) + len(match.tier):  # the partial block: its own page only
            assert match.partial_block is not None
            return "page" if self.local.page_of[match.partial_block] != NULL_PAGE else None
        if j < len(blocks) and self.local.page_of[blocks[j]] != NULL_PAGE:
            return "page"
        if link is None or self.tier is None:
            return None
        if j < len(blocks):
            return "tier" if link.holds_node(self._tree.node_of(blocks[j])) else None
        return "tier" if link.holds_entry(match.tier[j - len(blocks)], self.tier) else None

    def hit_window(self, blocks: list[int]) -> list[int]:
        """The blocks whose local pages a hit over these cached full blocks reads (or one a
        token shorter: a prompt of exactly these tokens matches one less), once ``fit`` has
        shortened it to a window complete in the pool (what saving a prefix must keep)."""
        with self._pool_only():
            n = self._fitted(PrefixMatch(blocks, None, 0, self.block_size)).num_tokens
        window = blocks[self.window_start(max(n - 1, 0)) : n // self.block_size] if n else []
        return [b for b in window if self.local.page_of[b] != NULL_PAGE]

    @contextmanager
    def _pool_only(self) -> Iterator[None]:
        """Match and fit as if there were no KV tier."""
        links, self._tier_link, self._local_link = (self._tier_link, self._local_link), None, None
        try:
            yield
        finally:
            self._tier_link, self._local_link = links

    def _window_blocks(self, match: PrefixMatch) -> list[int]:
        """The window's blocks with a local page now (not those the tier refills)."""
        n = match.num_tokens
        if n == 0:
            return []
        partial = [match.partial_block] if match.partial_block is not None else []
        blocks = match.blocks + [-1] * len(match.tier) + partial
        window = blocks[self.window_start(n) : (n - 1) // self.block_size + 1]
        return [b for b in window if b >= 0 and self.local.page_of[b] != NULL_PAGE]

    def _num_refills(self, match: PrefixMatch) -> int:
        """Window blocks without a local page (the local tier has theirs: ``_fitted``)."""
        n = match.num_tokens
        if n == 0:
            return 0
        return (
            (n - 1) // self.block_size + 1 - self.window_start(n) - len(self._window_blocks(match))
        )

    # ---- capacity: every new block takes a local page too

    def honoured(self, match: PrefixMatch) -> PrefixMatch:
        """The hit ``allocate`` gives: with the partial's source the last page to take (ref'd
        for its copy), the copy is dropped and the full blocks refitted to a complete window."""
        src = match.partial_block if match.partial_tokens else None
        if src is None:
            return match
        ref = self._pool.ref_count
        idle = sum(1 for b in match.blocks if ref[b] == 0) + (ref[src] == 0)
        if self._pool.num_available - idle > 0:
            return match
        return self._fitted(PrefixMatch(match.blocks, None, 0, self.block_size))

    def can_allocate(self, match: PrefixMatch, num_tokens: int) -> bool:
        match = self.honoured(match)
        if not super().can_allocate(match, num_tokens):
            return False
        holders = self.local.holders
        page_of = self.local.page_of
        idle = sum(1 for b in self._window_blocks(match) if holders[page_of[b]] == 0)
        # tier blocks take a page each and give it back at once (one is needed), or keep it
        new = self._blocks_needed(match, num_tokens) - len(match.tier)
        refills = max(self._num_refills(match), 1 if match.tier else 0)
        return new + idle + refills <= self.local.num_available

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        need = self._blocks_to_grow(table, num_tokens)
        return need <= self._pool.num_available and need <= self.local.num_available

    def allocate(
        self, token_ids: Sequence[int], namespace: str, match: PrefixMatch, num_tokens: int
    ) -> BlockTable:
        if not self.can_allocate(match, num_tokens):
            raise OutOfBlocksError(f"cannot allocate {num_tokens} tokens")
        match = self.honoured(match)
        reloaded = 0
        if match.tier or self._num_refills(match):
            match, num_tokens, reloaded = self._prefetch(token_ids, namespace, match, num_tokens)
        window = self._window_blocks(match)
        for block in window:  # held before any page is taken: none of them is detached
            self.local.hold(block)
        table = super().allocate(token_ids, namespace, match, num_tokens)  # copies a partial:
        assert table.num_cached_tokens == match.num_tokens  # _copy_both released its source
        table.num_released_blocks = self.window_start(table.num_cached_tokens)
        table.num_interior_blocks = self.window_start(len(token_ids))
        reloaded = min(reloaded, table.num_cached_tokens)
        table.num_reloaded_tokens = reloaded
        if "\x00" not in namespace:
            self._stats.reloaded_tokens += reloaded
        return table

    def _prefetch(
        self, token_ids: Sequence[int], namespace: str, match: PrefixMatch, num_tokens: int
    ) -> tuple[PrefixMatch, int, int]:
        """Bring a hit's tier part into the pool first (its blocks' global pages reloaded, its
        window's local pages refilled; then idle and cached), and match again in the pool
        alone. A tier entry lost on the way (LRU, checksum) shortens the hit; where the pages
        counted do not cover what the lost part then costs, ``num_tokens`` shrinks by as much
        (the chunk computed stays as long; a caller that needs the whole prompt checks
        ``num_slots``).
        Returns (match, num_tokens, tokens reloaded into the hit's leading blocks)."""
        bs, local, node_of = self.block_size, self.local, self._tree.node_of
        self._pool.ref_all(match.blocks)  # none of them is evicted for the pages taken here
        first = self.window_start(match.num_tokens)
        held = [b for b in match.blocks[first:] if local.page_of[b] != NULL_PAGE]
        for block in held:  # nor are their local pages taken
            local.hold(block)
        nodes = []
        if match.tier:
            assert self._tier_link is not None
            start = len(match.blocks)
            parent = node_of(match.blocks[-1]) if match.blocks else None
            data = token_bytes(token_ids[start * bs : (start + len(match.tier)) * bs])
            root = self._root(namespace)
            nodes = self._tier_link.reload(match.tier, parent, root, data)  # refs taken
        blocks = match.blocks + [node.block for node in nodes]
        n, link, kept = len(blocks) * bs, self._local_link, set(held)
        if link is not None:
            window = blocks[self.window_start(n) : (n - 1) // bs + 1] if n else []
            link.tier.touch([node_of(b).digest for b in window])  # type: ignore[union-attr]
        while n > 0 and link is not None:  # _fitted's walk, refilling what it can
            missing = -1
            for j in range((n - 1) // bs, self.window_start(n) - 1, -1):
                block = blocks[j]
                if block in kept:
                    continue
                if local.page_of[block] != NULL_PAGE:
                    local.hold(block)  # a window moved back by a lost entry
                elif not (local.num_available and link.reload(node_of(block), local)):  # type: ignore[arg-type]
                    missing = j
                    break
                held.append(block)
                kept.add(block)
            if missing < 0:
                break
            n = missing * bs
        for block in held:  # idle, until the table holds them
            local.release(block)
        self.release(blocks)
        with self._pool_only():  # what the prefetch left there, honoured as allocate will
            pooled = super().match(token_ids, namespace, match.num_tokens)
            pooled = self.honoured(self._fitted(pooled))
        if not self.can_allocate(pooled, num_tokens):  # else the same tokens are covered
            num_tokens -= match.num_tokens - pooled.num_tokens
            if not self.can_allocate(pooled, num_tokens):  # a window that holds more pages
                num_tokens -= pooled.num_tokens
                pooled = PrefixMatch([], None, 0, bs)
        reloaded = max(0, min(len(pooled.blocks), len(blocks)) - len(match.blocks)) * bs
        return pooled, num_tokens, reloaded

    def _copy_both(self, src: int, dst: int, num_tokens: int) -> None:
        assert self._copy_global is not None
        self._copy_global(src, dst, num_tokens)
        local_src, local_dst = self.local.page_of[src], self.local.page_of[dst]
        assert local_src != NULL_PAGE and local_dst != NULL_PAGE
        if self._copy_local is not None:
            self._copy_local(local_src, local_dst, num_tokens)
        # allocate's hold on the source (so dst's page could not be it) ends before the
        self.local.release(src)  # table's later blocks are taken: they may evict the source

    # ---- the KV tier: local pages spill with their block, or alone under local pressure

    def _take_reload_block(self) -> int:
        block = self._take_block()
        self.local.drop(block)  # refilled for the window only (``_prefetch``)
        return block

    def _evict(
        self, block: int, cause: str = "pressure", spill: bool = True, wait: bool = False
    ) -> None:
        page, node, link = self.local.page_of[block], self._tree.node_of(block), self._local_link
        assert node is not None
        if spill and page != NULL_PAGE and link is not None:
            link.spill(node, page, self.local.is_interior(block), wait)
        super()._evict(block, cause, spill, wait)
        if link is not None and self.tier is not None and node.digest not in self.tier:
            link.tier.discard(node.digest)  # of no use without the block's global KV

    def _tier_dropped(self, digest: bytes) -> None:
        super()._tier_dropped(digest)
        if self._local_link is not None and self._tree.can_insert(digest):  # not in the pool
            self._local_link.tier.discard(digest)  # of no use without the block's global KV

    def _spill_detached(self, block: int, page: int, interior: bool) -> None:
        node = self._tree.node_of(block)
        if node is not None and self._local_link is not None:
            self._local_link.spill(node, page, interior)

    def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        count = super().evict_all(include_pinned, keep_tier)
        if self._local_link is not None and not keep_tier:
            self._local_link.tier.clear()
        return count

    # ---- progress: commit, slide, free

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        start = table.num_committed_blocks
        before = table.block_ids[start:]
        super().commit(table, token_ids, num_computed)
        if self._orphans:  # dedupe re-pointed blocks: their held local pages follow
            for i, old in enumerate(before):
                new = table.block_ids[start + i]
                if new != old:
                    page = self._orphans.pop(old, NULL_PAGE)
                    if page != NULL_PAGE:  # else out of the window already: it was not held
                        self.local.rehome(page, new)
            assert not self._orphans
        self.slide(table, num_computed)

    def slide(self, table: BlockTable, num_computed: int) -> None:
        """Release the holds on the blocks that slid wholly out of the window: a prompt's
        interior goes behind, but for the window of the hit it made (a shared prefix's end,
        which the next request with that prefix reads)."""
        end = min(self.window_start(num_computed), len(table.block_ids))
        release, interior = self.local.release, table.num_interior_blocks
        hit = table.num_cached_tokens  # (a prompt of exactly it reads a block earlier)
        shared = range(self.window_start(max(hit - 1, 0)), -(-hit // self.block_size))
        for j in range(table.num_released_blocks, end):
            release(table.block_ids[j], behind=j < interior and j not in shared)
        table.num_released_blocks = max(table.num_released_blocks, end)

    def free(self, table: BlockTable) -> None:
        release = self.local.release
        for block in table.block_ids[table.num_released_blocks :]:  # first first: a prefix's
            release(block)  # last window is its most useful one, so it is detached last
        table.num_released_blocks = 0
        super().free(table)
        assert not self._orphans

    # ---- stats and checks

    def stats(self) -> ManagerStats:
        s = super().stats()
        s.num_local_pages = self.local.num_pages - 1
        s.num_local_held = self.local.num_held
        s.num_local_idle = self.local.num_idle
        return s

    def check_invariants(self) -> None:
        super().check_invariants()
        self.local.check()
        if self._local_link is not None:
            self._local_link.tier.check()
            assert self.tier is not None
            for digest in self._local_link.tier:
                assert digest in self.tier or not self._tree.can_insert(digest), (
                    "a local tier entry without its block's global KV"
                )
        assert not self._orphans
        pool, page_of = self._pool, self.local.page_of
        for block in range(self.num_blocks):
            if pool.ref_count[block] == 0 and not pool.cached[block]:
                assert page_of[block] == NULL_PAGE, f"free block {block} keeps a local page"
