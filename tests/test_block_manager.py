import pytest
from block_table_fork import fork

from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.block_types import BlockTable, OutOfBlocksError, PrefixMatch
from prefixcache.engine.memory.prefix_tree import PrefixTree

BS = 4
IDENTITY = b"model|tokenizer|fp32"


class Copies:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, k: int) -> None:
        self.calls.append((src, dst, k))


def make(num_blocks: int = 8, **kwargs: object) -> tuple[BlockManager, Copies]:
    copies = Copies()
    return BlockManager(num_blocks, BS, IDENTITY, copies, **kwargs), copies  # type: ignore[arg-type]


def run(bm: BlockManager, prompt: list[int], namespace: str = "") -> BlockTable:
    """Match, allocate, compute the whole prompt, commit: what the scheduler does."""
    match = bm.match(prompt, namespace, len(prompt) - 1)
    assert bm.can_allocate(match, len(prompt))
    table = bm.allocate(prompt, namespace, match, len(prompt))
    bm.commit(table, prompt, len(prompt))
    bm.check_invariants()
    return table


def test_cold_match_is_empty_and_read_only() -> None:
    bm, _ = make()
    match = bm.match(list(range(10)), "", 9)
    assert match == PrefixMatch([], None, 0, BS) and match.num_tokens == 0
    table = run(bm, list(range(10)))
    stats = bm.stats()
    match = bm.match(list(range(10)), "", 9)
    assert match.blocks == table.block_ids[:2]
    assert bm.stats() == stats  # no stats counted, no refs taken
    assert [bm.ref_count(b) for b in match.blocks] == [1, 1]


def test_full_hit_is_capped_so_the_last_token_is_computed() -> None:
    bm, copies = make()
    prompt = list(range(8))
    first = run(bm, prompt)
    match = bm.match(prompt, "", len(prompt) - 1)
    assert match.blocks == first.block_ids[:1]
    assert match.partial_block == first.block_ids[1] and match.partial_tokens == BS - 1
    assert match.num_tokens == 7
    table = bm.allocate(prompt, "", match, len(prompt))
    assert table.num_cached_tokens == 7
    assert copies.calls == [(first.block_ids[1], table.block_ids[1], 3)]
    assert bm.match(prompt, "", 2).num_tokens == 2  # the cap applies to the partial too
    assert bm.match(prompt, "", 0).num_tokens == 0


