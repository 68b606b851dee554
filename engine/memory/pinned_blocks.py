"""The blocks of pinned prefixes: listed for saving, cached and pinned again on loading.

The block-manager side of ``prefix_store.py`` (which adds the KV pages and the file). Pure
bookkeeping over the manager's public node API: no torch, engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from .block_manager import BlockManager
from .prefix_tree import Node

WriteBlock = Callable[[int, int], None]  # (index in the saved list, page): fill the page's KV


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


def saved_blocks(manager: BlockManager) -> list[SavedBlock]:
    """Every cached block on a pinned prefix, each once, parents before children."""
    index: dict[Node, int] = {}
    out: list[SavedBlock] = []
    for node in manager.pinned_nodes():
        chain: list[Node] = []
        for step in node.path_up():
            if step in index:
                break
            chain.append(step)
        for n in reversed(chain):
            parent = -1 if n.parent is None else index[n.parent]
            root = n.parent_digest if n.parent is None else b""
            index[n] = len(out)
            out.append(SavedBlock(root, parent, n.tokens, n.own_pins, n.block))
    return out


def restore_blocks(
    manager: BlockManager,
    saved: list[SavedBlock],
    write: WriteBlock,
    reused: WriteBlock | None = None,
) -> RestoreResult:
    """Cache saved blocks (parents first) that are not cached yet, filling each new page with
    ``write(index, page)``, then re-apply their pins. Pages come from the free list or by
    evicting idle unpinned blocks, never from running requests or pinned prefixes.
    ``reused(index, page)``: told of each saved block found cached here, while it is held."""
    if not manager.enable_caching:
        return RestoreResult(0, 0, len(saved), 0)
    nodes: list[Node | None] = []
    held: list[int] = []  # one ref on every restored or reused page until the end
    restored = num_reused = 0
    try:
        for i, item in enumerate(saved):
            parent = nodes[item.parent] if 0 <= item.parent < len(nodes) else None
            if item.parent >= 0 and parent is None:  # under a skipped parent
                nodes.append(None)
                continue
            node, new = manager.cache_block(parent, item.root, item.tokens, partial(write, i))
            if node is not None:
                held.append(node.block)
                if new:
                    restored += 1
                else:
                    num_reused += 1
                    if reused is not None:
                        reused(i, node.block)
            nodes.append(node)
    finally:
        manager.release(held)  # children turn idle before their parents
    pinned = 0
    for item, node in zip(saved, nodes, strict=True):
        if node is not None and item.pins and not node.own_pins:
            manager.pin_path(node, item.pins)
            pinned += 1
    return RestoreResult(restored, num_reused, len(saved) - restored - num_reused, pinned)
