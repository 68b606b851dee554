"""Forking a block table (parallel sampling's shape), built on the manager's public API.

The engine never forks; the tests do, because a fork is the hardest user of sharing: two live
tables on the same committed blocks, each then writing its own private blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.block_types import BlockTable, CopySlots, PrefixMatch


def _committed(table: BlockTable) -> PrefixMatch:
    """The table's committed blocks as a match: what a new table may share."""
    blocks = table.block_ids[: table.num_committed_blocks]
    return PrefixMatch(blocks, None, 0, table.block_size)


def can_fork(manager: BlockManager, table: BlockTable) -> bool:
    return manager.can_allocate(_committed(table), table.num_slots)


def fork(
    manager: BlockManager,
    table: BlockTable,
    token_ids: Sequence[int],
    num_tokens: int,
    copy_slots: CopySlots,
) -> BlockTable:
    """A new table sharing ``table``'s committed blocks; the first ``num_tokens`` slots of its
    private blocks are copied into fresh ones (``allocate`` counts it as a query that hit the
    committed blocks). Raises OutOfBlocksError unless ``can_fork``."""
    bs, committed = table.block_size, table.num_committed_blocks
    assert num_tokens <= min(len(token_ids), table.num_slots)
    new = manager.allocate(token_ids, table.namespace, _committed(table), table.num_slots)
    assert len(new.block_ids) == len(table.block_ids) and new.hashes == table.hashes
    for i in range(committed, len(table.block_ids)):
        k = min(bs, num_tokens - i * bs)
        if k > 0:
            copy_slots(table.block_ids[i], new.block_ids[i], k)
    new.num_cached_tokens = num_tokens
    return new