def test_partial_match_inside_a_block_is_copied_into_a_private_block() -> None:
    bm, copies = make()
    first = run(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prompt = [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]
    match = bm.match(prompt, "", len(prompt) - 1)
    assert (match.blocks, match.partial_block, match.partial_tokens) == (
        first.block_ids[:1],
        first.block_ids[1],
        2,
    )
    table = bm.allocate(prompt, "", match, len(prompt))
    assert table.block_ids[0] == first.block_ids[0] and bm.ref_count(first.block_ids[0]) == 2
    assert table.block_ids[1] not in first.block_ids  # private: the cached block is read-only
    assert copies.calls == [(first.block_ids[1], table.block_ids[1], 2)]
    assert table.num_cached_tokens == 6 and table.num_slots >= len(prompt)
    assert bm.stats().hit_tokens == 6
    bm.check_invariants()


def test_namespaces_and_identities_never_share_blocks() -> None:
    bm, _ = make()
    prompt = list(range(9))
    run(bm, prompt, "tenant-a")
    assert bm.match(prompt, "tenant-b", 8).num_tokens == 0
    assert bm.match(prompt, "tenant-a", 8).num_tokens == 8
    other, _ = make()
    assert other.block_hashes(prompt, "tenant-a") == bm.block_hashes(prompt, "tenant-a")
    another = BlockManager(8, BS, b"other-model|tokenizer|fp32")
    assert another.block_hashes(prompt, "tenant-a") != bm.block_hashes(prompt, "tenant-a")


def test_blocks_are_visible_only_after_commit() -> None:
    bm, _ = make()
    prompt = list(range(12))
    match = bm.match(prompt, "", 11)
    table = bm.allocate(prompt, "", match, len(prompt))
    assert bm.match(prompt, "", 11).num_tokens == 0  # allocated, KV not written yet
    bm.commit(table, prompt, 6)  # only the first full block is written
    assert table.num_committed_blocks == 1
    assert bm.match(prompt, "", 11).blocks == table.block_ids[:1]
    bm.commit(table, prompt, 12)
    assert table.num_committed_blocks == 3 and len(table.hashes) == 3
    assert table.hashes == bm.block_hashes(prompt, "")
    assert bm.stats().inserted_tokens == 12
    bm.check_invariants()


def test_identical_blocks_dedupe_re_pointing_before_freeing() -> None:
    bm, _ = make()
    prompt = list(range(9))
    empty = bm.match(prompt, "", 8)
    a = bm.allocate(prompt, "", empty, 9)
    b = bm.allocate(prompt, "", empty, 9)
    bm.commit(a, prompt, 9)
    copies = list(b.block_ids[:2])
    deref = bm._pool.deref

    def checked_deref(block: int) -> None:
        assert block not in b.block_ids, "freed a block the table still points at"
        deref(block)

    bm._pool.deref = checked_deref  # type: ignore[method-assign]
    bm.commit(b, prompt, 9)
    bm._pool.deref = deref  # type: ignore[method-assign]
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert all(bm.ref_count(block) == 2 for block in a.block_ids[:2])
    assert all(bm.ref_count(block) == 0 for block in copies)
    assert bm.num_free_blocks == 8 - 4
    assert bm.stats().inserted_tokens == 8  # the duplicates are not inserted twice
    bm.check_invariants()


def test_free_keeps_committed_blocks_cached_and_releases_the_rest() -> None:
    bm, _ = make()
    table = run(bm, list(range(10)))
    bm.free(table)
    assert table.block_ids == [] and table.num_committed_blocks == 0
    assert (bm.num_free_blocks, bm.num_cached_idle_blocks, bm.num_used_blocks) == (6, 2, 0)
    bm.free(table)  # a second free is harmless
    bm.check_invariants()


def test_eviction_takes_least_recently_used_leaves_deepest_first() -> None:
    bm, _ = make(num_blocks=6)
    old = run(bm, list(range(12)))  # 3 blocks: a -> b -> c
    new = run(bm, [50, 51, 52, 53, 54])  # 1 block + 1 uncommitted
    chain = list(old.block_ids)
    bm.free(old)
    bm.free(new)
    # free ones first: the 2 free blocks go before any cached one
    filler = run(bm, [90, 91, 92, 93, 94, 95, 96])
    assert bm.stats().evicted_tokens == 0
    bm.grow(filler, 12)  # one more block: evicts the deepest block of the oldest prefix
    assert bm.stats().evicted_tokens == BS
    assert bm.match(list(range(12)), "", 11).blocks == chain[:2]
    bm.grow(filler, 16)
    assert bm.match(list(range(12)), "", 11).blocks == chain[:1]
    assert bm.match([50, 51, 52, 53, 54], "", 4).num_tokens == 4  # newer prefix survives
    bm.check_invariants()


def test_a_shared_block_mid_table_with_different_children_goes_last() -> None:
    bm, _ = make(num_blocks=6)
    a = run(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])  # blocks p, x (+ a private tail)
    b = run(bm, [1, 2, 3, 4, 9, 9, 9, 9, 0])  # shares p, then y: a different child
    parent = a.block_ids[0]
    assert b.block_ids[0] == parent and bm.ref_count(parent) == 2
    bm.free(a)  # x idle, p still in use by b
    assert bm.ref_count(parent) == 1 and bm.num_cached_idle_blocks == 1
    bm.free(b)
    assert bm.num_cached_idle_blocks == 3 and bm.num_free_blocks == 3
    table = run(bm, [70] * 20)  # 5 blocks: 3 free, then evicts the leaves x and y, not p
    assert bm.stats().evicted_tokens == 2 * BS
    assert bm.match([1, 2, 3, 4, 5, 6, 7, 8, 0], "", 8).blocks == [parent]
    assert bm.match([1, 2, 3, 4, 9, 9, 9, 9, 0], "", 8).blocks == [parent]
    bm.grow(table, 24)  # p is a childless leaf now: it goes next
    assert bm.match([1, 2, 3, 4, 0], "", 4).num_tokens == 0
    bm.check_invariants()


def test_pinned_prefixes_are_evicted_last_and_never_by_evict_all() -> None:
    bm, _ = make(num_blocks=4)
    pinned_prompt = list(range(8))
    bm.free(run(bm, pinned_prompt + [0]))
    assert bm.pin(pinned_prompt, "") == 2 and bm.num_pinned_blocks == 2
    bm.free(run(bm, [7, 7, 7, 7, 0]))  # an unpinned, more recent prefix
    assert bm.evict_all() == 1
    assert bm.match(pinned_prompt + [0], "", 8).num_tokens == 8
    first = bm.match(pinned_prompt, "", 8).blocks[0]
    table = run(bm, [5] * 12)  # needs 3 blocks: 2 free + evicts the pinned leaf only
    assert bm.match(pinned_prompt + [0], "", 8).blocks == [first]
    assert bm.num_pinned_blocks == 1  # the pin now covers what is left of the prefix
    assert bm.stats().evicted_tokens == 2 * BS
    bm.free(table)
    bm.check_invariants()


