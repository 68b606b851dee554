"""Block-granular radix tree over token ids: which cached page holds which full block.

A node is one full block of ``block_size`` token ids. Its identity is a chained digest::

    root   = blake2b-128(len(identity) | identity | namespace)   identity: model, tokenizer, dtype
    node_i = blake2b-128(digest(node_{i-1}) or root | token bytes of block i)

so the same tokens after another prefix, under another model or another tenant, never share a
node. Digests are ``hashlib.blake2b(digest_size=16)`` (never Python's ``hash()``, which an
attacker can steer); they name nodes for insert and dedupe, and for routers (``digests``).

Collision guard: lookups never trust a digest. A match walks down from the namespace's root
through children keyed by their exact token bytes, so a hit is the very same token prefix by
construction (a dict hit compares the 64 key bytes). An insert whose digest is already taken by
a node with other content (parent digest or tokens differ) is refused: that block stays private.
With 128-bit digests that never happens in practice; the guard makes it harmless if it does, and
the walk costs no hashing at all, so a warm hit is cheap: hashing runs only for new blocks.

Token ids are stored as native uint32 bytes (``array('I')``), the whole prompt converted once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

DigestFn = Callable[[bytes, bytes], bytes]
NewBlock = Callable[[], int | None]  # a page for a new node, or None when there is none
TOKEN_BYTES = 4


def block_digest(parent: bytes, tokens: bytes) -> bytes:
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


def root_digest(identity: bytes, namespace: str) -> bytes:
    """The chain's start for one (model/tokenizer/dtype identity, namespace) pair."""
    h = hashlib.blake2b(digest_size=16, person=b"prefixcache.root")
    h.update(len(identity).to_bytes(8, "little"))
    h.update(identity)
    h.update(namespace.encode("utf-8"))
    return h.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


@dataclass(slots=True)
class Children:
    by_tokens: dict[bytes, Node] = field(default_factory=dict)  # exact block bytes -> child
    by_first: dict[bytes, list[Node]] = field(default_factory=dict)  # for partial matches

    def add(self, node: Node) -> None:
        self.by_tokens[node.tokens] = node
        self.by_first.setdefault(node.tokens[:TOKEN_BYTES], []).append(node)

    def discard(self, node: Node) -> None:
        del self.by_tokens[node.tokens]
        key = node.tokens[:TOKEN_BYTES]
        group = self.by_first[key]
        group.remove(node)
        if not group:
            del self.by_first[key]


@dataclass(slots=True, eq=False)
class Node:
    digest: bytes
    parent_digest: bytes  # the parent node's digest, or the namespace root digest
    tokens: bytes  # this block's token ids (uint32 bytes)
    block: int
    parent: Node | None  # None: a child of the namespace root
    children: Children = field(default_factory=Children)
    own_pins: int = 0  # pins whose prefix ends at this node
    hits: int = 0  # matches that reused this block (the tier's write-after-hit policy)

    @property
    def num_children(self) -> int:
        return len(self.children.by_tokens)

    def path_up(self) -> Iterator[Node]:
        """This node, its parent, and so on up to its namespace's top block: deepest first."""
        node: Node | None = self
        while node is not None:
            yield node
            node = node.parent


