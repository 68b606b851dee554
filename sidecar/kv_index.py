"""One replica's cached blocks, rebuilt from its KV events: which token prefixes it holds.

The index is a trie keyed by each block's token ids; a replica's block hashes only say which
trie node a later ``BlockRemoved`` or child ``BlockStored`` means, so the router never needs
the replica's hash function. Several hashes may name one node (the same tokens under two
namespaces, or a block stored twice): a node counts as cached while any hash names it.

``match(token_ids)`` walks full blocks from the start and stops at the first block not cached:
a block whose parent was evicted cannot be hit (its hash chains through the parent). Methods
take a lock: the subscriber thread applies events while the router reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from .kv_event_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True, eq=False)
class IndexNode:
    tokens: tuple[int, ...]
    parent: IndexNode | None
    children: dict[tuple[int, ...], IndexNode] = field(default_factory=dict)
    names: int = 0  # hashes naming this node; 0: not cached (kept while children exist)


@dataclass(slots=True)
class IndexStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    unplaced_blocks: int = 0  # stored without token ids, or under a parent hash never seen
    clears: int = 0


class ReplicaIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root = IndexNode((), None)
        self._by_hash: dict[BlockHash, IndexNode] = {}
        self.block_size: int | None = None  # from the first BlockStored
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._by_hash)

    def apply(self, events: Sequence[KVEvent]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(event)
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        self._remove(block_hash)
                elif isinstance(event, AllBlocksCleared):
                    self._clear()

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def match(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the replica holds (whole blocks)."""
        with self._lock:
            bs = self.block_size
            if not bs:
                return 0
            node, matched = self._root, 0
            for start in range(0, len(token_ids) - bs + 1, bs):
                child = node.children.get(tuple(token_ids[start : start + bs]))
                if child is None or not child.names:
                    break
                node, matched = child, matched + bs
            return matched

    def cached_paths(self) -> set[tuple[int, ...]]:
        """Every cached node's whole token prefix (tests)."""
        with self._lock:
            out: set[tuple[int, ...]] = set()
            for node in self._by_hash.values():
                path: list[tuple[int, ...]] = []
                step: IndexNode | None = node
                while step is not None and step.parent is not None:
                    path.append(step.tokens)
                    step = step.parent
                out.add(tuple(t for block in reversed(path) for t in block))
            return out

    # ---- internals (lock held)

    def _store(self, event: BlockStored) -> None:
        bs = event.block_size
        if bs < 1 or len(event.token_ids) != bs * len(event.block_hashes):
            self.stats.unplaced_blocks += len(event.block_hashes)
            return
        if self.block_size != bs:
            if self.block_size is not None:  # a replica that changed its block size
                self._clear()
            self.block_size = bs
        if event.parent_block_hash is None:
            parent: IndexNode | None = self._root
        else:
            parent = self._by_hash.get(event.parent_block_hash)
        if parent is None:
            self.stats.unplaced_blocks += len(event.block_hashes)
            return
        tokens = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = IndexNode(key, parent)
            known = self._by_hash.get(block_hash)
            if known is not node:
                if known is not None:  # a hash reused for other tokens: the newer wins
                    self._unname(known)
                self._by_hash[block_hash] = node
                node.names += 1
            self.stats.stored_blocks += 1
            parent = node

    def _remove(self, block_hash: BlockHash) -> None:
        node = self._by_hash.pop(block_hash, None)
        if node is not None:
            self._unname(node)
            self.stats.removed_blocks += 1

    def _unname(self, node: IndexNode) -> None:
        node.names -= 1
        step: IndexNode | None = node
        while step is not None and step.parent is not None and not step.names and not step.children:
            del step.parent.children[step.tokens]
            step = step.parent

    def _clear(self) -> None:
        self._root = IndexNode((), None)
        self._by_hash.clear()
        self.stats.clears += 1
