"""A hybrid manager's pins: the order its pinned local pages leave in, and saved blocks
(``pinned_blocks.py``) restored with their local page where the file has it, else none."""

from __future__ import annotations

from collections.abc import Callable

from ..block_manager import BlockManager
from ..prefix_tree import Node
from .local_pages import NULL_PAGE, LocalPages


class HybridPins(BlockManager):
    """``HybridBlockManager``'s base: what pinning and restoring do to local pages."""

    local: LocalPages

    def pin_path(self, node: Node, count: int) -> None:
        """``BlockPins.pin_path`` pins deepest first; the local pages of the blocks pinned or
        unpinned by it are then moved root first, so a pinned prefix's last window (what a hit
        on it reads) is taken last. Blocks already pinned (a prefix shared by two pins) keep
        their place."""
        path = list(node.path_up())
        pin_count = self._pool.pin_count
        was_pinned = [pin_count[step.block] > 0 for step in path]
        super().pin_path(node, count)
        for step, was in zip(reversed(path), reversed(was_pinned), strict=True):
            if (pin_count[step.block] > 0) != was:
                self.local.repin(step.block)

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

        return super().cache_block(parent, root, tokens, fill_both)

    def _can_restore_page(self) -> bool:
        return super()._can_restore_page() and self.local.num_available_unpinned > 0

    def fill_local(self, block: int, write: Callable[[int], None]) -> bool:
        """Give a cached block without a local page one that ``write(page)`` fills (idle
        after); False when it has one already or none is free or idle."""
        if self.local.page_of[block] != NULL_PAGE or not self.local.num_available_unpinned:
            return False
        page = self.local.attach(block)
        try:
            write(page)
        except BaseException:
            self.local.drop(block)
            raise
        self.local.release(block)
        return True
