"""Pins on cached prefixes, the ``BlockManager``'s (a base class it inherits): plain pins
(counted per node, each covering its path up to the root), TTL pins (``ttl_pins.py``), and
``cache_block``, which caches a saved block again (``pinned_blocks.py`` restoring a file).

TTL pins lapse on time: every method here that reads or changes pins expires the lapsed ones
first (so do the manager's stats, evict and page taking), and ``next_pin_lapse`` tells an idle
serving loop when to look again.

A pin goes on deepest first and comes off the same way, which keeps children before parents in
the pool's LRU (block_manager.py's eviction order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .block_pool import BlockPool
from .prefix_tree import NewBlock, Node, PrefixTree
from .ttl_pins import TTLPin, TTLPins


class BlockPins:
    """Pinning for ``BlockManager``: it provides the pool, the tree, the TTL pins, ``_walk``
    (a prefix's cached full blocks), ``_take_block`` and ``_cache``."""

    _pool: BlockPool
    _tree: PrefixTree
    _ttl: TTLPins

    def _walk(self, token_ids: Sequence[int], namespace: str) -> list[Node]:
        raise NotImplementedError

    def _take_block(self) -> int:
        raise NotImplementedError

    def _cache(
        self, parent: Node | None, root: bytes, tokens: bytes, block: int | NewBlock
    ) -> tuple[Node | None, bool]:
        raise NotImplementedError

    def pin(
        self,
        token_ids: Sequence[int],
        namespace: str,
        ttl_s: float | None = None,
        max_blocks: int | None = None,
    ) -> int:
        """Pin the cached full blocks of this prefix; returns how many blocks it covers.

        ``ttl_s``: the pin lapses after that long unless renewed (a hit on the prefix, or
        pinning it again, which adds no second pin). ``max_blocks``: a cap on the blocks this
        namespace's TTL pins cover together; the pin is cut short to fit (0: nothing left)."""
        self._ttl.expire()  # a lapsed pin is gone: pinning again makes a new one
        nodes = self._walk(token_ids, namespace)
        if ttl_s is None:
            if nodes:
                self.pin_path(nodes[-1], 1)
            return len(nodes)
        return self._ttl.pin(nodes, namespace, ttl_s, max_blocks)

    def unpin(self, token_ids: Sequence[int], namespace: str) -> int:
        """Undo the deepest pin along this prefix; returns how many blocks it covered."""
        self._ttl.expire()
        nodes = self._walk(token_ids, namespace)
        depth = next((i + 1 for i in range(len(nodes) - 1, -1, -1) if nodes[i].own_pins), 0)
        if depth:
            node = nodes[depth - 1]
            self._ttl.forget(node)  # the TTL pin goes first
            self.pin_path(node, -1)
        return depth

    def unpin_all(self) -> int:
        """Drop every pin (e.g. prefixes loaded under another namespace secret); returns how
        many prefixes were pinned."""
        pinned = self.pinned_nodes()
        for node in pinned:
            self.pin_path(node, -node.own_pins)
        self._ttl.clear()
        return len(pinned)

    def expire_pins(self) -> int:
        """Lift the TTL pins whose deadline passed; returns how many."""
        return self._ttl.expire()

    def next_pin_lapse(self) -> float | None:
        """Seconds until the earliest TTL pin may lapse (0.0: due now); None: no TTL pins."""
        return self._ttl.next_lapse()

    def ttl_pin_of(self, token_ids: Sequence[int], namespace: str) -> TTLPin | None:
        """The TTL pin ending where this prefix's cached full blocks end, if any."""
        self._ttl.expire()
        nodes = self._walk(token_ids, namespace)
        return self._ttl.get(nodes[-1]) if nodes else None

    def ttl_time_left(self) -> list[tuple[Node, float]]:
        """The nodes where a TTL pin ends, each with the seconds before it lapses (the cache
        view)."""
        self._ttl.expire()
        return self._ttl.time_left() if self._ttl else []

    def pin_path(self, node: Node, count: int) -> None:
        """Add ``count`` pins (remove, if negative) ending at ``node``; a pin covers every block
        from there up to the root, and goes on deepest first, which keeps children before
        parents in the LRU."""
        node.own_pins += count
        change = self._pool.pin if count > 0 else self._pool.unpin
        for step in node.path_up():
            for _ in range(abs(count)):
                change(step.block)

    def pinned_nodes(self) -> list[Node]:
        """The nodes where a pinned prefix ends."""
        self._ttl.expire()
        return [node for node in self._tree.nodes() if node.own_pins]

    def _can_restore_page(self) -> bool:
        """A page for a restored block is free, or an idle unpinned block's to evict."""
        return self._pool.num_available_unpinned > 0

    def cache_block(
        self, parent: Node | None, root: bytes, tokens: bytes, fill: Callable[[int], None]
    ) -> tuple[Node | None, bool]:
        """Find the block ``tokens`` under ``parent`` (None: under ``root``), or cache it on a
        new page that ``fill(page)`` writes, and take a ref on it (``release`` drops it); says
        whether it is new. A page comes from the free list or by evicting an idle unpinned
        block, never from a running request or a pinned prefix. None: no such page, or a
        digest collision."""

        def new_page() -> int | None:
            if not self._can_restore_page():
                return None
            page = self._take_block()
            try:
                fill(page)
            except BaseException:
                self._pool.deref(page)  # not cached yet: back to the free list
                raise
            return page

        node, inserted = self._cache(parent, root, tokens, new_page)
        if node is not None and not inserted:
            self._pool.ref(node.block)  # an idle parent must not be evicted for its child
        return node, inserted
