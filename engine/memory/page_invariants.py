"""The invariants that tie the pool's pages to the prefix tree (``BlockManager.check_invariants``,
for tests and fuzzing): every tree node's page is cached, no in-use block sits under an idle
parent, pin counts are the pins of the paths below, and the LRU keeps every block before its
parent (so its head is always a leaf; see block_manager.py)."""

from __future__ import annotations

from .block_pool import BlockPool
from .prefix_tree import PrefixTree


def check_pages(pool: BlockPool, tree: PrefixTree, num_blocks: int) -> None:
    pool.check()
    tree.check()
    assert pool.num_free + pool.num_cached_idle + pool.num_used == num_blocks
    pins: dict[int, int] = {}
    for node in tree.nodes():
        assert pool.cached[node.block]
        if pool.ref_count[node.block] > 0 and node.parent is not None:
            assert pool.ref_count[node.parent.block] > 0, "in-use block under an idle parent"
        if node.own_pins:  # a pin covers every block above it
            for step in node.path_up():
                pins[step.block] = pins.get(step.block, 0) + node.own_pins
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
