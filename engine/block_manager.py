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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .prefix_tree import Node, PrefixTree, root_digest, token_bytes

CopySlots = Callable[[int, int, int], None]
WriteBlock = Callable[[int, int], None]  # (index in the saved list, page): fill the page's KV


class OutOfBlocksError(RuntimeError):
    """The pool cannot serve the request; call the matching ``can_*`` first."""


@dataclass(slots=True)
class PrefixMatch:
    blocks: list[int]  # cached full blocks of the longest prefix, in order
    partial_block: int | None  # next cached block whose leading tokens also match
    partial_tokens: int  # how many of its leading tokens match (0 if none)
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.partial_tokens


@dataclass(slots=True)
class BlockTable:
    namespace: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens reused from the cache at allocation (full + partial)
    num_committed_blocks: int  # leading blocks already in the tree (shared or inserted)
    hashes: list[bytes] = field(default_factory=list)  # digests of the committed blocks
    block_size: int = 16

    @property
    def num_slots(self) -> int:
        return len(self.block_ids) * self.block_size


@dataclass(slots=True, frozen=True)
class SavedBlock:
    """One block of a pinned prefix as it goes to disk; a list has parents before children."""

    root: bytes  # the namespace root digest (identity + namespace) when parent is -1, else b""
    parent: int  # index of the parent block in the list, -1 under the root
    tokens: bytes  # the block's token ids, uint32 bytes
    pins: int  # pins whose prefix ends at this block
    page: int  # where its KV lives now (on save)


