"""One replica's cached blocks, rebuilt from its KV events: which token prefixes it holds, where.

The index is a trie keyed by each block's token ids; a replica's block hashes only say which
trie node a later ``BlockRemoved`` or child ``BlockStored`` means, so the router never needs
the replica's hash function. Several hashes may name one node (the same tokens under two
namespaces, or a block stored twice).

A hash is held per ``medium`` (vLLM's ``GPU``: the engine's own pool; ``CPU``: host memory;
``STORAGE``: files): a ``BlockStored`` adds its medium to the hash, a ``BlockRemoved`` takes
its own medium away (one with ``medium=None`` takes every medium), and the hash is forgotten
when no medium holds it. A block spilled to the host tier and evicted from the pool is still
cached, one level down. A node counts as cached while any hash names it in any medium.

``match(token_ids)`` walks full blocks from the start and stops at the first block not cached:
a block whose parent was evicted cannot be hit (its hash chains through the parent).
``match_by_medium`` also says how many of the matched tokens each medium serves (the fastest
medium holding each block).
Methods take a lock: the subscriber thread applies events while the router reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from .kv_event_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

MEDIUM_POOL = "GPU"  # a BlockStored without a medium (older publishers): the engine's pool
MEDIA_FASTEST_FIRST = ("GPU", "CPU", "STORAGE")  # vLLM's names; others rank after these


@dataclass(slots=True, eq=False)
class IndexNode:
    tokens: tuple[int, ...]
    parent: IndexNode | None
    children: dict[tuple[int, ...], IndexNode] = field(default_factory=dict)
    media: dict[str, int] = field(default_factory=dict)  # medium -> hashes naming it there

    @property
    def fastest_medium(self) -> str | None:
        """None: not cached (the node is kept while children exist)."""
        if not self.media:
            return None
        return min(self.media, key=_medium_rank)


@dataclass(slots=True, frozen=True)
class IndexMatch:
    tokens: int  # leading tokens of the prompt the replica holds, in whole blocks
    by_medium: dict[str, int]  # of those, how many each medium serves (fastest holder)


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
        self._by_hash: dict[BlockHash, tuple[IndexNode, set[str]]] = {}
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
                        self._remove(block_hash, event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self._clear()

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def match(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the replica holds (whole blocks, any
        medium)."""
        return self.match_by_medium(token_ids).tokens

    def match_by_medium(self, token_ids: Sequence[int]) -> IndexMatch:
        """The leading whole blocks of ``token_ids`` the replica holds, and where."""
        with self._lock:
            bs = self.block_size
            by_medium: dict[str, int] = {}
            if not bs:
                return IndexMatch(0, by_medium)
            node, matched = self._root, 0
            for start in range(0, len(token_ids) - bs + 1, bs):
                child = node.children.get(tuple(token_ids[start : start + bs]))
                medium = child.fastest_medium if child is not None else None
                if child is None or medium is None:
                    break
                by_medium[medium] = by_medium.get(medium, 0) + bs
                node, matched = child, matched + bs
            return IndexMatch(matched, by_medium)

    def cached_paths(self, medium: str | None = None) -> set[tuple[int, ...]]:
        """Every cached node's whole token prefix; ``medium``: only nodes held there (tests)."""
        with self._lock:
            out: set[tuple[int, ...]] = set()
            for node, media in self._by_hash.values():
                if medium is not None and medium not in media:
                    continue
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
            known_parent = self._by_hash.get(event.parent_block_hash)
            parent = known_parent[0] if known_parent is not None else None
        if parent is None:
            self.stats.unplaced_blocks += len(event.block_hashes)
            return
        medium = event.medium or MEDIUM_POOL
        tokens = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            known = self._by_hash.get(block_hash)
            if known is not None and known[0] is not parent.children.get(key):
                self._forget(block_hash, None)  # a hash reused for other tokens: the newer wins
                known = None
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = IndexNode(key, parent)
            if known is None:
                known = self._by_hash[block_hash] = (node, set())
            if medium not in known[1]:
                known[1].add(medium)
                node.media[medium] = node.media.get(medium, 0) + 1
            self.stats.stored_blocks += 1
            parent = node

    def _remove(self, block_hash: BlockHash, medium: str | None) -> None:
        known = self._by_hash.get(block_hash)
        if known is not None and (medium is None or medium in known[1]):
            self._forget(block_hash, medium)
            self.stats.removed_blocks += 1

    def _forget(self, block_hash: BlockHash, medium: str | None) -> None:
        """Take ``medium`` (None: all) away from a held hash; prune what no longer counts."""
        node, media = self._by_hash[block_hash]
        for gone in list(media) if medium is None else [medium]:
            media.discard(gone)
            node.media[gone] -= 1
            if not node.media[gone]:
                del node.media[gone]
        if not media:
            del self._by_hash[block_hash]
        step: IndexNode | None = node
        while step is not None and step.parent is not None and not step.media and not step.children:
            del step.parent.children[step.tokens]
            step = step.parent

    def _clear(self) -> None:
        self._root = IndexNode((), None)
        self._by_hash.clear()
        self.stats.clears += 1


def _medium_rank(medium: str) -> int:
    upper = medium.upper()
    return MEDIA_FASTEST_FIRST.index(upper) if upper in MEDIA_FASTEST_FIRST else 3
