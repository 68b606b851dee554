"""The block manager's glue to the KV tier (``kv_tier.py``): match, spill, reload.

An evicted block's KV is spilled to the tier under its digest (every block, or only blocks
hit at least once: ``spill_policy``). A match continues past the pool's last cached block
through the tier (digests chained from there, each entry checked against its parent digest and
tokens), and ``reload`` copies those blocks back into fresh pages in one batch and caches them
in the tree, before the request's first step: the request computes only what neither level
holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .prefix_tree import TOKEN_BYTES, NewBlock, Node, PrefixTree

if TYPE_CHECKING:
    from .kv_tier import KVTier

SPILL_POLICIES = ("all", "hit")
CacheBlock = Callable[[Node | None, bytes, bytes, int | NewBlock], tuple[Node | None, bool]]


class TierLink:
    """Spill and reload between the pool's pages and one tier; pages come from the manager
    (``take_block``) and reloaded blocks enter the tree through it (``cache``)."""

    __slots__ = ("_block_size", "_cache", "_pool", "_spill_all", "_take_block", "_tree", "tier")

    def __init__(
        self,
        tier: KVTier,
        pool: BlockPool,
        tree: PrefixTree,
        block_size: int,
        spill_policy: str,
        take_block: Callable[[], int],
        cache: CacheBlock,
    ) -> None:
        self.tier = tier
        self._pool = pool
        self._tree = tree
        self._block_size = block_size
        self._spill_all = spill_policy == "all"
        self._take_block = take_block
        self._cache = cache

    def match(self, nodes: list[Node], root: bytes, data: bytes, max_blocks: int) -> list[bytes]:
        """Digests of the blocks after ``nodes`` that the tier holds, in order (read-only)."""
        tier = self.tier
        if not len(tier) or len(nodes) >= max_blocks:
            return []
        nbytes, digest = self._block_size * TOKEN_BYTES, self._tree.digest
        parent = nodes[-1].digest if nodes else root
        out: list[bytes] = []
        for i in range(len(nodes), max_blocks):
            tokens = data[i * nbytes : (i + 1) * nbytes]
            key = digest(parent, tokens)
            if not tier.find(key, parent, tokens):
                break
            out.append(key)
            parent = key
        return out

    def spill(self, node: Node, block: int, wait: bool) -> bool:
        """Keep an evicted block's KV in the tier, as ``spill_policy`` says. True when the
        tier took it as a new entry (one it already held is only touched)."""
        if not (self._spill_all or node.hits):
            return False
        held = node.digest in self.tier
        stored = self.tier.spill(node.digest, node.parent_digest, node.tokens, block, wait)
        return stored and not held

    def reload(
        self, digests: list[bytes], parent: Node | None, root: bytes, data: bytes
    ) -> list[Node]:
        """Copy the tier's blocks ``digests`` (tokens ``data``, under ``parent`` or ``root``)
        back into fresh pages (one batch) and cache them; returns their nodes, each with a ref
        taken. A block the tier lost meanwhile (dropped, corrupt) or a digest collision ends
        the reload there: the rest is computed."""
        pool, tier = self._pool, self.tier
        tier.touch(digests)  # spills made room for them while pages are taken
        count = min(len(digests), pool.num_available)
        pages = [self._take_block() for _ in range(count)]
        done = tier.reload(digests[:count], pages)
        self._release(pages[done:])  # not cached: straight back to the free list
        nbytes = self._block_size * TOKEN_BYTES
        nodes: list[Node] = []
        for i, page in enumerate(pages[:done]):
            node, inserted = self._cache(parent, root, data[i * nbytes : (i + 1) * nbytes], page)
            if node is None:  # a digest collision: the rest is computed
                self._release(pages[i:done])
                break
            if not inserted:  # cached meanwhile: share that page instead
                pool.ref(node.block)
                pool.deref(page)
            node.hits += 1
            nodes.append(node)
            parent = node
        return nodes

    def _release(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._pool.deref(page)