@dataclass(slots=True, frozen=True)
class RestoreResult:
    restored_blocks: int  # pages filled from the saved KV
    reused_blocks: int  # already cached here: nothing to copy
    skipped_blocks: int  # no page free or evictable (or under a skipped parent)
    pinned_prefixes: int  # saved pins applied (a prefix pinned here already is left as is)


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    num_free_blocks: int = 0
    num_cached_idle_blocks: int = 0
    num_used_blocks: int = 0
    num_pinned_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        identity: bytes,
        copy_slots: CopySlots | None = None,
        enable_caching: bool = True,
    ) -> None:
        """``copy_slots(src, dst, k)`` copies a block's first k token slots of KV. Without it
        (an index-only manager) partial-block reuse is off and ``fork`` cannot copy."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.identity = identity
        self.enable_caching = enable_caching
        self._copy_slots = copy_slots
        self._pool = BlockPool(num_blocks)
        self._tree = PrefixTree(block_size, num_blocks)
        self._roots: dict[str, bytes] = {}
        self._stats = CacheStats(num_blocks=num_blocks, block_size=block_size)

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
        matched = len(nodes) * bs
        partial, k = None, 0
        if self._copy_slots is not None:
            parent = nodes[-1] if nodes else None
            limit = min(max_tokens - matched, bs - 1)
            partial, k = self._tree.best_partial(parent, root, data[matched * 4 :], limit)
        blocks = [node.block for node in nodes]
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
        table = BlockTable(
            namespace, list(match.blocks), len(match.blocks) * bs, len(match.blocks), hashes, bs
        )
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
        self._stats.query_tokens += len(token_ids)
        self._stats.hit_tokens += table.num_cached_tokens
        return table

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
        nbytes = bs * 4
        parent_digest = table.hashes[-1] if start else root
        parent = tree.node_of(table.block_ids[start - 1]) if start else None
        assert start == 0 or (parent is not None and parent.digest == parent_digest)
        for i in range(start, end):
            chunk = data[(i - start) * nbytes : (i - start + 1) * nbytes]
            block = table.block_ids[i]
            kids = tree.children(parent, root)
            node = kids.by_tokens.get(chunk) if kids is not None else None
            if node is not None:  # dedupe: re-point the table first, then free the copy
                assert node.block != block and pool.ref_count[block] == 1
                pool.ref(node.block)
                table.block_ids[i] = node.block
                pool.deref(block)
            else:
                digest = tree.digest(parent_digest, chunk)
                if not tree.can_insert(digest):
                    break  # a digest collision: this block and the rest stay private
                node = tree.insert(parent, root, digest, chunk, block)
                pool.mark_cached(block)
                self._stats.inserted_tokens += bs
            table.hashes.append(node.digest)
            table.num_committed_blocks = i + 1
            parent_digest, parent = node.digest, node

    def free(self, table: BlockTable) -> None:
        deref = self._pool.deref
        for block in reversed(table.block_ids):
            deref(block)
        table.block_ids = []
        table.hashes = []
        table.num_committed_blocks = 0

    def can_fork(self, table: BlockTable) -> bool:
        return len(table.block_ids) - table.num_committed_blocks <= self._pool.num_available

    def fork(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> BlockTable:
        """A new table sharing ``table``'s committed blocks; the first ``num_tokens`` slots of
        its private blocks are copied into fresh ones."""
        if not self.can_fork(table):
            raise OutOfBlocksError("cannot fork a table")
        bs, committed = self.block_size, table.num_committed_blocks
        assert num_tokens <= min(len(token_ids), table.num_slots)
        if num_tokens > committed * bs and self._copy_slots is None:
            raise RuntimeError("fork needs copy_slots to copy private blocks")
        for block in table.block_ids[:committed]:
            self._pool.ref(block)
        new = BlockTable(
            table.namespace,
            table.block_ids[:committed],
            num_tokens,
            committed,
            list(table.hashes),
            bs,
        )
        for i in range(committed, len(table.block_ids)):
            dst = self._take_block()
            k = min(bs, num_tokens - i * bs)
            if k > 0:
                assert self._copy_slots is not None
                self._copy_slots(table.block_ids[i], dst, k)
            new.block_ids.append(dst)
        return new

    # ---- pinning and eviction

    def pin(self, token_ids: Sequence[int], namespace: str) -> int:
        """Pin the cached full blocks of this prefix; returns how many blocks it covers."""
        nodes = self._walk(token_ids, namespace)
        if not nodes:
            return 0
        nodes[-1].own_pins += 1
        for node in reversed(nodes):  # deepest first keeps children before parents in the LRU
            self._pool.pin(node.block)
        return len(nodes)

    def unpin(self, token_ids: Sequence[int], namespace: str) -> int:
        """Undo the deepest pin along this prefix; returns how many blocks it covered."""
        nodes = self._walk(token_ids, namespace)
        depth = next((i + 1 for i in range(len(nodes) - 1, -1, -1) if nodes[i].own_pins), 0)
        if depth == 0:
            return 0
        nodes[depth - 1].own_pins -= 1
        for node in reversed(nodes[:depth]):
            self._pool.unpin(node.block)
        return depth

    # ---- saving pinned prefixes and restoring them

    def pinned_blocks(self) -> list[SavedBlock]:
        """Every cached block on a pinned prefix, each once, parents before children."""
        index: dict[Node, int] = {}
        out: list[SavedBlock] = []
        for node in self._tree.nodes():
            if not node.own_pins:
                continue
            chain: list[Node] = []
            walk: Node | None = node
            while walk is not None and walk not in index:
                chain.append(walk)
                walk = walk.parent
            for n in reversed(chain):
                parent = -1 if n.parent is None else index[n.parent]
                root = n.parent_digest if n.parent is None else b""
                index[n] = len(out)
                out.append(SavedBlock(root, parent, n.tokens, n.own_pins, n.block))
        return out

    def restore(self, saved: list[SavedBlock], write: WriteBlock) -> RestoreResult:
        """Cache saved blocks (parents first) that are not cached yet, filling each new page
        with ``write(index, page)``, then re-apply their pins. Pages come from the free list or
        by evicting idle unpinned blocks, never from running requests or pinned prefixes."""
        if not self.enable_caching:
            return RestoreResult(0, 0, len(saved), 0)
        tree, pool = self._tree, self._pool
        nodes: list[Node | None] = []
        held: list[int] = []  # one ref on every restored or reused page until the end
        restored = reused = 0
        try:
            for i, item in enumerate(saved):
                parent = nodes[item.parent] if 0 <= item.parent < len(nodes) else None
                if item.parent >= 0 and parent is None:
                    nodes.append(None)
                    continue
                parent_digest = parent.digest if parent is not None else item.root
                kids = tree.children(parent, item.root)
                node = kids.by_tokens.get(item.tokens) if kids is not None else None
                if node is not None:
                    pool.ref(node.block)  # an idle parent must not be evicted for its child
                    reused += 1
                else:
                    digest = tree.digest(parent_digest, item.tokens)
                    if not tree.can_insert(digest) or not pool.num_available_unpinned:
                        nodes.append(None)
                        continue
                    block = self._take_block()
                    try:
                        write(i, block)
                    except BaseException:
                        pool.deref(block)  # not cached yet: back to the free list
                        raise
                    node = tree.insert(parent, item.root, digest, item.tokens, block)
                    pool.mark_cached(block)
                    self._stats.inserted_tokens += self.block_size
                    restored += 1
                held.append(node.block)
                nodes.append(node)
        finally:
            for block in reversed(held):  # children turn idle before their parents
                pool.deref(block)
        pinned = 0
        for item, node in zip(saved, nodes, strict=True):
            if node is None or not item.pins or node.own_pins:
                continue
            node.own_pins += item.pins
            walk: Node | None = node
            while walk is not None:  # deepest first, as pin()
                for _ in range(item.pins):
                    pool.pin(walk.block)
                walk = walk.parent
            pinned += 1
        return RestoreResult(restored, reused, len(saved) - restored - reused, pinned)

    def unpin_all(self) -> int:
        """Drop every pin (e.g. prefixes loaded under another namespace secret); returns how
        many prefixes were pinned."""
        pinned = [node for node in self._tree.nodes() if node.own_pins]
        for node in pinned:
            count, node.own_pins = node.own_pins, 0
            walk: Node | None = node
            while walk is not None:  # deepest first, as unpin()
                for _ in range(count):
                    self._pool.unpin(walk.block)
                walk = walk.parent
        return len(pinned)

    def evict_all(self, include_pinned: bool = False) -> int:
        """Evict every idle cached block, pinned ones too if asked; returns how many."""
        if include_pinned:
            self.unpin_all()
        count = 0
        while (block := self._pool.oldest_idle(include_pinned=False)) is not None:
            self._evict(block)
            count += 1
        return count

    def stats(self) -> CacheStats:
        s = self._stats
        return CacheStats(
            query_tokens=s.query_tokens,
            hit_tokens=s.hit_tokens,
            inserted_tokens=s.inserted_tokens,
            evicted_tokens=s.evicted_tokens,
            num_free_blocks=self.num_free_blocks,
            num_cached_idle_blocks=self.num_cached_idle_blocks,
            num_used_blocks=self.num_used_blocks,
            num_pinned_blocks=self.num_pinned_blocks,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )

    def check_invariants(self) -> None:
        pool, tree = self._pool, self._tree
        pool.check()
        tree.check()
        assert pool.num_free + pool.num_cached_idle + pool.num_used == self.num_blocks
        pins: dict[int, int] = {}
        for node in tree.nodes():
            assert pool.cached[node.block]
            if pool.ref_count[node.block] > 0 and node.parent is not None:
                assert pool.ref_count[node.parent.block] > 0, "in-use block under an idle parent"
            cur: Node | None = node if node.own_pins else None  # a pin covers all above it
            while cur is not None:
                pins[cur.block] = pins.get(cur.block, 0) + node.own_pins
                cur = cur.parent
        assert sum(pool.cached) == len(tree)
        for node in tree.nodes():
            assert pool.pin_count[node.block] == pins.get(node.block, 0)
        for pinned in (False, True):  # the LRU holds every block before its parent
            order = pool.idle_order(pinned)
            pos = {block: i for i, block in enumerate(order)}
            for block in order:
                node = tree.node_of(block)
                assert node is not None
                if node.parent is not None and node.parent.block in pos:
                    assert pos[block] < pos[node.parent.block], "parent older than its child"

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
        total = max(-(-num_tokens // bs), len(match.blocks) + (match.partial_tokens > 0))
        return total - len(match.blocks)

    def _blocks_to_grow(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table.block_ids))

    def _extend(self, table: BlockTable, num_tokens: int) -> None:
        for _ in range(self._blocks_to_grow(table, num_tokens)):
            table.block_ids.append(self._take_block())

    def _take_block(self) -> int:
        """A fresh block with ref count 1: a free one first, else evict the LRU idle leaf."""
        block = self._pool.take_free()
        if block is None:
            victim = self._pool.oldest_idle()
            if victim is None:
                raise OutOfBlocksError("no free or evictable block")
            self._evict(victim)
            block = self._pool.take_free()
            assert block == victim
        return block

    def _evict(self, block: int) -> None:
        self._tree.remove(block)  # asserts it is a leaf
        self._pool.evict(block)
        self._stats.evicted_tokens += self.block_size
