import hashlib

import pytest

from prefixcache.engine.memory.prefix_tree import (
    PrefixTree,
    block_digest,
    root_digest,
    token_bytes,
)

BS = 4


def build(tree: PrefixTree, root: bytes, tokens: list[int], first_block: int = 0) -> list[int]:
    """Insert every full block of ``tokens`` as a chain; returns the block ids used."""
    data = token_bytes(tokens)
    parent, blocks = None, []
    for i, digest in enumerate(tree.digests(root, data)):
        chunk = data[i * BS * 4 : (i + 1) * BS * 4]
        parent = tree.insert(parent, root, digest, chunk, first_block + i)
        blocks.append(first_block + i)
    return blocks


def test_digest_is_blake2b_128_of_parent_and_tokens_not_builtin_hash() -> None:
    parent, tokens = b"p" * 16, token_bytes([1, 2, 3, 4])
    assert block_digest(parent, tokens) == hashlib.blake2b(parent + tokens, digest_size=16).digest()


def test_root_digest_separates_identity_and_namespace() -> None:
    base = root_digest(b"model|tok|bf16", "tenant-a")
    assert base == root_digest(b"model|tok|bf16", "tenant-a")
    assert base != root_digest(b"model|tok|bf16", "tenant-b")
    assert base != root_digest(b"model|tok|fp16", "tenant-a")
    # identity is length-prefixed: moving bytes between identity and namespace changes the root
    assert root_digest(b"ab", "c") != root_digest(b"a", "bc")


def test_digests_chain_on_the_whole_prefix() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    a = tree.digests(root, token_bytes([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = tree.digests(root, token_bytes([0, 2, 3, 4, 5, 6, 7, 8]))
    assert len(a) == 2  # only full blocks
    assert a[0] != b[0] and a[1] != b[1]  # same second block after another first block
    assert tree.digests(root_digest(b"m", "x"), token_bytes([1, 2, 3, 4]))[0] != a[0]


def test_walk_finds_the_longest_cached_prefix_and_respects_the_cap() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    blocks = build(tree, root, list(range(12)))
    nodes = tree.walk(root, token_bytes([*range(8), 99, 9, 10, 11]), 10)
    assert [n.block for n in nodes] == blocks[:2]
    assert [n.block for n in tree.walk(root, token_bytes(list(range(12))), 1)] == blocks[:1]
    assert tree.walk(root_digest(b"m", "other"), token_bytes(list(range(12))), 3) == []


def test_collision_guard_rejects_a_colliding_digest() -> None:
    # a deliberately weak digest: every block of the same namespace collides
    tree = PrefixTree(BS, 8, digest=lambda parent, tokens: parent[:8] + b"weak0000")
    root = root_digest(b"m", "")
    build(tree, root, [1, 2, 3, 4])
    assert [n.block for n in tree.walk(root, token_bytes([1, 2, 3, 4]), 1)] == [0]
    assert tree.walk(root, token_bytes([5, 6, 7, 8]), 1) == []  # same digest, other tokens
    other = token_bytes([5, 6, 7, 8])
    assert not tree.can_insert(tree.digest(root, other))  # the caller keeps that block private
    assert tree.digests(root, other) == tree.digests(root, token_bytes([1, 2, 3, 4]))


def test_find_or_insert_finds_inserts_and_asks_for_a_page_only_when_it_can_insert() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    first, second = token_bytes([1, 2, 3, 4]), token_bytes([5, 6, 7, 8])
    node, new = tree.find_or_insert(None, root, first, 3)
    assert new and node is not None and node.block == 3 and tree.node_of(3) is node
    asked: list[int] = []

    def page() -> int | None:
        asked.append(5)
        return 5

    assert tree.find_or_insert(None, root, first, page) == (node, False) and asked == []
    child, new = tree.find_or_insert(node, root, second, page)
    assert new and child is not None and child.parent is node and asked == [5]
    assert child.digest == block_digest(node.digest, second)
    assert tree.find_or_insert(node, root, first, lambda: None) == (None, False)  # no page
    assert [n.block for n in child.path_up()] == [5, 3]
    tree.check()

    weak = PrefixTree(BS, 8, digest=lambda parent, tokens: b"same-digest-16by")
    weak.find_or_insert(None, root, first, 0)
    assert weak.find_or_insert(None, root, second, page) == (None, False)  # a collision
    assert asked == [5] and len(weak) == 1  # no page was asked for


def test_best_partial_picks_the_child_with_most_leading_tokens() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    build(tree, root, [1, 2, 3, 4, 5, 6, 7, 8])
    first = tree.walk(root, token_bytes([1, 2, 3, 4]), 1)[0]
    sibling = token_bytes([5, 6, 0, 0])
    tree.insert(first, root, block_digest(first.digest, sibling), sibling, 4)
    rest = token_bytes([5, 6, 7, 9])
    node, k = tree.best_partial(first, root, rest, BS - 1)
    assert node is not None and node.block == 1 and k == 3
    node, k = tree.best_partial(first, root, rest, 2)
    assert k == 2
    assert tree.best_partial(first, root, token_bytes([9]), 3) == (None, 0)
    node, k = tree.best_partial(None, root, token_bytes([1, 2]), 3)  # prompt ends inside a block
    assert node is not None and node.block == 0 and k == 2


def test_remove_takes_leaves_only_and_hands_pins_to_the_parent() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    build(tree, root, list(range(8)))
    leaf = tree.node_of(1)
    assert leaf is not None
    leaf.own_pins = 2
    with pytest.raises(AssertionError):
        tree.remove(0)
    tree.remove(1)
    parent = tree.node_of(0)
    assert parent is not None and parent.own_pins == 2 and parent.num_children == 0
    tree.remove(0)
    assert len(tree) == 0
    tree.check()


def test_check_catches_a_node_without_its_parent() -> None:
    tree = PrefixTree(BS, 8)
    root = root_digest(b"m", "")
    build(tree, root, list(range(8)))
    parent = tree.node_of(0)
    assert parent is not None
    del tree._nodes[parent.digest]
    with pytest.raises(AssertionError):
        tree.check()
