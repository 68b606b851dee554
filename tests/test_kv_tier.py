"""The KV tier below the pool, and TTL pins.

Outputs: a request served from reloaded KV (host or disk tier) gives the same greedy tokens and
logprobs as the same request computed cold. Isolation: a tenant never reloads another tenant's
spilled blocks. Damage: a corrupt slot is a miss, never wrong KV. TTL: a pinned prefix survives
eviction pressure until its deadline, hits renew it, then it is an ordinary LRU entry (an
injected clock; no sleeps). Files: a disk tier's file goes at close unless kept.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from prefixcache.engine.config import EngineConfig, TierSpec
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.kv_tier import DiskSlots, HostSlots, KVTier
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.observability.cache_activity import CacheActivity
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.sdk.cache_stats import TierBlockStats

BS = 4


class Pages:
    """``PageIO`` over an int64 array, one row of BS values a page."""

    bytes_per_block = BS * 8

    def __init__(self, num_blocks: int) -> None:
        self.kv = np.zeros((num_blocks, BS), dtype=np.int64)

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return self.kv[pages].view(np.uint8).copy()

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self.kv[pages] = np.ascontiguousarray(data).view(np.int64).reshape(len(pages), BS)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int = 8, slots: int = 16, writer: bool = False, **kw) -> BlockManager:
    pages = Pages(num_blocks)
    tier = KVTier(HostSlots(slots, Pages.bytes_per_block, False), pages, writer=writer)
    return BlockManager(num_blocks, BS, b"model|tok|fp32", tier=tier, **kw)


def pages_of(bm: BlockManager) -> Pages:
    assert bm.tier is not None
    return bm.tier.pages  # type: ignore[return-value]


def compute(bm: BlockManager, prompt: list[int], namespace: str, value: int) -> list[int]:
    """Allocate, write ``value`` into every computed slot, commit, free; the table's blocks."""
    match = bm.match(prompt, namespace, len(prompt) - 1)
    table = bm.allocate(prompt, namespace, match, len(prompt))
    kv = pages_of(bm).kv
    for pos in range(table.num_cached_tokens, len(prompt)):
        kv[table.block_ids[pos // BS], pos % BS] = value
    bm.commit(table, prompt, len(prompt))
    blocks = list(table.block_ids)
    bm.free(table)
    return blocks


def test_spilled_blocks_reload_with_their_kv() -> None:
    bm = manager()
    prompt = list(range(13))
    compute(bm, prompt, "a", 7)
    assert bm.evict_all(keep_tier=True) == 3
    match = bm.match(prompt, "a", 12)
    assert match.blocks == [] and len(match.tier) == 3 and match.num_tokens == 12
    table = bm.allocate(prompt, "a", match, 13)
    assert table.num_cached_tokens == table.num_reloaded_tokens == 12
    assert (pages_of(bm).kv[table.block_ids[:3]] == 7).all()
    assert bm.stats().reloaded_tokens == 12 and bm.stats().hit_tokens == 12
    bm.free(table)
    bm.check_invariants()


def test_a_tenant_never_reloads_another_tenants_blocks() -> None:
    bm = manager()
    prompt = list(range(13))
    compute(bm, prompt, "tenant-a", 7)
    bm.evict_all(keep_tier=True)
    assert len(bm.tier or ()) == 3
    match = bm.match(prompt, "tenant-b", 12)
    assert match.num_tokens == 0 and match.tier == []
    blocks = compute(bm, prompt, "tenant-b", 9)
    assert (pages_of(bm).kv[blocks[:3]] == 9).all()  # computed, not tenant-a's 7s
    assert bm.stats().reloaded_tokens == 0


def test_a_damaged_slot_is_a_miss_and_leaves_the_tier() -> None:
    bm = manager()
    prompt = list(range(13))
    compute(bm, prompt, "a", 7)
    bm.evict_all(keep_tier=True)
    tier = bm.tier
    assert tier is not None
    digests = bm.match(prompt, "a", 12).tier
    tier.corrupt_slot(digests[1])
    match = bm.match(prompt, "a", 12)
    table = bm.allocate(prompt, "a", match, 13)
    assert table.num_reloaded_tokens == BS  # the first block only: the reload stops there
    assert digests[1] not in tier and tier.stats().corrupt == 1
    bm.free(table)
    bm.check_invariants()


def test_write_after_hit_spills_only_blocks_that_were_hit() -> None:
    bm = manager(spill_policy="hit")
    once, twice = list(range(9)), list(range(100, 109))
    compute(bm, once, "a", 1)
    compute(bm, twice, "a", 2)
    compute(bm, twice, "a", 2)  # a hit on its two full blocks
    bm.evict_all(keep_tier=True)
    assert bm.match(once, "a", 8).tier == []
    assert len(bm.match(twice, "a", 8).tier) == 2


def test_the_tier_lru_drops_its_oldest_entries() -> None:
    bm = manager(num_blocks=8, slots=4)
    first, second = list(range(13)), list(range(50, 63))
    compute(bm, first, "a", 1)
    bm.evict_all(keep_tier=True)
    compute(bm, second, "a", 2)
    bm.evict_all(keep_tier=True)
    tier = bm.tier
    assert tier is not None and len(tier) == 4 and tier.stats().drops == 2
    assert len(bm.match(second, "a", 12).tier) == 3
    # evictions spill leaves first, so the tier drops a prefix's deepest blocks first: what is
    # left of the first prompt is its top block, still reachable
    assert len(bm.match(first, "a", 12).tier) == 1
    tier.check()


def test_writes_on_the_writer_thread_are_waited_for_by_a_reload() -> None:
    bm = manager(writer=True)
    prompt = list(range(17))
    compute(bm, prompt, "a", 5)
    bm.evict_all(keep_tier=True)
    match = bm.match(prompt, "a", 16)
    table = bm.allocate(prompt, "a", match, 17)
    assert table.num_reloaded_tokens == 16
    assert (pages_of(bm).kv[table.block_ids[:4]] == 5).all()
    assert bm.tier is not None
    bm.tier.close()


# ---- TTL pins ------------------------------------------------------------------------------


def fill_pool(bm: BlockManager, seed: int, count: int) -> None:
    """Eviction pressure: compute ``count`` distinct 2-block prompts."""
    for i in range(count):
        compute(bm, [seed * 1000 + i * 10 + k for k in range(9)], "a", 3)


def test_a_ttl_pin_survives_pressure_until_its_deadline_then_is_evictable() -> None:
    clock = Clock()
    bm = BlockManager(8, BS, b"m", clock=clock)
    prefix = list(range(9))
    compute_plain(bm, prefix)
    assert bm.pin(prefix, "a", ttl_s=300) == 2
    clock.now = 299
    bm.expire_pins()
    fill_plain(bm, 1, 10)
    assert len(bm.match(prefix, "a", 8).blocks) == 2  # still cached
    clock.now = 300
    assert bm.expire_pins() == 1 and bm.num_pinned_blocks == 0
    fill_plain(bm, 2, 10)
    assert bm.match(prefix, "a", 8).blocks == []  # an ordinary LRU entry: evicted
    bm.check_invariants()


def test_hits_renew_a_ttl_pin() -> None:
    clock = Clock()
    bm = BlockManager(8, BS, b"m", clock=clock)
    prefix = list(range(9))
    compute_plain(bm, prefix)
    bm.pin(prefix, "a", ttl_s=100)
    clock.now = 90
    compute_plain(bm, prefix)  # a hit on the pinned prefix: the deadline is now 190
    clock.now = 150
    assert bm.expire_pins() == 0
    fill_plain(bm, 1, 10)
    assert len(bm.match(prefix, "a", 8).blocks) == 2
    clock.now = 190
    assert bm.expire_pins() == 1
    pin_again = bm.pin(prefix, "a", ttl_s=10)  # a warm renews too (and adds no second pin)
    assert pin_again == 2 and bm.pin(prefix, "a", ttl_s=10) == 2
    assert bm.num_pinned_blocks == 2
    clock.now = 200
    assert bm.expire_pins() == 1 and bm.num_pinned_blocks == 0


def test_a_request_ending_on_the_pinned_prefix_renews_it() -> None:
    """A warm of the pinned prefix itself matches its last block only in part (len - 1)."""
    clock = Clock()
    bm = BlockManager(8, BS, b"m", copy_slots=lambda src, dst, k: None, clock=clock)
    prefix = list(range(8))
    compute_plain(bm, prefix)
    bm.pin(prefix, "a", ttl_s=10)
    clock.now = 8
    compute_plain(bm, prefix)
    clock.now = 12
    assert bm.expire_pins() == 0
    clock.now = 18
    assert bm.expire_pins() == 1


def test_ttl_pins_of_a_namespace_are_capped() -> None:
    bm = BlockManager(16, BS, b"m", clock=Clock())
    a, b = list(range(13)), list(range(100, 113))
    compute_plain(bm, a)
    compute_plain(bm, b)
    assert bm.pin(a, "a", ttl_s=5, max_blocks=4) == 3
    assert bm.pin(b, "a", ttl_s=5, max_blocks=4) == 1  # cut short to the one block left
    assert bm.pin(b, "b", ttl_s=5, max_blocks=4) == 0  # another namespace's tree: not cached
    bm.check_invariants()


def test_the_tree_snapshot_says_when_ttl_pins_lapse() -> None:
    clock = Clock()
    bm = BlockManager(16, BS, b"m", clock=clock)
    activity = CacheActivity(bm)
    prefix = list(range(13))  # three full blocks, one chain
    compute_plain(bm, prefix)
    compute_plain(bm, [99, *range(1, 9)])  # another top block, never pinned
    assert bm.pin(prefix[:8], "a", ttl_s=100) == 2
    assert bm.pin(prefix[:12], "a", ttl_s=50) == 3
    clock.now = 10

    chain = bm.match(prefix, "a", 12).blocks
    other = bm.match([99, *range(1, 9)], "a", 8).blocks

    def lapses() -> list[float]:
        """Seconds from the snapshot to each chain block's lapse (0: none)."""
        snap = activity.snapshot()
        by_block = dict(zip((n.block for n in bm.tree.nodes()), snap.ttl_expires, strict=True))
        assert all(by_block[b] == 0.0 for b in other)  # never pinned
        return [round(by_block[b] - snap.taken_at, 3) if by_block[b] else 0.0 for b in chain]

    assert lapses() == [90.0, 90.0, 40.0]  # a block lapses with the last TTL pin over it
    assert bm.pin(prefix[:4], "a") == 1  # a pin without TTL holds the first block for good
    assert lapses() == [0.0, 90.0, 40.0]
    clock.now = 60
    assert bm.expire_pins() == 1
    assert lapses() == [0.0, 40.0, 0.0]
    snap = activity.snapshot()
    assert sum(snap.pinned) == 2  # the lapsed block is an ordinary LRU entry again
    bm.check_invariants()


def compute_plain(bm: BlockManager, prompt: list[int]) -> None:
    match = bm.match(prompt, "a", len(prompt) - 1)
    table = bm.allocate(prompt, "a", match, len(prompt))
    bm.commit(table, prompt, len(prompt))
    bm.free(table)


def fill_plain(bm: BlockManager, seed: int, count: int) -> None:
    for i in range(count):
        compute_plain(bm, [seed * 1000 + i * 10 + k for k in range(9)])


# ---- storage --------------------------------------------------------------------------------


def test_tier_spec_parses_host_and_disk() -> None:
    assert TierSpec.parse("host:2") == TierSpec("host", 2 * 1024**3)
    assert TierSpec.parse("disk:/tmp/kv:0.5") == TierSpec("disk", 1024**3 // 2, "/tmp/kv")
    for bad in ("host", "host:x", "host:-1", "ram:1", "disk:1"):
        with pytest.raises(ValueError):
            TierSpec.parse(bad)


def test_a_disk_tier_file_goes_at_close_unless_kept(tmp_path: Path) -> None:
    gone = DiskSlots(4, 64, str(tmp_path), keep=False)
    kept = DiskSlots(4, 64, str(tmp_path), keep=True)
    assert gone.path.stat().st_size == 4 * 64
    gone.close()
    kept.close()
    assert not gone.path.exists() and kept.path.exists()


def test_a_disk_tier_reloads_and_refuses_damage(tmp_path: Path) -> None:
    pages = Pages(8)
    tier = KVTier(DiskSlots(8, Pages.bytes_per_block, str(tmp_path), keep=False), pages)
    bm = BlockManager(8, BS, b"m", tier=tier)
    prompt = list(range(13))
    compute(bm, prompt, "a", 4)
    bm.evict_all(keep_tier=True)
    digests = bm.match(prompt, "a", 12).tier
    tier.corrupt_slot(digests[2])
    table = bm.allocate(prompt, "a", bm.match(prompt, "a", 12), 13)
    assert table.num_reloaded_tokens == 2 * BS
    assert (pages.kv[table.block_ids[:2]] == 4).all()
    tier.close()


# ---- outputs through the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_reloaded_kv_gives_the_cold_tokens_and_logprobs(loaded, kind: str, tmp_path) -> None:
    spec = "host:0.05" if kind == "host" else f"disk:{tmp_path}:0.05"
    config = EngineConfig(
        model="demo", dtype="float32", device="cpu", num_blocks=64, kv_offload=spec
    )
    engine = LLMEngine(config, loaded)
    rng = random.Random(3)
    prompt = [rng.randrange(3, loaded.config.vocab_size) for _ in range(150)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)

    def run(rid: str) -> tuple[list[int], list[float], int, dict[str, int] | None]:
        (result,) = engine.generate([EngineRequest(rid, list(prompt), sampling)])
        usage = result.usage
        return (
            result.token_ids,
            [lp.logprob for lp in result.logprobs],
            usage.cached_tokens,
            usage.cached_tokens_by_tier,
        )

    cold_tokens, cold_logprobs, cold_cached, _ = run("cold")
    assert cold_cached == 0
    tier = engine.cache_stats().tier
    assert isinstance(tier, TierBlockStats) and tier.kind == kind and tier.used == 0
    assert tier.total > 9 and tier.bytes_total == tier.total * engine.kv_cache.bytes_per_block
    engine.evict_all(keep_tier=True)
    after = engine.cache_stats()
    assert isinstance(after.tier, TierBlockStats) and after.tier.used == 9  # the prompt's blocks
    assert after.tier.bytes_used == 9 * engine.kv_cache.bytes_per_block
    tokens, logprobs, cached, by_tier = run("reloaded")
    assert cached == 144 and by_tier == {"pool": 0, kind: 144}
    assert tokens == cold_tokens
    assert np.allclose(logprobs, cold_logprobs, atol=1e-6, rtol=0)
    registry = engine.metrics.registry
    assert registry.get_sample_value("prefixcache:prefix_cache_hits_total", {"tier": kind}) == 144
    assert registry.get_sample_value("prefixcache:kv_tier_reloads_total") == 9
    engine.block_manager.check_invariants()
    engine.close()


def test_a_step_never_waits_for_the_writer_but_an_admin_evict_does() -> None:
    pages = Pages(64)
    tier = KVTier(HostSlots(64, Pages.bytes_per_block, False), pages, max_pending_bytes=0)
    release = threading.Event()
    store = tier._store

    def slow_store(entry, data) -> None:  # a writer stuck on a slow disk
        release.wait(timeout=30)
        store(entry, data)

    tier._store = slow_store  # type: ignore[method-assign]
    accepted = [tier.spill(bytes([i]) * 16, b"p", b"t", 0) for i in range(24)]
    assert not all(accepted) and tier.stats().drops == accepted.count(False)  # refused
    release.set()
    tier.drain()
    assert tier.stats().writes == accepted.count(True)
    tier.clear()

    release.clear()
    bm = BlockManager(64, BS, b"m", tier=tier)
    for i in range(8):
        compute(bm, [i * 100 + k for k in range(21)], "a", i)  # 40 full blocks cached
    timer = threading.Timer(0.2, release.set)
    timer.start()
    assert bm.evict_all(keep_tier=True) == 40
    tier.drain()
    assert len(tier) == 40 and tier.stats().writes == accepted.count(True) + 40
    timer.join()
    tier.close()


def test_through_the_engine_a_tenant_never_reloads_another_tenants_blocks(loaded) -> None:
    config = EngineConfig(
        model="demo", dtype="float32", device="cpu", num_blocks=64, kv_offload="host:0.05"
    )
    engine = LLMEngine(config, loaded)
    prompt = list(range(3, 3 + 70))
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)

    def cached(rid: str, namespace: str) -> tuple[int, dict[str, int] | None]:
        request = EngineRequest(rid, list(prompt), sampling, namespace=namespace)
        (result,) = engine.generate([request])
        return result.usage.cached_tokens, result.usage.cached_tokens_by_tier

    assert cached("a1", "tenant-a")[0] == 0
    engine.evict_all(keep_tier=True)
    assert cached("b1", "tenant-b") == (0, {"pool": 0})  # a's spilled blocks: not b's
    engine.evict_all(keep_tier=True)
    assert cached("a2", "tenant-a") == (64, {"pool": 0, "host": 64})
    engine.close()


def test_an_engine_closes_its_disk_tier(loaded, tmp_path) -> None:
    """``LLMEngine.close`` ends the writer and removes the file, the tier empty or not (an
    empty tier is falsy: ``len()`` 0)."""
    config = EngineConfig(
        model="demo",
        dtype="float32",
        device="cpu",
        num_blocks=64,
        kv_offload=f"disk:{tmp_path}:0.01",
    )
    engine = LLMEngine(config, loaded)
    assert engine.tier is not None and len(engine.tier) == 0
    (path,) = tmp_path.glob("prefixcache-kv-*.slots")
    engine.close()
    assert not path.exists()


def test_a_closed_tier_holds_nothing_and_refuses_spills(tmp_path: Path) -> None:
    """After close (its writer stopped, its file gone) a spill is refused at once, never left
    waiting on the writer, and a lookup finds nothing: an engine's manager that outlives its
    tier recomputes."""
    pages = Pages(8)
    tier = KVTier(
        DiskSlots(8, Pages.bytes_per_block, str(tmp_path), keep=False), pages, writer=True
    )
    bm = BlockManager(8, BS, b"m", tier=tier)
    prompt = list(range(13))
    compute(bm, prompt, "a", 4)
    bm.evict_all(keep_tier=True)
    tier.drain()
    assert len(tier) == 3 and bm.match(prompt, "a", 12).tier
    tier.close()
    assert len(tier) == 0 and not bm.match(prompt, "a", 12).tier
    done = threading.Event()

    def spill() -> None:
        assert not tier.spill(b"d" * 32, b"p" * 32, b"t" * 16, 0, wait=True)
        tier.drain()
        done.set()

    threading.Thread(target=spill, daemon=True).start()
    assert done.wait(10), "a spill after close waited on a writer that is gone"
    tier.check()


@pytest.mark.parametrize("fs", ["full", "no fallocate, too small"])
def test_a_disk_tier_that_does_not_fit_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str
) -> None:
    """A tier file the filesystem cannot hold was made sparse: the first spill past the free
    space faulted in the mmap and killed the engine. Now an OSError at start, nothing left."""
    import errno
    import os

    def fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC if fs == "full" else errno.EOPNOTSUPP, "refused")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    if fs != "full":
        real = os.statvfs(tmp_path)
        small = os.statvfs_result((*real[:4], 1, *real[5:]))  # f_bavail: one block
        monkeypatch.setattr(os, "statvfs", lambda path: small)
    with pytest.raises(OSError, match="cannot reserve") as refused:
        DiskSlots(64, 1 << 16, str(tmp_path), keep=False)
    assert refused.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # the file is gone
