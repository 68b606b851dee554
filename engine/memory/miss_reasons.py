"""Why a prompt's tokens were not served from the cache: one reason per request, reported on
every segment the cached prefix did not cover.

Computed once, at a request's first admission, from the match the scheduler just made: the
walk has already found where the cached prefix stops, so what is left is one block digest
(for ``evicted``), one look at the stopping node's children (for ``diverged``) and, only when
nothing else explains the miss, a walk in each of the tenant's other namespaces (bounded).

    below_min      the prompt is shorter than one block: only full blocks are ever cached
    partial_block  every full block the match could take was hit; the rest is less than a
                   block (it cannot be a cached block yet)
    evicted        the next block was cached here and was evicted (when, and by what:
                   "pressure" when a request needed the page, "admin" for /v1/cache/evict,
                   "ttl" when a TTL pin over it had lapsed before that pressure)
    diverged       the cached prefix goes on with other tokens: ``segment`` names the segment
                   whose tokens changed; everything after it is new by construction
    namespace      the same tokens are cached under another cache salt of the same tenant
                   (never looked up across tenants, and which salt is not said)
    cold           never seen in this namespace

The last prompt token is always computed (its logits start generation): a match that stops
only there is a full hit, not a miss.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from ..request import SegmentMiss, SegmentSpan
from .prefix_tree import Node, token_bytes

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .block_types import PrefixMatch

MAX_NAMESPACES_PER_TENANT = 8  # the other salts checked for "namespace", most recent first
MAX_TENANTS = 4096


class EvictionLog:
    """The digests of recently evicted blocks, with when and why, bounded (oldest dropped).

    Digests chain from their namespace's root, so one record serves every namespace and a
    lookup only ever finds a block of the namespace whose root it was computed from."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._notes: OrderedDict[bytes, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._notes)

    def record(self, digest: bytes, cause: str) -> None:
        notes = self._notes
        notes[digest] = (time.time(), cause)
        notes.move_to_end(digest)
        if len(notes) > self.capacity:
            notes.popitem(last=False)

    def find(self, digest: bytes) -> tuple[float, str] | None:
        return self._notes.get(digest)


class MissReasons:
    """Explains matches of one ``BlockManager``; its ``on_evict`` is the manager's hook."""

    def __init__(self, manager: BlockManager, log_capacity: int | None = None) -> None:
        self.manager = manager
        self.evictions = EvictionLog(log_capacity or max(1024, 2 * manager.num_blocks))
        self._tenants: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def on_evict(self, node: Node, cause: str) -> None:
        self.evictions.record(node.digest, cause)

    def note_namespace(self, tenant: str, namespace: str) -> None:
        """Remember that ``namespace`` is one of ``tenant``'s (most recent first out)."""
        if not tenant:
            return
        spaces = self._tenants.get(tenant)
        if spaces is None:
            spaces = self._tenants[tenant] = OrderedDict()
            if len(self._tenants) > MAX_TENANTS:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        spaces[namespace] = None
        spaces.move_to_end(namespace)
        if len(spaces) > MAX_NAMESPACES_PER_TENANT + 1:
            spaces.popitem(last=False)

    def explain(
        self,
        token_ids: Seq[int],
        namespace: str,
        tenant: str,
        spans: list[SegmentSpan] | None,
        match: PrefixMatch,
    ) -> SegmentMiss | None:
        """Why the match stops where it does; None for a full hit (or caching off). Call it
        with a fresh match, before the request allocates (the tree as it was matched)."""
        self.note_namespace(tenant, namespace)
        manager = self.manager
        if not manager.enable_caching:
            return None
        bs, total, hit = manager.block_size, len(token_ids), match.num_tokens
        if hit >= total - 1:
            return None
        if total < bs:
            return SegmentMiss("below_min")
        where = _segment_at(spans, hit)
        full = len(match.blocks)
        if full >= (total - 1) // bs:
            return SegmentMiss("partial_block", where)
        tree = manager.tree
        root = manager.root(namespace)
        parent = tree.node_of(match.blocks[-1]) if full else None
        assert full == 0 or parent is not None, "stale match"
        block = token_bytes(token_ids[full * bs : (full + 1) * bs])
        digest = tree.digest(parent.digest if parent is not None else root, block)
        note = self.evictions.find(digest)
        if note is not None:
            return SegmentMiss("evicted", where, evicted_at=note[0], evicted_by=note[1])
        kids = tree.children(parent, root)
        if kids is not None and block in kids.by_tokens:  # cached: a hybrid model's hit stopped
            return SegmentMiss("window", where)  # where a sliding window was incomplete
        if hit > 0 and kids is not None and kids.by_tokens:
            return SegmentMiss("diverged", where)
        if self._cached_under_another_salt(token_ids, namespace, tenant, full + 1):
            return SegmentMiss("namespace", where)
        return SegmentMiss("cold", where)

    def _cached_under_another_salt(
        self, token_ids: Seq[int], namespace: str, tenant: str, num_blocks: int
    ) -> bool:
        """Whether one of this tenant's other namespaces holds the first ``num_blocks``."""
        spaces = self._tenants.get(tenant) if tenant else None
        if not spaces or len(spaces) < 2:
            return False
        manager, bs = self.manager, self.manager.block_size
        data = token_bytes(token_ids[: num_blocks * bs])
        for other in reversed(spaces):
            if other == namespace:
                continue
            if len(manager.tree.walk(manager.root(other), data, num_blocks)) == num_blocks:
                return True
        return False


def segment_misses(
    spans: list[SegmentSpan], cached_tokens: int, miss: SegmentMiss | None
) -> list[SegmentMiss | None]:
    """The request's miss on each segment the cached prefix does not cover, else None."""
    return [
        miss if s.end > s.start and s.end > cached_tokens and miss is not None else None
        for s in spans
    ]


def _segment_at(spans: list[SegmentSpan] | None, position: int) -> str | None:
    """The tag of the segment holding token ``position`` (or the next one, past a gap)."""
    for span in spans or ():
        if span.end > position and span.end > span.start:
            return span.tag or None
    return None
