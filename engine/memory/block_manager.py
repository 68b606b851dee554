"""Sequence block tables over the block pool and the prefix tree.

A request's life, as the scheduler drives it::

    m = bm.match(prompt, ns, len(prompt) - 1)      read-only: no refs, no stats
    if bm.can_allocate(m, n): t = bm.allocate(prompt, ns, m, n)
    ... the model writes KV ...;  bm.commit(t, tokens, num_computed)
    bm.can_grow(t, n) / bm.grow(t, n)              chunked prefill, decode
    bm.free(t)                                     last block first

A table's leading ``num_committed_blocks`` are nodes of the tree (shared by ref count); the
rest are private. A block becomes visible to other requests only at ``commit``, after its KV is
written. A match ending inside a cached block copies its matching leading token slots into a
fresh private block (``copy_slots``), so reuse is token-granular with 16-token pages.

Eviction order without scans: every idle cached block sits in the pool's LRU list, and this
module keeps "descendants before ancestors" in it. A table holds a chain of tree blocks (a
block is committed only after its parent), so a parent is in use whenever a child is; tables
release their blocks last first, so a parent turns idle after its children; pinning touches a
whole path deepest first, and a pin covers every block above it. Hence the LRU head is always
a leaf, and evicting it is O(1); ``tree.remove`` asserts the leaf.

Pinning is the base class's (``block_pins.py``), the types ``block_types.py``'s; saving and
restoring pinned prefixes ``pinned_blocks.py``'s (``pinned_nodes``, ``cache_block``, ``pin_path``).

With a KV tier, evictions spill into it and a match continues through it; ``allocate`` reloads
those blocks (``tier_link.py``). Reloaded tokens count as hits and, apart, as
``reloaded_tokens``. A pin may carry a TTL (``ttl_pins.py``; ``clock`` is injectable for tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..paging import ceil_div
from .block_pins import BlockPins
from .block_pool import BlockPool
from .block_types import (
    BlockListener,
    BlockTable,
    CopySlots,
    ManagerStats,
    OutOfBlocksError,
    PrefixMatch,
)
from .page_invariants import check_pages
from .prefix_tree import TOKEN_BYTES, NewBlock, Node, PrefixTree, root_digest, token_bytes
from .tier_link import SPILL_POLICIES, TierLink
from .ttl_pins import TTLPins

if TYPE_CHECKING:
    from .kv_tier import KVTier


class BlockManager(BlockPins):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        identity: bytes,
        copy_slots: CopySlots | None = None,
        enable_caching: bool = True,
        tier: KVTier | None = None,
        spill_policy: str = "all",
        clock: Callable[[], float] = time.monotonic,
        listener: BlockListener | None = None,
    ) -> None:
        """``copy_slots(src, dst, k)`` copies a block's first k token slots of KV. Without it
        (an index-only manager) partial-block reuse is off. ``tier``: where evicted blocks'
        KV goes (``spill_policy`` "all", or "hit": only blocks hit at least once)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if spill_policy not in SPILL_POLICIES:
            raise ValueError(f"spill_policy must be one of {SPILL_POLICIES}, got {spill_policy!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.identity = identity
        self.enable_caching = enable_caching
        self._copy_slots = copy_slots
        self._pool = BlockPool(num_blocks)
        self._tree = PrefixTree(block_size, num_blocks)
        self._roots: dict[str, bytes] = {}
        self._stats = ManagerStats(num_blocks=num_blocks, block_size=block_size)
        self.listener = listener
        self._ttl = TTLPins(self.pin_path, clock)
        self._link_tier(tier, spill_policy)

    def _link_tier(self, tier: KVTier | None, spill_policy: str) -> None:
        """Spill into ``tier`` and match through it (hybrid: once its pool is in place)."""
        self.tier = tier if self.enable_caching else None
        self._tier_link = None
        if self.tier is not None:
            take = self._take_reload_block
            link = TierLink(
                self.tier, self._pool, self._tree, self.block_size, spill_policy, take, self._cache
            )
            self._tier_link = link
            self.tier.on_drop = self._tier_dropped

    # ---- counters

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_cached_idle_blocks(self) -> int:
        return self._pool.num_cached_idle

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used

    @property
    def num_pinned_blocks(self) -> int:
        return self._pool.num_pinned

    def ref_count(self, block: int) -> int:
        return self._pool.ref_count[block]

    def pin_count(self, block: int) -> int:
        return self._pool.pin_count[block]

    @property
    def tree(self) -> PrefixTree:
        """Read-only use (miss reasons, the cache view); changes go through this class."""
        return self._tree

    def root(self, namespace: str) -> bytes:
        return self._root(namespace)

    # ---- lookup

    def block_hashes(self, token_ids: Sequence[int], namespace: str) -> list[bytes]:
        n = len(token_ids) // self.block_size * self.block_size
        return self._tree.digests(self._root(namespace), token_bytes(token_ids[:n]))

    def match(self, token_ids: Sequence[int], namespace: str, max_tokens: int) -> PrefixMatch:
        bs = self.block_size
        max_tokens = min(max_tokens, len(token_ids))
        if not self.enable_caching or max_tokens <= 0:
            return PrefixMatch([], None, 0, bs)
        root = self._root(namespace)
        end = (max_tokens // bs + 1) * bs
        data = token_bytes(token_ids[:end] if end < len(token_ids) else token_ids)
        nodes = self._tree.walk(root, data, max_tokens // bs)
        blocks = [node.block for node in nodes]
        link = self._tier_link
        tier = link.match(nodes, root, data, max_tokens // bs) if link is not None else []
        if tier:
            return PrefixMatch(blocks, None, 0, bs, tier)
        matched = len(nodes) * bs
        partial, k = None, 0
        if self._copy_slots is not None:
            parent = nodes[-1] if nodes else None
            limit = min(max_tokens - matched, bs - 1)
            partial, k = self._tree.best_partial(parent, root, data[matched * TOKEN_BYTES :], limit)
        return PrefixMatch(blocks, partial.block if partial is not None else None, k, bs)

    # ---- allocation

    def can_allocate(self, match: PrefixMatch, num_tokens: int) -> bool:
        need = self._blocks_needed(match, num_tokens)
        available = self._pool.num_available
        if need <= available - len(match.blocks):
            return True
        ref = self._pool.ref_count
        return need <= available - sum(1 for b in match.blocks if ref[b] == 0)

    def allocate(
        self, token_ids: Sequence[int], namespace: str, match: PrefixMatch, num_tokens: int
    ) -> BlockTable:
        if not self.can_allocate(match, num_tokens):
            raise OutOfBlocksError(f"cannot allocate {num_tokens} tokens")
        assert match.num_tokens <= min(num_tokens, len(token_ids)), "match longer than the prompt"
        pool, tree, bs = self._pool, self._tree, self.block_size
        hashes = tree.digests_of(match.blocks)  # asserts the match is still valid
        pool.ref_all(match.blocks)
        if match.blocks:
            self._hit(match.blocks)
        if self._ttl and match.partial_block is not None and match.partial_tokens:
            self._ttl.renew(tree.node_of(match.partial_block))  # e.g. a warm of that very prefix
        table = BlockTable(
            namespace, list(match.blocks), len(match.blocks) * bs, len(match.blocks), hashes, bs
        )
        if match.tier:
            self._reload(table, token_ids, match.tier)
        src = match.partial_block
        if src is not None and match.partial_tokens > 0:
            # A cached node, or a live table's partly filled block (its written slots are final).
            assert tree.node_of(src) is not None or pool.ref_count[src] > 0, "stale partial source"
            pool.ref(src)  # keep it from being evicted into its own copy
            if pool.num_available > 0:
                dst = self._take_block()
                assert self._copy_slots is not None
                self._copy_slots(src, dst, match.partial_tokens)
                table.block_ids.append(dst)
                table.num_cached_tokens += match.partial_tokens
            pool.deref(src)
        self._extend(table, num_tokens)
        if "\x00" not in namespace:  # an engine-internal store's (chunk_reuse) is no lookup
            self._stats.query_tokens += len(token_ids)
            self._stats.hit_tokens += table.num_cached_tokens
            self._stats.reloaded_tokens += table.num_reloaded_tokens
        return table

    def _reload(self, table: BlockTable, token_ids: Sequence[int], digests: list[bytes]) -> None:
        assert self._tier_link is not None
        bs, start = self.block_size, len(table.block_ids)
        parent = self._tree.node_of(table.block_ids[-1]) if table.block_ids else None
        data = token_bytes(token_ids[start * bs : (start + len(digests)) * bs])
        nodes = self._tier_link.reload(digests, parent, self._root(table.namespace), data)
        table.block_ids += [node.block for node in nodes]
        table.hashes += [node.digest for node in nodes]
        table.num_committed_blocks = len(table.block_ids)
        table.num_cached_tokens += len(nodes) * bs
        table.num_reloaded_tokens += len(nodes) * bs

    def _hit(self, blocks: list[int]) -> None:
        """Count a hit on each matched node; renew the TTL pins along the prefix."""
        node_of, ttl = self._tree.node_of, self._ttl
        for block in blocks:
            node = node_of(block)
            assert node is not None
            node.hits += 1
            if ttl and node in ttl:
                ttl.renew(node)

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self._blocks_to_grow(table, num_tokens) <= self._pool.num_available

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        if not self.can_grow(table, num_tokens):
            raise OutOfBlocksError(f"cannot grow a table to {num_tokens} tokens")
        self._extend(table, num_tokens)

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Insert the full blocks among the first ``num_computed`` tokens (KV written)."""
        if not self.enable_caching:
            return
        bs, pool, tree = self.block_size, self._pool, self._tree
        start = table.num_committed_blocks
        end = min(num_computed, len(token_ids)) // bs
        end = min(end, len(table.block_ids))
        if start >= end:
            return
        root = self._root(table.namespace)
        data = token_bytes(token_ids[start * bs : end * bs])
        nbytes = bs * TOKEN_BYTES
        parent = tree.node_of(table.block_ids[start - 1]) if start else None
        assert start == 0 or (parent is not None and parent.digest == table.hashes[-1])
        for i in range(start, end):
            chunk = data[(i - start) * nbytes : (i - start + 1) * nbytes]
            block = table.block_ids[i]
            node, inserted = self._cache(parent, root, chunk, block)
            if node is None:
                break  # a digest collision: this block and the rest stay private
            if not inserted:  # dedupe: re-point the table first, then free the copy
                assert node.block != block and pool.ref_count[block] == 1
                pool.ref(node.block)
                table.block_ids[i] = node.block
                pool.deref(block)
            table.hashes.append(node.digest)
            table.num_committed_blocks = i + 1
            parent = node

    def free(self, table: BlockTable) -> None:
        self.release(table.block_ids)
        table.block_ids = []
        table.hashes = []
        table.num_committed_blocks = 0

    def release(self, blocks: list[int]) -> None:
        """Drop one ref on each block, last first (a chain's children turn idle first)."""
        deref = self._pool.deref
        for block in reversed(blocks):
            deref(block)

    # ---- eviction (pinning and restoring pinned blocks: block_pins.py)

    def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        """Evict every idle cached block, pinned ones too if asked; returns how many. The KV
        tier is emptied too, unless ``keep_tier`` (then the blocks spill into it)."""
        self._ttl.expire()  # a lapsed pin holds nothing, whether or not a step ran since
        if include_pinned:
            self.unpin_all()
        count = 0
        while (block := self._pool.oldest_idle(include_pinned=False)) is not None:
            self._evict(block, "admin", spill=keep_tier, wait=True)  # an admin call: it may wait
            count += 1
        if self.tier is not None and not keep_tier:
            self.tier.clear()
        return count

    def stats(self) -> ManagerStats:
        self._ttl.expire()
        s = self._stats
        return ManagerStats(
            query_tokens=s.query_tokens,
            hit_tokens=s.hit_tokens,
            reloaded_tokens=s.reloaded_tokens,
            inserted_tokens=s.inserted_tokens,
            evicted_tokens=s.evicted_tokens,
            num_free_blocks=self.num_free_blocks,
            num_cached_idle_blocks=self.num_cached_idle_blocks,
            num_used_blocks=self.num_used_blocks,
            num_pinned_blocks=self.num_pinned_blocks,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_ttl_pins=len(self._ttl),
        )

    def check_invariants(self) -> None:
        check_pages(self._pool, self._tree, self.num_blocks)
        self._ttl.check(self._tree.node_of)
        if self.tier is not None:
            self.tier.check()

    # ---- internals

    def _root(self, namespace: str) -> bytes:
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= 65536:
                self._roots.clear()
            root = self._roots[namespace] = root_digest(self.identity, namespace)
        return root

    def _walk(self, token_ids: Sequence[int], namespace: str) -> list[Node]:
        if not self.enable_caching:
            return []
        n = len(token_ids) // self.block_size
        data = token_bytes(token_ids[: n * self.block_size])
        return self._tree.walk(self._root(namespace), data, n)

    def _blocks_needed(self, match: PrefixMatch, num_tokens: int) -> int:
        bs = self.block_size
        total = max(ceil_div(num_tokens, bs), len(match.blocks) + (match.partial_tokens > 0))
        return total - len(match.blocks)

    def _blocks_to_grow(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, ceil_div(num_tokens, self.block_size) - len(table.block_ids))

    def _extend(self, table: BlockTable, num_tokens: int) -> None:
        for _ in range(self._blocks_to_grow(table, num_tokens)):
            table.block_ids.append(self._take_block())

    def _cache(
        self, parent: Node | None, root: bytes, tokens: bytes, block: int | NewBlock
    ) -> tuple[Node | None, bool]:
        """``tree.find_or_insert``, counting a new node's page as cached."""
        node, inserted = self._tree.find_or_insert(parent, root, tokens, block)
        if inserted:
            assert node is not None
            self._pool.mark_cached(node.block)
            self._stats.inserted_tokens += self.block_size
            if self.listener is not None:
                self.listener.block_stored(node, root)
        return node, inserted

    def _tier_dropped(self, digest: bytes) -> None:
        if self.listener is not None:
            assert self.tier is not None
            self.listener.tier_dropped(digest, self.tier.kind)

    def _take_block(self) -> int:
        """A fresh block with ref count 1: a free one first, else evict the LRU idle leaf."""
        block = self._pool.take_free()
        if block is None:
            self._ttl.expire()  # a lapsed pin's blocks go before pinned ones
            victim = self._pool.oldest_idle()
            if victim is None:
                raise OutOfBlocksError("no free or evictable block")
            self._evict(victim)
            block = self._pool.take_free()
            assert block == victim
        return block

    def _take_reload_block(self) -> int:
        """A fresh block for KV copied back from the tier."""
        return self._take_block()

    def _evict(
        self, block: int, cause: str = "pressure", spill: bool = True, wait: bool = False
    ) -> None:
        pinned = self._pool.pin_count[block] > 0
        node = self._tree.remove(block)  # asserts it is a leaf
        self._ttl.pass_on(node)
        if self._ttl.lapsed_at_eviction(node, pinned) and cause == "pressure":
            cause = "ttl"  # its retention pin expired, then a request needed the page
        spilled = spill and self._tier_link is not None and self._tier_link.spill(node, block, wait)
        if spilled and self.listener is not None:
            assert self.tier is not None
            self.listener.block_spilled(node, self.tier.kind)
        self._pool.evict(block)
        self._stats.evicted_tokens += self.block_size
        if self.listener is not None:
            self.listener.block_removed(node, cause)
