"""The prefix tree as a bounded picture: the body of ``GET /v1/cache/tree``, folded from the
engine's ``TreeSnapshot`` (one entry per cached block).

Folding, so that 100K cached blocks still make a reply of a few hundred nodes:
- a chain of blocks with one child each is one node (its width is its subtree's tokens);
- the largest subtrees are drawn first, until ``max_nodes`` are drawn;
- a node's children beyond ``max_children`` (the smallest), and whatever the budget left
  undrawn under a drawn node, become one ``more`` node carrying their totals.
One pass up and one down the snapshot (O(blocks)); the caller runs it off the event loop.
"""

from __future__ import annotations

import heapq
import itertools
import time

import msgspec

from prefixcache.engine.api import TreeSnapshot

DEFAULT_MAX_NODES = 1500
DEFAULT_MAX_CHILDREN = 24
TOP = 10
MAX_LABEL_TAGS = 4


class ViewNode(msgspec.Struct, omit_defaults=True):
    id: int
    parent: int  # -1: a namespace (the picture's top row)
    kind: str  # "namespace" | "prefix" | "more"
    start: int  # tokens before this node
    tokens: int  # this node's own tokens (a chain of blocks)
    total: int  # tokens in its subtree: the node's width
    hits: int  # requests whose cached prefix ended in this subtree
    label: str = ""  # segment tags of the chain, or the namespace's opaque label
    last_used: float = 0.0  # unix time, latest in the subtree (0: never used since cached)
    pinned: bool = False  # a pin holds the node (some of it: pins cover every block above)
    # unix time the pins lapse when all are TTL pins (0: unpinned, or a pin without TTL)
    ttl_expires: float = 0.0
    in_use: bool = False
    folded: int = 0  # "more": how many prefixes it stands for


class TopPrefix(msgspec.Struct):
    namespace: str
    label: str
    tokens: int
    hits: int
    pinned: bool = False  # a pin covers its last block (so every block of it)
    ttl_expires: float = 0.0  # only TTL pins hold it: when they lapse (unix time)


class TreeView(msgspec.Struct):
    block_size: int
    taken_at: float
    num_blocks: int  # cached blocks in the tree
    num_namespaces: int
    folded: bool  # some subtrees are drawn as "more" nodes
    build_ms: float
    nodes: list[ViewNode]
    top_by_hits: list[TopPrefix]  # the prefixes requests' cached matches ended at most
    top_by_size: list[TopPrefix]  # the largest top-level prefixes (their whole subtrees)