class PrefixTree:
    def __init__(self, block_size: int, num_blocks: int, digest: DigestFn = block_digest) -> None:
        self.block_size = block_size
        self._block_bytes = block_size * TOKEN_BYTES
        self.digest = digest
        self._nodes: dict[bytes, Node] = {}
        self._by_block: list[Node | None] = [None] * num_blocks
        self._roots: dict[bytes, Children] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def node_of(self, block: int) -> Node | None:
        return self._by_block[block]

    def digests_of(self, blocks: list[int]) -> list[bytes]:
        """The digests of cached blocks (a match's hit blocks)."""
        by_block = self._by_block
        nodes = [by_block[block] for block in blocks]
        assert None not in nodes, "stale match: a matched block was evicted"
        return [node.digest for node in nodes]  # type: ignore[union-attr]

    def digests(self, root: bytes, data: bytes) -> list[bytes]:
        """Chained digests of every full block in ``data`` (token bytes)."""
        nbytes, h = self._block_bytes, self.digest
        out: list[bytes] = []
        parent = root
        for off in range(0, len(data) - nbytes + 1, nbytes):
            parent = h(parent, data[off : off + nbytes])
            out.append(parent)
        return out

    def children(self, parent: Node | None, root: bytes) -> Children | None:
        return parent.children if parent is not None else self._roots.get(root)

    def walk(self, root: bytes, data: bytes, max_blocks: int) -> list[Node]:
        """Nodes of the longest cached prefix of ``data``, at most ``max_blocks`` of them."""
        nbytes = self._block_bytes
        end = min(max_blocks, len(data) // nbytes) * nbytes
        out: list[Node] = []
        kids = self._roots.get(root)
        if kids is None:
            return out
        for off in range(0, end, nbytes):
            node = kids.by_tokens.get(data[off : off + nbytes])
            if node is None:
                break
            out.append(node)
            kids = node.children
        return out

    def best_partial(
        self, parent: Node | None, root: bytes, data: bytes, max_tokens: int
    ) -> tuple[Node | None, int]:
        """The child of ``parent`` sharing the most leading tokens with ``data`` (≤ max_tokens)."""
        kids = self.children(parent, root)
        if kids is None or max_tokens <= 0 or len(data) < TOKEN_BYTES:
            return None, 0
        best, best_len = None, 0
        limit = min(max_tokens, len(data) // TOKEN_BYTES, self.block_size)
        for child in kids.by_first.get(data[:TOKEN_BYTES], ()):
            n = _common_tokens(child.tokens, data, limit)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def find_or_insert(
        self, parent: Node | None, root: bytes, tokens: bytes, block: int | NewBlock
    ) -> tuple[Node | None, bool]:
        """The child of ``parent`` (None: of the namespace ``root``) holding exactly ``tokens``,
        and whether it is new: inserted on ``block``, or on the page a ``block()`` call returns
        (called only once the insert can go ahead, so no page is taken in vain). (None, False):
        the digest is another node's (a collision: the caller keeps its block private), or
        ``block()`` had no page."""
        kids = self.children(parent, root)
        node = kids.by_tokens.get(tokens) if kids is not None else None
        if node is not None:
            return node, False
        digest = self.digest(parent.digest if parent is not None else root, tokens)
        if not self.can_insert(digest):
            return None, False
        page = block() if callable(block) else block
        if page is None:
            return None, False
        return self.insert(parent, root, digest, tokens, page), True

    def can_insert(self, digest: bytes) -> bool:
        """False when another node already holds this digest (a collision)."""
        return digest not in self._nodes

    def insert(
        self, parent: Node | None, root: bytes, digest: bytes, tokens: bytes, block: int
    ) -> Node:
        assert digest not in self._nodes and self._by_block[block] is None
        assert len(tokens) == self._block_bytes
        node = Node(digest, parent.digest if parent is not None else root, tokens, block, parent)
        kids = parent.children if parent is not None else self._roots.setdefault(root, Children())
        assert tokens not in kids.by_tokens, "the same block twice under one parent"
        kids.add(node)
        self._nodes[digest] = node
        self._by_block[block] = node
        return node

    def remove(self, block: int) -> Node:
        """Remove a leaf. Its pins pass to its parent, so the rest of the prefix stays pinned."""
        node = self._by_block[block]
        assert node is not None, f"block {block} is not cached"
        assert node.num_children == 0, f"block {block} still has children"
        parent = node.parent
        kids = parent.children if parent is not None else self._roots[node.parent_digest]
        kids.discard(node)
        if parent is not None:
            parent.own_pins += node.own_pins
        elif not kids.by_tokens:
            del self._roots[node.parent_digest]
        del self._nodes[node.digest]
        self._by_block[block] = None
        return node

    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    def check(self) -> None:
        for digest, node in self._nodes.items():
            assert node.digest == digest and self._by_block[node.block] is node
            parent = node.parent
            if parent is None:
                kids = self._roots[node.parent_digest]
            else:
                assert self._nodes.get(parent.digest) is parent, "node without its parent"
                assert node.parent_digest == parent.digest
                kids = parent.children
            assert kids.by_tokens[node.tokens] is node
            assert any(n is node for n in kids.by_first[node.tokens[:TOKEN_BYTES]])
            assert node.own_pins >= 0
            assert sum(len(g) for g in node.children.by_first.values()) == node.num_children
            assert all(child.parent is node for child in node.children.by_tokens.values())
        assert all(kids.by_tokens for kids in self._roots.values())
        assert sum(len(kids.by_tokens) for kids in self._roots.values()) + sum(
            n.num_children for n in self._nodes.values()
        ) == len(self._nodes)
        assert sum(n is not None for n in self._by_block) == len(self._nodes)


def _common_tokens(a: bytes, b: bytes, limit: int) -> int:
    n = 0
    while (
        n < limit
        and a[n * TOKEN_BYTES : (n + 1) * TOKEN_BYTES] == b[n * TOKEN_BYTES : (n + 1) * TOKEN_BYTES]
    ):
        n += 1
    return n
