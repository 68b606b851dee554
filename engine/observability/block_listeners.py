"""``BlockListeners``: several ``BlockListener``s as the block manager's one listener, so that
every change to the tree (an eviction included) is reported once, on one path."""

from __future__ import annotations

from ..memory.block_types import BlockListener
from ..memory.prefix_tree import Node


class BlockListeners(BlockListener):
    def __init__(self, *listeners: BlockListener) -> None:
        self.listeners = list(listeners)

    def add(self, listener: BlockListener) -> None:
        self.listeners.append(listener)

    def block_stored(self, node: Node, root: bytes) -> None:
        for listener in self.listeners:
            listener.block_stored(node, root)

    def block_removed(self, node: Node, cause: str) -> None:
        for listener in self.listeners:
            listener.block_removed(node, cause)

    def block_spilled(self, node: Node, tier: str) -> None:
        for listener in self.listeners:
            listener.block_spilled(node, tier)

    def tier_dropped(self, digest: bytes, tier: str) -> None:
        for listener in self.listeners:
            listener.tier_dropped(digest, tier)