def build_view(
    snap: TreeSnapshot,
    max_nodes: int = DEFAULT_MAX_NODES,
    max_children: int = DEFAULT_MAX_CHILDREN,
) -> TreeView:
    began = time.perf_counter()
    bs, parent, n = snap.block_size, snap.parent, len(snap.parent)
    kids: list[list[int]] = [[] for _ in range(n)]
    tops: list[list[int]] = [[] for _ in snap.namespaces]
    depth = [0] * n
    for i, p in enumerate(parent):
        if p >= 0:
            assert p < i, "snapshot not in parents-first order"
            kids[p].append(i)
            depth[i] = depth[p] + 1
        else:
            tops[-1 - p].append(i)
    size = [1] * n  # blocks in the subtree
    hits = list(snap.hits)
    last = list(snap.last_used)
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0:
            size[p] += size[i]
            hits[p] += hits[i]
            if last[i] > last[p]:
                last[p] = last[i]

    nodes: list[ViewNode] = []
    heap: list[tuple[int, int, int, int]] = []  # (-size, tie, block, view parent id)
    ties = itertools.count()
    folded = False

    def pins_of(blocks: list[int]) -> tuple[bool, float]:
        """Several subtrees side by side: pinned if any is; a TTL deadline only if every pinned
        one is held by TTL pins alone."""
        ttl = [snap.ttl_expires[b] for b in blocks if snap.pinned[b]]
        return bool(ttl), 0.0 if not ttl or min(ttl) == 0.0 else max(ttl)

    def more(view_parent: int, start: int, blocks: list[int]) -> None:
        nonlocal folded
        folded = True
        pinned, ttl_expires = pins_of(blocks)
        nodes.append(
            ViewNode(
                id=len(nodes),
                parent=view_parent,
                kind="more",
                start=start,
                tokens=0,
                total=sum(size[b] for b in blocks) * bs,
                hits=sum(hits[b] for b in blocks),
                label=f"+{len(blocks)} more",
                last_used=max(last[b] for b in blocks),
                folded=len(blocks),
                pinned=pinned,
                ttl_expires=ttl_expires,
            )
        )

    def push_children(children: list[int], view_parent: int, start: int) -> None:
        if len(children) > max_children:
            keep = heapq.nlargest(max_children - 1, children, key=size.__getitem__)
            kept = set(keep)
            more(view_parent, start, [c for c in children if c not in kept])
            children = keep
        for c in children:
            heapq.heappush(heap, (-size[c], next(ties), c, view_parent))

    for k, label in enumerate(snap.namespaces):
        blocks = tops[k]
        total = sum(size[b] for b in blocks)
        pinned, ttl_expires = pins_of(blocks)
        nodes.append(
            ViewNode(
                id=len(nodes),
                parent=-1,
                kind="namespace",
                start=0,
                tokens=0,
                total=total * bs,
                hits=sum(hits[b] for b in blocks),
                label=label,
                last_used=max((last[b] for b in blocks), default=0.0),
                pinned=pinned,
                ttl_expires=ttl_expires,
                in_use=any(snap.in_use[b] for b in blocks),
            )
        )
        push_children(blocks, nodes[-1].id, 0)

    while heap and len(nodes) < max_nodes:
        _, _, first, view_parent = heapq.heappop(heap)
        end, tags = first, _tags_of(snap.tags[first])
        while len(kids[end]) == 1:
            end = kids[end][0]
            tag = snap.tags[end]
            if tag and tag not in tags and len(tags) < MAX_LABEL_TAGS:
                tags.append(tag)
        node = ViewNode(
            id=len(nodes),
            parent=view_parent,
            kind="prefix",
            start=depth[first] * bs,
            tokens=(depth[end] - depth[first] + 1) * bs,
            total=size[first] * bs,
            hits=hits[first],
            label=" › ".join(tags),
            last_used=last[first],
            pinned=snap.pinned[first],  # a pin covers every block above it
            ttl_expires=snap.ttl_expires[first],  # its subtree's, as the engine folded it
            in_use=snap.in_use[first],  # so does a running request's hold
        )
        nodes.append(node)
        push_children(kids[end], node.id, (depth[end] + 1) * bs)

    undrawn: dict[int, list[int]] = {}
    for _, _, block, view_parent in heap:
        undrawn.setdefault(view_parent, []).append(block)
    for view_parent, blocks in undrawn.items():
        more(view_parent, depth[blocks[0]] * bs, blocks)

    labels = snap.namespaces

    def top_of(block: int, tokens: int, hit: int) -> TopPrefix:
        path, b = [], block
        while b >= 0:
            if snap.tags[b] and snap.tags[b] not in path:
                path.append(snap.tags[b])
            top, b = b, parent[b]
        label = " › ".join(reversed(path))
        pinned, ttl = snap.pinned[block], snap.ttl_expires[block]
        return TopPrefix(labels[-1 - parent[top]], label, tokens, hit, pinned, ttl)

    by_hits = heapq.nlargest(TOP, (i for i in range(n) if snap.hits[i]), key=snap.hits.__getitem__)
    all_tops = [b for group in tops for b in group]
    by_size = heapq.nlargest(TOP, all_tops, key=size.__getitem__)
    return TreeView(
        block_size=bs,
        taken_at=snap.taken_at,
        num_blocks=n,
        num_namespaces=len(labels),
        folded=folded,
        build_ms=(time.perf_counter() - began) * 1000,
        nodes=nodes,
        top_by_hits=[top_of(b, (depth[b] + 1) * bs, snap.hits[b]) for b in by_hits],
        top_by_size=[top_of(b, size[b] * bs, hits[b]) for b in by_size],
    )


def _tags_of(tag: str) -> list[str]:
    return [tag] if tag else []