def test_unpin_releases_the_pin_and_makes_blocks_evictable() -> None:
    bm, _ = make()
    prompt = list(range(8))
    bm.free(run(bm, prompt + [0]))
    assert bm.pin(prompt, "") == 2
    assert bm.pin(prompt[:4], "") == 1
    assert bm.evict_all() == 0
    assert bm.unpin(prompt, "") == 2  # the deepest pin first
    assert bm.num_pinned_blocks == 1
    assert bm.evict_all() == 1  # the leaf only: its parent is still pinned
    assert bm.unpin(prompt, "") == 1
    assert bm.unpin(prompt, "") == 0 and bm.num_pinned_blocks == 0
    assert bm.evict_all() == 1
    assert bm.pin(prompt, "other") == 0
    bm.check_invariants()


def test_refuses_cleanly_when_the_pool_cannot_serve() -> None:
    bm, _ = make(num_blocks=3)
    table = run(bm, list(range(9)))  # 3 blocks in use
    match = bm.match([1] * 8, "", 7)
    before = bm.stats()
    assert not bm.can_allocate(match, 8)
    with pytest.raises(OutOfBlocksError):
        bm.allocate([1] * 8, "", match, 8)
    assert not bm.can_grow(table, 13)
    with pytest.raises(OutOfBlocksError):
        bm.grow(table, 13)
    assert bm.can_grow(table, 12)  # already holds 12 slots
    assert bm.stats() == before
    bm.check_invariants()


def test_can_allocate_does_not_count_matched_idle_blocks_as_free() -> None:
    bm, _ = make(num_blocks=3)
    prompt = list(range(9))
    bm.free(run(bm, prompt))  # 2 cached idle + 1 free
    match = bm.match(prompt + [1, 2, 3, 4], "", 12)
    assert len(match.blocks) == 2
    assert bm.can_allocate(match, 12)  # 2 shared + 1 fresh
    assert not bm.can_allocate(match, 13)  # would need to evict its own matched blocks
    assert not bm.can_allocate(PrefixMatch([], None, 0, BS), 13)


def test_partial_source_is_not_evicted_into_its_own_copy() -> None:
    bm, copies = make(num_blocks=2)
    bm.free(run(bm, [1, 2, 3, 4, 5, 6, 7, 8]))  # both blocks cached idle
    prompt = [1, 2, 3, 4, 5, 6, 0]
    match = bm.match(prompt, "", 6)
    assert match.partial_tokens == 2
    table = bm.allocate(prompt, "", match, len(prompt))
    # the only block left to take is the partial source itself: skip the copy, compute instead
    assert copies.calls == [] and table.num_cached_tokens == 4
    bm.check_invariants()


def test_stats_are_in_tokens() -> None:
    bm, _ = make(num_blocks=3)
    bm.free(run(bm, list(range(9))))
    bm.free(run(bm, list(range(9))))
    bm.free(run(bm, [9] * 12))
    stats = bm.stats()
    assert stats.query_tokens == 30
    assert stats.hit_tokens == 8
    assert stats.inserted_tokens == 8 + 12
    assert stats.evicted_tokens == 8
    assert (stats.num_free_blocks, stats.num_cached_idle_blocks, stats.num_used_blocks) == (0, 3, 0)
    assert (stats.num_blocks, stats.block_size) == (3, BS)


def test_fork_shares_committed_blocks_and_copies_the_rest() -> None:
    bm, copies = make()
    prompt = list(range(10))
    table = run(bm, prompt)
    child = fork(bm, table, prompt, 10, copies)
    assert child.block_ids[:2] == table.block_ids[:2]
    assert child.block_ids[2] != table.block_ids[2]
    assert copies.calls[-1] == (table.block_ids[2], child.block_ids[2], 2)
    assert child.num_committed_blocks == 2 and child.hashes == table.hashes
    assert [bm.ref_count(b) for b in table.block_ids] == [2, 2, 1]
    bm.free(table)
    bm.free(child)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_collision_guard_keeps_colliding_blocks_private() -> None:
    bm, _ = make()
    bm._tree = PrefixTree(BS, 8, digest=lambda parent, tokens: b"same-digest-16by")
    a = run(bm, [1, 2, 3, 4, 0])
    b = run(bm, [5, 6, 7, 8, 0])  # its digest collides with a's block
    assert a.num_committed_blocks == 1 and b.num_committed_blocks == 0
    assert bm.match([5, 6, 7, 8, 0], "", 4).num_tokens == 0
    bm.free(b)
    assert bm.num_used_blocks == 2
    bm.check_invariants()


def test_disabled_caching_shares_nothing() -> None:
    bm, _ = make(enable_caching=False)
    prompt = list(range(9))
    table = run(bm, prompt)
    assert table.num_committed_blocks == 0 and bm.match(prompt, "", 8).num_tokens == 0
    bm.free(table)
    assert bm.num_free_blocks == 8 and bm.pin(prompt, "") == 0 and bm.evict_all() == 0
    bm.check_invariants()
