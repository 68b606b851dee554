"""A hybrid model's sliding-layer KV in the KV tier (``--kv-offload``).

The global layers' pages spill and reload through the block manager's own tier
(``tier_link.py``); the local pages go to a second tier of local-page-sized slots, keyed by
the same block digests. A local page is spilled when its block is evicted, or when the page
alone is taken from its idle block under local-pool pressure (the block's global page stays
cached), as the spill policy allows. A hit whose window has a block without a local page can
still count on it when this tier holds it: the page is attached again and filled from there.
A prompt's interior pages enter at the cold end of the tier's LRU: what hits read most is the
last window before a prompt's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..prefix_tree import Node
from .local_pages import LocalPages

if TYPE_CHECKING:
    from ..kv_tier import KVTier


class LocalTierLink:
    """Spill local pages into their tier and fill fresh ones from it."""

    __slots__ = ("_spill_all", "tier")

    def __init__(self, tier: KVTier, spill_policy: str) -> None:
        self.tier = tier
        self._spill_all = spill_policy == "all"

    def spill(self, node: Node, page: int, interior: bool, wait: bool = False) -> None:
        """Keep local page ``page``'s KV under ``node``'s digest, as the spill policy says; a
        prompt's interior (which only a hit diverging inside it reads) goes in as the least
        recently used entry, the first a full tier drops, so last windows stay longest."""
        if self._spill_all or node.hits:  # a block hit since is shared: no interior then
            cold = interior and not node.hits
            self.tier.spill(node.digest, node.parent_digest, node.tokens, page, wait, cold)

    def holds_node(self, node: Node | None) -> bool:
        """Whether the tier holds the local page of a cached block."""
        assert node is not None
        return self.tier.find(node.digest, node.parent_digest, node.tokens)

    def holds_entry(self, digest: bytes, tier: KVTier) -> bool:
        """Whether it holds the local page of the global ``tier``'s entry ``digest``."""
        source = tier.source(digest)
        return source is not None and self.tier.find(digest, *source)

    def reload(self, node: Node, local: LocalPages) -> bool:
        """Attach a page to ``node``'s block (held once: by the table that asked) and fill it
        from the tier; False, with no page attached, when the tier lost the entry or its
        checksum fails."""
        if not self.holds_node(node):
            return False
        digest = node.digest
        self.tier.touch([digest])  # the attach below may spill (and drop the LRU entry)
        local.attach(node.block)
        if self.tier.reload([digest], [local.page_of[node.block]]) == 1:
            return True
        local.drop(node.block)
        return False
