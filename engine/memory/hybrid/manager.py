"""The hybrid models' block manager: ``BlockManager`` plus the local pages of one sliding
window. A hit of length L needs the local pages covering keys [L - w + 1, L - 1]
(``HybridBlockManager.fit``). Design and invariants: docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..block_manager import BlockManager
from ..block_pool import BlockPool
from ..block_types import (
    BlockListener,
    BlockTable,
    CopySlots,
    ManagerStats,
    OutOfBlocksError,
    PrefixMatch,
)
from ..prefix_tree import Node
from .local_pages import NULL_PAGE, LocalPages


class _WatchedPool(BlockPool):
    """The block pool, telling the local pages when a global page is taken or freed."""

    def __init__(self, num_blocks: int, local: LocalPages, orphans: dict[int, int]) -> None:
        super().__init__(num_blocks)
        self.local, self.orphans = local, orphans

    def take_free(self) -> int | None:
        if not self.num_free:
            return None
        if not self.local.num_available:
            raise OutOfBlocksError("no free or idle local page")
        block = super().take_free()
        assert block is not None
        self.local.attach(block)
        return block

    def evict(self, block: int) -> None:
        super().evict(block)
        self._freed(block)

    def pin(self, block: int) -> None:
        super().pin(block)
        self.local.repin(block)

    def unpin(self, block: int) -> None:
        super().unpin(block)
        self.local.repin(block)

    def deref(self, block: int) -> None:
        super().deref(block)
        if self.ref_count[block] == 0 and not self.cached[block]:
            self._freed(block)

    def _freed(self, block: int) -> None:
        page = self.local.block_freed(block)
        if page != NULL_PAGE:
            self.orphans[block] = page


class HybridBlockManager(BlockManager):
    """``BlockManager`` plus the local pages of one sliding window (no KV tier)."""

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
    ) -> None:
        """``copy_local_slots(src, dst, k)`` copies local pages' first k slots."""
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
        )
        self.window = window
        self.local = LocalPages(num_local_pages, num_blocks)
        self._orphans: dict[int, int] = {}
        self._pool = pool = _WatchedPool(num_blocks, self.local, self._orphans)
        self.local.is_pinned = lambda block: pool.pin_count[block] > 0
        self._copy_global, self._copy_local = copy_slots, copy_local_slots
        self._copy_slots = self._copy_both if copy_slots is not None else None
        self.shrunk_tokens = 0  # hit tokens given up because a window was incomplete

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
        bs, page_of, blocks = self.block_size, self.local.page_of, match.blocks
        partial = match.partial_block if match.partial_tokens else None
        n = match.num_tokens
        while n > 0:
            missing = -1
            for j in range((n - 1) // bs, self.window_start(n) - 1, -1):
                block = blocks[j] if j < len(blocks) else partial
                assert block is not None
                if page_of[block] == NULL_PAGE:
                    missing = j
                    break
            if missing < 0:
                break
            n = missing * bs  # every shorter hit ending after block `missing` still sees it
        if n == match.num_tokens:
            return match
        return PrefixMatch(blocks[: n // bs], None, 0, bs)

    def hit_window(self, blocks: list[int]) -> list[int]:
        """The blocks whose local pages a hit over these cached full blocks reads, once
        ``fit`` has shortened it to a complete window (what saving a prefix must keep)."""
        return self._window_blocks(self._fitted(PrefixMatch(blocks, None, 0, self.block_size)))

    def _window_blocks(self, match: PrefixMatch) -> list[int]:
        n = match.num_tokens
        if n == 0:
            return []
        blocks = match.blocks + ([match.partial_block] if match.partial_block is not None else [])
        return blocks[self.window_start(n) : (n - 1) // self.block_size + 1]

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
        return self._blocks_needed(match, num_tokens) + idle <= self.local.num_available

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        need = self._blocks_to_grow(table, num_tokens)
        return need <= self._pool.num_available and need <= self.local.num_available

    def allocate(
        self, token_ids: Sequence[int], namespace: str, match: PrefixMatch, num_tokens: int
    ) -> BlockTable:
        if not self.can_allocate(match, num_tokens):
            raise OutOfBlocksError(f"cannot allocate {num_tokens} tokens")
        match = self.honoured(match)
        window = self._window_blocks(match)
        assert all(self.local.page_of[b] for b in window), "a hit with an incomplete window"
        for block in window:  # held before any page is taken: none of them is detached
            self.local.hold(block)
        table = super().allocate(token_ids, namespace, match, num_tokens)  # copies a partial:
        assert table.num_cached_tokens == match.num_tokens  # _copy_both released its source
        table.num_released_blocks = self.window_start(table.num_cached_tokens)
        table.num_interior_blocks = self.window_start(len(token_ids))
        return table

    def _copy_both(self, src: int, dst: int, num_tokens: int) -> None:
        assert self._copy_global is not None
        self._copy_global(src, dst, num_tokens)
        local_src, local_dst = self.local.page_of[src], self.local.page_of[dst]
        assert local_src != NULL_PAGE and local_dst != NULL_PAGE
        if self._copy_local is not None:
            self._copy_local(local_src, local_dst, num_tokens)
        # allocate's hold on the source (so dst's page could not be it) ends before the
        self.local.release(src)  # table's later blocks are taken: they may evict the source

    # ---- restoring saved blocks (pinned_blocks.py): their local pages when saved, else none

    def cache_block(
        self, parent: Node | None, root: bytes, tokens: bytes, fill: Callable[[int], None]
    ) -> tuple[Node | None, bool]:
        """``BlockManager.cache_block``; ``fill(page)`` writes the global page and either the
        block's local page (``local.page_of[page]``) or drops it (``local.drop``); a kept one
        turns idle. No local page left: skipped, as when no global page is."""

        def fill_both(page: int) -> None:
            fill(page)
            if self.local.page_of[page] != NULL_PAGE:
                self.local.release(page)

        try:
            return super().cache_block(parent, root, tokens, fill_both)
        except OutOfBlocksError:  # take_free found no local page: nothing was taken
            return None, False

    def fill_local(self, block: int, write: Callable[[int], None]) -> bool:
        """Give a cached block without a local page one that ``write(page)`` fills (idle
        after); False when it has one already or none is free or idle."""
        if self.local.page_of[block] != NULL_PAGE or not self.local.num_available:
            return False
        page = self.local.attach(block)
        try:
            write(page)
        except BaseException:
            self.local.drop(block)
            raise
        self.local.release(block)
        return True

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
        """Release the holds on the blocks that slid wholly out of the window."""
        end = min(self.window_start(num_computed), len(table.block_ids))
        release, interior = self.local.release, table.num_interior_blocks
        for j in range(table.num_released_blocks, end):
            release(table.block_ids[j], behind=j < interior)
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
        assert not self._orphans
        pool, page_of = self._pool, self.local.page_of
        for block in range(self.num_blocks):
            if pool.ref_count[block] == 0 and not pool.cached[block]:
                assert page_of[block] == NULL_PAGE, f"free block {block} keeps a local page"
