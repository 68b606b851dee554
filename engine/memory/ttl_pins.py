"""TTL pins: the pins that lapse unless renewed (``BlockManager.pin(..., ttl_s=)``).

A TTL pin is one of its node's ``own_pins`` with a deadline. A hit on its prefix, or pinning it
again (no second pin), renews it; ``expire`` lifts the pins whose deadline passed, leaving
ordinary LRU entries. A pin lapses on time, not on traffic: the manager expires them before
every read or change of the pins (stats, the cache view, evict, taking a page under pressure),
and the serving loop, idle, wakes at ``next_lapse`` to expire them and report the new stats.
``expire`` costs one clock read until the earliest deadline passes. A pinned leaf evicted under pressure passes its pin to its parent
(``tree.remove`` moves the pin count); ``pass_on`` moves the deadline along. Pins per
namespace may be capped (``max_blocks``: blocks covered by that namespace's TTL pins together).
A node whose pin lapsed stays marked until it is evicted (``lapsed_at_eviction``: the miss
reason's ``evicted_by: "ttl"``); the mark moves to its parent, which the pin covered too.
The manager owns the pool's pin counts: this class changes them only through ``pin_path``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .prefix_tree import Node

PinPath = Callable[[Node, int], None]  # add (remove, if negative) pins ending at a node


@dataclass(slots=True)
class TTLPin:
    """One pin (of the node's ``own_pins``) that lapses at ``expires`` unless renewed."""

    namespace: str
    ttl_s: float
    expires: float
    depth: int  # blocks it covers (its node and every block above)


class TTLPins:
    """The TTL pins, by the node where each pinned prefix ends."""

    __slots__ = ("_by_node", "_clock", "_lapsed", "_next", "_pin_path")

    def __init__(self, pin_path: PinPath, clock: Callable[[], float]) -> None:
        self._by_node: dict[Node, TTLPin] = {}
        self._lapsed: set[Node] = set()  # where lapsed pins end (moved up at evictions)
        self._pin_path = pin_path
        self._clock = clock
        self._next = math.inf  # no pin lapses before this (a lower bound: renewals only defer)

    def __len__(self) -> int:
        return len(self._by_node)

    def __contains__(self, node: Node) -> bool:
        return node in self._by_node

    def values(self) -> Iterator[TTLPin]:
        return iter(self._by_node.values())

    def time_left(self) -> list[tuple[Node, float]]:
        """Each node where a TTL pin ends, with the seconds before it lapses (read-only)."""
        now = self._clock()
        return [(node, pin.expires - now) for node, pin in self._by_node.items()]

    def get(self, node: Node | None) -> TTLPin | None:
        return self._by_node.get(node) if node is not None else None

    def renew(self, node: Node | None) -> None:
        pin = self.get(node)
        if pin is not None:
            pin.expires = max(pin.expires, self._clock() + pin.ttl_s)

    def pin(self, nodes: list[Node], namespace: str, ttl_s: float, max_blocks: int | None) -> int:
        """Pin the prefix ending at ``nodes[-1]`` for ``ttl_s`` (renewing a pin already there),
        cut short to fit the namespace's ``max_blocks``; returns how many blocks it covers."""
        if max_blocks is not None and nodes:
            used = sum(
                p.depth
                for n, p in self._by_node.items()
                if p.namespace == namespace and n is not nodes[-1]
            )
            nodes = nodes[: max(0, max_blocks - used)]
        if not nodes:
            return 0
        node, expires = nodes[-1], self._clock() + ttl_s
        self._next = min(self._next, expires)
        pin = self._by_node.get(node)
        if pin is not None:
            pin.expires = max(pin.expires, expires)
            pin.ttl_s = max(pin.ttl_s, ttl_s)
        else:
            self._pin_path(node, 1)
            self._by_node[node] = TTLPin(namespace, ttl_s, expires, len(nodes))
        return len(nodes)

    def forget(self, node: Node) -> None:
        """Drop the TTL of the pin ending at ``node`` (the caller lifts the pin itself)."""
        self._by_node.pop(node, None)

    def clear(self) -> None:
        self._by_node.clear()
        self._next = math.inf

    def next_lapse(self) -> float | None:
        """Seconds until the earliest pin may lapse (0.0: one is due); None without TTL pins."""
        if not self._by_node:
            return None
        return max(0.0, self._next - self._clock())

    def expire(self) -> int:
        """Lift the pins whose deadline passed; returns how many."""
        if not self._by_node:
            self._next = math.inf
            return 0
        now = self._clock()
        if now < self._next:
            return 0
        lapsed = [node for node, pin in self._by_node.items() if pin.expires <= now]
        for node in lapsed:
            del self._by_node[node]
            self._pin_path(node, -1)
            self._lapsed.add(node)
        self._next = min((pin.expires for pin in self._by_node.values()), default=math.inf)
        return len(lapsed)

    def lapsed_at_eviction(self, node: Node, pinned: bool) -> bool:
        """``node`` is being evicted: was it under a TTL pin that lapsed (and is unpinned now)?
        The mark passes to its parent, which that pin covered too."""
        if node not in self._lapsed:
            return False
        self._lapsed.discard(node)
        if node.parent is not None:
            self._lapsed.add(node.parent)
        return not pinned

    def pass_on(self, node: Node) -> None:
        """``node``, a leaf, was evicted and ``tree.remove`` passed its pins to the parent; its
        TTL goes along, merged into one the parent may already have."""
        pin = self._by_node.pop(node, None) if self._by_node else None
        parent = node.parent
        if pin is None or parent is None:
            return
        held = self._by_node.get(parent)
        if held is None:
            self._by_node[parent] = TTLPin(pin.namespace, pin.ttl_s, pin.expires, pin.depth - 1)
        else:
            held.expires = max(held.expires, pin.expires)
            held.ttl_s = max(held.ttl_s, pin.ttl_s)
            self._pin_path(parent, -1)  # two pins on one path, one deadline: keep one

    def check(self, node_of: Callable[[int], Node | None]) -> None:
        for node, pin in self._by_node.items():  # a TTL pin is one of its node's own pins
            assert node_of(node.block) is node and node.own_pins >= 1
            assert pin.depth == sum(1 for _ in node.path_up())
        for node in self._lapsed:  # marks leave with their node
            assert node_of(node.block) is node
