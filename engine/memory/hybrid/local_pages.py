"""Hybrid models (sliding-window + global layers): the sliding layers' local pages.

Global layers keep the block manager's pages (block id = global page). Sliding layers get a
smaller pool of *local pages* (page 0: the null page), one per block while its global page
lives; a table *holds* those of its window, an idle one stays attached (LRU) until the pool
is short (``manager.py`` drives them). Design: docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..block_pool import BlockPool
from ..block_types import OutOfBlocksError

NULL_PAGE = 0


class LocalPages:
    """Local pages: free, held (by ``holders`` tables) or idle (attached, LRU). Three LRUs of
    idle pages, taken in turn: *behind* (a prompt's interior, more than a window before its
    end, which only a hit diverging inside that prompt could use), then plain idle (the last
    window of a prompt or of a finished sequence: what a hit on it needs), then the pages of
    pinned blocks (``is_pinned``)."""

    __slots__ = (
        "_behind",
        "_free",
        "_idle",
        "_idle_pinned",
        "block_of",
        "holders",
        "is_pinned",
        "num_detached",
        "num_pages",
        "on_detach",
        "page_of",
    )

    def __init__(self, num_pages: int, num_blocks: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a local pool needs the null page and one more, got {num_pages}")
        self.num_pages = num_pages
        self.page_of: list[int] = [NULL_PAGE] * num_blocks
        self.block_of: list[int] = [-1] * num_pages
        self.holders: list[int] = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # lowest page on top
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._behind: OrderedDict[int, None] = OrderedDict()
        self._idle_pinned: OrderedDict[int, None] = OrderedDict()
        self.is_pinned: Callable[[int], bool] = lambda block: False
        self.num_detached = 0  # idle pages taken from their block under local pressure
        # (block, page, a prompt's interior?): an idle page about to go, its KV still intact
        self.on_detach: Callable[[int, int, bool], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle(self) -> int:
        return len(self._idle) + len(self._behind) + len(self._idle_pinned)

    @property
    def num_available(self) -> int:
        return len(self._free) + self.num_idle

    @property
    def num_available_unpinned(self) -> int:
        """Free pages and idle ones not of a pinned block (what a restore may take)."""
        return len(self._free) + len(self._idle) + len(self._behind)

    @property
    def num_held(self) -> int:
        return self.num_pages - 1 - self.num_available

    def attach(self, block: int) -> int:
        """A page for a freshly taken block, held once (by its taker): a free page, else the
        LRU idle page, detached from its block."""
        assert self.page_of[block] == NULL_PAGE, f"block {block} already has a local page"
        if self._free:
            page = self._free.pop()
        elif self._behind or self._idle or self._idle_pinned:
            lru = self._behind or self._idle or self._idle_pinned
            page, _ = lru.popitem(last=False)
            if self.on_detach is not None:
                self.on_detach(self.block_of[page], page, lru is self._behind)
            self.page_of[self.block_of[page]] = NULL_PAGE
            self.num_detached += 1
        else:
            raise OutOfBlocksError("no free or idle local page")
        self.page_of[block], self.block_of[page], self.holders[page] = page, block, 1
        return page

    def drop(self, block: int) -> None:
        """Free a page its taker alone holds whose KV will not be written (a block restored
        or reloaded without its sliding layers' KV): no hit may count on it."""
        page = self.page_of[block]
        assert page != NULL_PAGE and self.holders[page] == 1, f"block {block}: not a fresh page"
        self.page_of[block], self.block_of[page], self.holders[page] = NULL_PAGE, -1, 0
        self._free.append(page)

    def is_interior(self, block: int) -> bool:
        """Whether the block's idle page is a prompt's interior (the LRU taken first)."""
        return self.page_of[block] in self._behind

    def hold(self, block: int) -> None:
        page = self.page_of[block]
        assert page != NULL_PAGE, f"block {block} has no local page"
        if self.holders[page] == 0:
            self._unidle(page)
        self.holders[page] += 1

    def release(self, block: int, behind: bool = False) -> None:
        """Let go of one hold; the last one makes the page idle (``behind``: in the LRU taken
        first, for a prompt's interior)."""
        page = self.page_of[block]
        assert page != NULL_PAGE and self.holders[page] > 0, f"block {block}: no hold to release"
        self.holders[page] -= 1
        if self.holders[page] == 0:
            lru = self._idle_list(block)
            (self._behind if behind and lru is self._idle else lru)[page] = None

    def repin(self, block: int) -> None:
        """The block's pin state changed: an idle page moves to the matching LRU's tail."""
        page = self.page_of[block]
        if page != NULL_PAGE and self.holders[page] == 0:
            self._unidle(page)
            self._idle_list(block)[page] = None

    def _idle_list(self, block: int) -> OrderedDict[int, None]:
        return self._idle_pinned if self.is_pinned(block) else self._idle

    def _unidle(self, page: int) -> None:
        for lru in (self._idle, self._behind, self._idle_pinned):
            if lru.pop(page, 1) is None:
                return
        raise AssertionError(f"local page {page} is not idle")

    def block_freed(self, block: int) -> int:
        """The block's global page went back to the free list: free its local page. Returns
        the page instead when a table still holds it (a commit's dedupe; ``rehome`` it)."""
        page = self.page_of[block]
        if page == NULL_PAGE:
            return NULL_PAGE
        self.page_of[block], self.block_of[page] = NULL_PAGE, -1
        if self.holders[page]:
            return page
        self._unidle(page)
        self._free.append(page)
        return NULL_PAGE

    def rehome(self, page: int, block: int) -> None:
        """A held page whose block was freed, its holder now on ``block`` (same tokens, same
        KV): ``block`` takes the page, or keeps its own and the hold moves there."""
        assert self.block_of[page] == -1
        if self.page_of[block] == NULL_PAGE:
            self.page_of[block], self.block_of[page] = page, block
            return
        assert self.holders[page] == 1
        self.hold(block)
        self.holders[page] = 0
        self._free.append(page)

    def check(self) -> None:
        free, idle, pinned = set(self._free), set(self._idle), set(self._idle_pinned)
        behind = set(self._behind)
        assert not (behind & (idle | pinned)) and not any(
            self.is_pinned(self.block_of[p]) for p in behind
        ), "a behind page is also idle, or pinned"
        idle |= behind
        assert not (idle & pinned)
        for page in idle | pinned:
            assert self.is_pinned(self.block_of[page]) == (page in pinned), f"local page {page}"
        idle |= pinned
        assert len(free) == len(self._free) and not (free & idle) and NULL_PAGE not in free
        for page in range(1, self.num_pages):
            block = self.block_of[page]
            if page in free:
                assert block == -1 and self.holders[page] == 0, f"free local page {page} in use"
                continue
            assert block >= 0 and self.page_of[block] == page, f"local page {page} leaked"
            assert (self.holders[page] == 0) == (page in idle), f"local page {page} hold/LRU"
        attached = sum(1 for p in self.page_of if p != NULL_PAGE)
        assert attached == self.num_pages - 1 - len(free), "block -> local page map is off"


class WatchedPool(BlockPool):
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
        if self.pin_count[block] == 1:  # pinned now: its idle page joins the pinned LRU
            self.local.repin(block)

    def unpin(self, block: int) -> None:
        super().unpin(block)
        if self.pin_count[block] == 0:
            self.local.repin(block)

    def deref(self, block: int) -> None:
        super().deref(block)
        if self.ref_count[block] == 0 and not self.cached[block]:
            self._freed(block)

    def _freed(self, block: int) -> None:
        page = self.local.block_freed(block)
        if page != NULL_PAGE:
            self.orphans[block] = page
