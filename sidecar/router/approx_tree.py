"""What the router sent where: an approximate radix tree over rendered prompts (no I/O).

SGLang's model gateway keeps the same kind of tree: one character-level radix tree shared by
all replicas, each node marked with the replicas that were sent its text and when. It guesses
what a replica caches from what it was asked, so it needs no events, and it is wrong where
the replica evicted (the memory bound below keeps it from growing past what a replica could
hold) or where a request failed.

- ``insert(text, replica)`` marks every node along ``text`` with ``replica`` (now).
- ``match(text) -> (chars, replicas)``: the longest prefix of ``text`` in the tree, and the
  replicas marked on its deepest node, most recent first.
- Each replica's share is bounded by ``max_chars``; past it, its least recently used leaves
  (nodes marked with it and with no child marked with it) lose the mark until it is under
  ``prune_to`` of the bound. A node no replica marks is dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class TextNode:
    text: str  # the edge label from the parent
    parent: TextNode | None
    children: dict[str, TextNode] = field(default_factory=dict)  # first char -> child
    marks: dict[str, int] = field(default_factory=dict)  # replica -> last access tick


class ApproxTree:
    def __init__(self, max_chars: int = 4_000_000, prune_to: float = 0.8) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        self.max_chars = max_chars
        self.prune_to = prune_to
        self._root = TextNode("", None)
        self._ticks = itertools.count(1)
        self.chars: dict[str, int] = {}  # replica -> characters marked with it

    def match(self, text: str) -> tuple[int, list[str]]:
        node, matched = self._root, 0
        best: tuple[int, TextNode] = (0, self._root)
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            n = _common(child.text, text, matched)
            matched += n
            if n < len(child.text):
                best = (matched, child)  # partly inside the child's edge: it still counts
                break
            node = child
            best = (matched, node)
        chars, deepest = best
        replicas = sorted(deepest.marks, key=deepest.marks.__getitem__, reverse=True)
        return chars, replicas

    def insert(self, text: str, replica: str) -> None:
        tick = next(self._ticks)
        node, at = self._root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                child = node.children[text[at]] = TextNode(text[at:], node)
                self._mark(child, replica, tick)
                break
            n = _common(child.text, text, at)
            if n < len(child.text):
                child = self._split(child, n)
            self._mark(child, replica, tick)
            node, at = child, at + n
        if self.chars.get(replica, 0) > self.max_chars:
            self.prune(replica, int(self.max_chars * self.prune_to))

    def forget(self, replica: str) -> None:
        """Drop every mark of ``replica`` (it restarted, or left the pool)."""
        self.prune(replica, 0)

    def prune(self, replica: str, target: int) -> None:
        """Unmark ``replica``'s least recently used leaves until it holds at most ``target``."""
        leaves = [
            n for n in self._nodes() if replica in n.marks and not self._has_marked(n, replica)
        ]
        leaves.sort(key=lambda n: n.marks[replica])
        while leaves and self.chars.get(replica, 0) > target:
            node = leaves.pop(0)
            self._unmark(node, replica)
            parent = node.parent
            if (
                parent is not None
                and parent is not self._root
                and replica in parent.marks
                and not self._has_marked(parent, replica)
            ):
                # the parent became a leaf for this replica: insert it in LRU order
                tick = parent.marks[replica]
                at = next((i for i, n in enumerate(leaves) if n.marks[replica] > tick), len(leaves))
                leaves.insert(at, parent)

    @property
    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())

    # ---- internals

    def _mark(self, node: TextNode, replica: str, tick: int) -> None:
        if replica not in node.marks:
            self.chars[replica] = self.chars.get(replica, 0) + len(node.text)
        node.marks[replica] = tick

    def _unmark(self, node: TextNode, replica: str) -> None:
        del node.marks[replica]
        self.chars[replica] -= len(node.text)
        step: TextNode | None = node
        while step is not None and step.parent is not None and not step.marks and not step.children:
            del step.parent.children[step.text[0]]
            step = step.parent

    def _split(self, node: TextNode, at: int) -> TextNode:
        """Cut ``node``'s edge after ``at`` chars; returns the new upper node (same marks)."""
        assert node.parent is not None and 0 < at < len(node.text)
        upper = TextNode(node.text[:at], node.parent, marks=dict(node.marks))
        node.parent.children[upper.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        # the marked characters are unchanged: the upper node's share moved out of ``node``
        return upper

    def _has_marked(self, node: TextNode, replica: str) -> bool:
        return any(replica in child.marks for child in node.children.values())

    def _nodes(self) -> list[TextNode]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common(edge: str, text: str, start: int) -> int:
    n, limit = 0, min(len(edge), len(text) - start)
    while n < limit and edge[n] == text[start + n]:
        n += 1
    return n
