import pytest

from prefixcache.engine.memory.block_pool import BlockPool


def cached_idle(pool: BlockPool, block: int) -> None:
    """Mark a freshly taken block as cached, then release it: it becomes cached-idle."""
    pool.mark_cached(block)
    pool.deref(block)


def test_free_blocks_are_handed_out_before_cached_ones() -> None:
    pool = BlockPool(3)
    a = pool.take_free()
    assert a is not None
    cached_idle(pool, a)
    b, c = pool.take_free(), pool.take_free()
    assert a not in (b, c) and None not in (b, c)
    assert pool.take_free() is None  # only the cached one is left: the manager must evict it
    assert pool.oldest_idle() == a
    pool.check()


def test_counters_add_up_to_capacity() -> None:
    pool = BlockPool(4)
    a, b = pool.take_free(), pool.take_free()
    assert a is not None and b is not None
    cached_idle(pool, a)
    assert (pool.num_free, pool.num_cached_idle, pool.num_used) == (2, 1, 1)
    assert pool.num_available == 3
    pool.check()


def test_idle_blocks_leave_in_lru_order_and_a_ref_touches() -> None:
    pool = BlockPool(3)
    blocks = [pool.take_free() for _ in range(3)]
    for block in blocks:
        assert block is not None
        cached_idle(pool, block)
    assert pool.idle_order(pinned=False) == blocks
    pool.ref(blocks[0])  # a hit takes it out of the LRU ...
    assert pool.oldest_idle() == blocks[1]
    pool.deref(blocks[0])  # ... and releasing it makes it the most recent
    assert pool.idle_order(pinned=False) == [blocks[1], blocks[2], blocks[0]]
    pool.check()


def test_pinned_idle_blocks_come_after_every_unpinned_one() -> None:
    pool = BlockPool(2)
    a, b = pool.take_free(), pool.take_free()
    assert a is not None and b is not None
    cached_idle(pool, a)
    cached_idle(pool, b)
    pool.pin(a)
    assert pool.num_pinned == 1
    assert pool.oldest_idle() == b
    pool.evict(b)
    assert pool.oldest_idle(include_pinned=False) is None
    assert pool.oldest_idle() == a
    pool.unpin(a)
    assert pool.oldest_idle(include_pinned=False) == a and pool.num_pinned == 0
    pool.check()


def test_evicted_block_is_free_and_handed_out_next() -> None:
    pool = BlockPool(2)
    a = pool.take_free()
    assert a is not None
    cached_idle(pool, a)
    pool.pin(a)
    pool.evict(a)
    assert not pool.cached[a] and pool.pin_count[a] == 0 and pool.num_pinned == 0
    assert pool.take_free() == a
    pool.check()


def test_a_block_in_use_is_never_evicted_or_shared_when_free() -> None:
    pool = BlockPool(2)
    a = pool.take_free()
    assert a is not None
    pool.mark_cached(a)
    with pytest.raises(AssertionError):
        pool.evict(a)
    b = pool.take_free()
    assert b is not None
    pool.deref(b)  # uncached: straight back to the free list
    with pytest.raises(AssertionError):
        pool.ref(b)
    with pytest.raises(AssertionError):
        pool.deref(b)


def test_check_catches_a_leak() -> None:
    pool = BlockPool(3)
    pool._free.pop()  # a block vanishes from every list
    with pytest.raises(AssertionError):
        pool.check()
