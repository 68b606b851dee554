"""What the cache did, for people to look at: per-block hits, last use and segment tags, the
recent finished requests with their miss reasons, and a flat copy of the tree.

Engine thread only, except ``records`` (any thread, under a lock). The hooks cost O(1) per
admission and per eviction, and O(segments) per finished request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from ..api import RequestRecord, TreeSnapshot
from ..memory.block_manager import BlockManager
from ..memory.block_types import BlockListener, PrefixMatch
from ..memory.miss_reasons import MissReasons
from ..memory.prefix_tree import Node
from ..request import SegmentMiss
from ..step.sequence import Sequence

MAX_RECORDS = 2000
MAX_ROOT_LABELS = 65536


class CacheActivity(BlockListener):
    def __init__(self, manager: BlockManager, max_records: int = MAX_RECORDS) -> None:
        self.manager = manager
        self.reasons = MissReasons(manager)
        n = manager.num_blocks
        self._hits = [0] * n
        self._last_used = [0.0] * n
        self._tags = [""] * n
        self._labels: OrderedDict[bytes, str] = OrderedDict()  # namespace root -> label
        self._records: deque[RequestRecord] = deque(maxlen=max_records)
        self._lock = threading.Lock()
        self._next = 1

    # -- hooks (engine thread): the scheduler's, and the block manager's listener ---------------

    def on_admit(self, seq: Sequence, match: PrefixMatch) -> SegmentMiss | None:
        """A request's first admission, before it allocates: count the hit, explain the miss."""
        request = seq.request
        if match.blocks:
            block = match.blocks[-1]
            self._hits[block] += 1
            self._last_used[block] = time.time()
        root = self.manager.root(request.namespace)
        if request.tenant or root not in self._labels:  # a warm request carries no tenant
            self._labels[root] = namespace_label(request.namespace, request.tenant)
            if len(self._labels) > MAX_ROOT_LABELS:
                self._labels.popitem(last=False)
        return self.reasons.explain(
            seq.token_ids, request.namespace, request.tenant, request.segments, match
        )

    def on_finish(self, seq: Sequence, reason: str) -> None:
        """Before the request's blocks are freed: tag them, and remember the request."""
        now = time.time()
        table = seq.table
        if table is not None and table.num_committed_blocks:
            committed, bs = table.num_committed_blocks, table.block_size
            for span in seq.request.segments or ():
                first = span.start // bs
                if span.tag and span.end > span.start and first < committed:
                    self._tags[table.block_ids[first]] = span.tag
            self._last_used[table.block_ids[committed - 1]] = now
        ttft = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
        request = seq.request
        with self._lock:
            self._records.append(
                RequestRecord(
                    seq=self._next,
                    finished_at=now,
                    prompt_tokens=seq.num_prompt_tokens,
                    cached_tokens=seq.num_cached_tokens or 0,
                    ttft_s=ttft,
                    finish_reason=reason,
                    namespace=namespace_label(request.namespace, request.tenant),
                    miss=seq.miss,
                )
            )
            self._next += 1

    def block_removed(self, node: Node, cause: str) -> None:
        block = node.block
        self._hits[block] = 0
        self._last_used[block] = 0.0
        self._tags[block] = ""
        self.reasons.on_evict(node, cause)

    # -- reading ----------------------------------------------------------------------------

    def records(self, after: int = 0) -> list[RequestRecord]:
        """Remembered finished requests with ``seq > after`` (any thread)."""
        with self._lock:
            if not self._records or self._records[-1].seq <= after:
                return []
            return [r for r in self._records if r.seq > after]

    def snapshot(self) -> TreeSnapshot:
        """Every cached block, parents first (a parent is inserted before its children and
        cannot leave while it has any, so the tree's insertion order is such an order)."""
        manager = self.manager
        manager.expire_pins()  # the pins as of now, whether or not a step ran since one lapsed
        nodes = manager.tree.nodes()
        index = {node.block: i for i, node in enumerate(nodes)}
        roots: dict[bytes, int] = {}
        parent: list[int] = []
        for node in nodes:
            if node.parent is None:
                k = roots.setdefault(node.parent_digest, len(roots))
                parent.append(-1 - k)
            else:
                parent.append(index[node.parent.block])
        labels = [self._labels.get(root) or f"ns {root.hex()[:6]}" for root in roots]
        blocks = [node.block for node in nodes]
        hits, last_used, tags = self._hits, self._last_used, self._tags
        taken_at = time.time()
        return TreeSnapshot(
            block_size=manager.block_size,
            taken_at=taken_at,
            namespaces=labels,
            parent=parent,
            in_use=[manager.ref_count(b) > 0 for b in blocks],
            pinned=[manager.pin_count(b) > 0 for b in blocks],
            hits=[hits[b] for b in blocks],
            last_used=[last_used[b] for b in blocks],
            tags=[tags[b] for b in blocks],
            ttl_expires=self._ttl_expires(index, parent, blocks, taken_at),
        )

    def _ttl_expires(
        self, index: dict[int, int], parent: list[int], blocks: list[int], now: float
    ) -> list[float]:
        """Per snapshot entry, when the TTL pins holding it lapse (0.0: none, or a pin without
        TTL holds it too). A pin covers its node and every block above it, so one pass from
        the leaves up sums each subtree's TTL pins and keeps its latest deadline; a block whose
        pin count is more than that is also held by a pin without TTL."""
        expires = [0.0] * len(blocks)
        ends = self.manager.ttl_time_left()
        if not ends:
            return expires
        ttl_pins = [0] * len(blocks)
        for node, left in ends:
            i = index[node.block]
            ttl_pins[i] += 1
            expires[i] = max(expires[i], now + left)
        for i in range(len(blocks) - 1, -1, -1):
            p = parent[i]
            if p >= 0:
                ttl_pins[p] += ttl_pins[i]
                expires[p] = max(expires[p], expires[i])
        pin_count = self.manager.pin_count
        for i, block in enumerate(blocks):
            if pin_count(block) > ttl_pins[i]:
                expires[i] = 0.0
        return expires


def namespace_label(namespace: str, tenant: str) -> str:
    """Opaque: the first hex digits of the server's HMACs, never a tenant's name."""
    ns = namespace[:6] or "-"
    return f"{tenant[:6]}/{ns}" if tenant and tenant != namespace else ns
