"""The hybrid block manager (global pages + the sliding layers' local pages) under random
interleavings of admit (match + allocate, copy-on-write hits), prefill chunks, decodes, commits
(with dedupe), frees, preemptions and evictions, over random windows and local pool sizes,
with or without a small KV tier (both parts: global and local pages; spills on eviction and on
local pressure, reloads and refills, LRU drops, corrupt entries).

Fake KV: one int per token slot in each group. A sequence writes, at position p, a signature of
(namespace, tokens[: p + 1]) into its global page and its local page. After every step each
running sequence must read back exactly its own history from its global table, and from its
local table for every block still inside its window; hold counts must equal the tables' held
ranges; a hit never claims a block whose window is incomplete (and its window reads back the
hit's own history). Plus unit tests for hit shrinking and for the pool accounting.

Chunk entries (reuse="anywhere" documents, engine/step/chunk_reuse.py) are stored in the
namespace's chunk namespace; a sequence that places one copies its values (changed, as a
re-rotation changes K) into its global pages for the whole span and into its local pages for
the span's last window only (the chunk's own last window, which must still have its local
pages), commits only up to its first placed token and still slides its window past it. A
placed value reaching the tree shows up in a later hit's check; a placed position a window
reads without a local copy shows up in the invariant.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.memory.block_types import BlockTable, OutOfBlocksError, PrefixMatch
from prefixcache.engine.memory.hybrid.local_pages import NULL_PAGE
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager
from prefixcache.engine.memory.kv_cache import KVCacheSpec
from prefixcache.engine.memory.kv_tier import HostSlots, KVTier
from prefixcache.engine.paging import ceil_div
from prefixcache.engine.request import SegmentSpan
from prefixcache.engine.step.chunk_reuse import chunk_namespace, plan_placements, stored_length
from prefixcache.engine.step.kv_setup import hybrid_pool_sizes, local_pool_size

BS = 4
NUM_BLOCKS = 24
MAX_SEQS = 4
NAMESPACES = ("a", "b")
_rng = random.Random(11)
BASES = [[_rng.randrange(5) for _ in range(28)] for _ in range(2)]
MOD = (1 << 61) - 1
DOCS = [[_rng.randrange(5) for _ in range(n)] for n in (9, 13)]  # reuse="anywhere" segments


def history(namespace: str, tokens: list[int]) -> list[int]:
    h = zlib.crc32(namespace.encode()) + 1
    out = []
    for tok in tokens:
        h = (h * 1_000_003 + tok + 1) % MOD
        out.append(h)
    return out


def placed_value(stored: int) -> int:
    """What placing a stored chunk value writes (not its history)."""
    return (stored * 31 + 7) % MOD


class ArrayPages:
    """The fake KV as the tier's ``PageIO``: a page's int64 slots as bytes."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.bytes_per_block = array.shape[1] * array.itemsize

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return self.array[pages].view(np.uint8)

    def write_pages(self, pages: list[int], data: np.ndarray | list[np.ndarray]) -> None:
        for page, row in zip(pages, data, strict=True):
            self.array[page] = np.frombuffer(np.ascontiguousarray(row).tobytes(), np.int64)


def tier_of(array: np.ndarray, slots: int) -> KVTier:
    io = ArrayPages(array)
    return KVTier(HostSlots(slots, io.bytes_per_block, False), io, writer=False)


@dataclass(eq=False)
class Seq:
    table: BlockTable
    tokens: list[int]
    num_computed: int
    placed: dict[int, int] = field(default_factory=dict)  # global: position -> placed value
    placed_local: dict[int, int] = field(default_factory=dict)  # local: the span's last window
    exact: int | None = None  # the first placed position: commits stop there


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.seqs: list[Seq] = []
        self.manager: HybridBlockManager | None = None

    @initialize(
        window=st.integers(1, 14), extra=st.integers(0, NUM_BLOCKS), tier=st.integers(0, 20)
    )
    def setup(self, window: int, extra: int, tier: int) -> None:
        """``tier``: its global slots (0: no tier; half as many local ones)."""
        num_local = 1 + min(NUM_BLOCKS, (window + 2 * BS) // BS + 2 + extra)
        self.kv = np.zeros((NUM_BLOCKS, BS), dtype=np.int64)
        self.local_kv = np.zeros((num_local, BS), dtype=np.int64)
        self.local_kv[NULL_PAGE] = -1  # the null page holds nobody's history

        def copy(src: int, dst: int, k: int) -> None:
            self.kv[dst, :k] = self.kv[src, :k]

        def copy_local(src: int, dst: int, k: int) -> None:
            assert NULL_PAGE not in (src, dst)
            self.local_kv[dst, :k] = self.local_kv[src, :k]

        tiers = (tier_of(self.kv, tier), tier_of(self.local_kv, max(1, tier // 2))) if tier else ()
        self.manager = HybridBlockManager(
            NUM_BLOCKS,
            BS,
            b"id",
            window,
            num_local,
            copy,
            copy_local,
            tier=tiers[0] if tiers else None,
            local_tier=tiers[1] if tiers else None,
        )
        self.window = window

    @property
    def m(self) -> HybridBlockManager:
        assert self.manager is not None
        return self.manager

    # ---- rules

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(
        base=st.integers(0, 1),
        length=st.integers(2, 28),
        suffix=st.lists(st.integers(0, 4), max_size=5),
        ns=st.sampled_from(NAMESPACES),
        chunk=st.integers(1, 12),
    )
    def admit(self, base: int, length: int, suffix: list[int], ns: str, chunk: int) -> None:
        tokens = BASES[base][:length] + suffix
        match = self.m.match(tokens, ns, len(tokens) - 1)
        self._check_hit(match, tokens, ns)
        target = min(len(tokens), match.num_tokens + chunk)
        if not self.m.can_allocate(match, target):
            with pytest.raises(OutOfBlocksError):
                self.m.allocate(tokens, ns, match, target)
            return
        refills = self.m.local_tier.stats().reloads if self.m.local_tier is not None else 0
        table = self.m.allocate(tokens, ns, match, target)
        if match.tier:
            event("hit reloaded from the tier")
        if self.m.local_tier is not None and self.m.local_tier.stats().reloads > refills:
            event("window refilled from the tier")
        if self.m.tier is None:
            assert table.num_cached_tokens == match.num_tokens
        else:  # a tier entry dropped by the spills its allocation made, or corrupt: shorter
            assert table.num_cached_tokens <= match.num_tokens
            if table.num_cached_tokens < match.num_tokens:
                event("hit cut at allocation")
        seq = Seq(table, tokens, table.num_cached_tokens)
        self.seqs.append(seq)
        self._compute(seq, target - match.num_tokens + table.num_cached_tokens)  # the chunk

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(
        prefix=st.sampled_from([[], BASES[0][:3], BASES[1][:10]]),  # repeats: later hits
        doc=st.sampled_from(DOCS),
        suffix=st.lists(st.integers(0, 4), min_size=1, max_size=4),
        ns=st.sampled_from(NAMESPACES),
        repair=st.integers(0, 5),
        chunk=st.integers(1, 12),
    )
    def admit_with_chunk(
        self, prefix: list[int], doc: list[int], suffix: list[int], ns: str, repair: int, chunk: int
    ) -> None:
        """A prompt with a reuse="anywhere" document: find or store its chunk entry (after the
        context before it, to a block boundary), allocate the whole prompt, place the chunk."""
        context = len(prefix)
        stored_tokens = prefix + doc[: stored_length(context, len(doc), BS)]
        whole, chunk_ns = len(stored_tokens), chunk_namespace(ns)
        stored = self.m.match(stored_tokens, chunk_ns, whole)
        self._check_hit(stored, stored_tokens, chunk_ns)
        if whole == 0 or not self.m.can_allocate(stored, whole):
            return
        source = Seq(self.m.allocate(stored_tokens, chunk_ns, stored, whole), stored_tokens, 0)
        if source.table.num_slots < whole:  # a tier entry lost: chunk_reuse gives up
            self.m.free(source.table)
            return
        source.num_computed = source.table.num_cached_tokens
        self._compute(source, whole)
        prompt = prefix + doc + suffix
        spans = [
            SegmentSpan("prefix", 0, context),
            SegmentSpan("doc", context, context + len(doc), "anywhere"),
            SegmentSpan("suffix", context + len(doc), len(prompt)),
        ]
        match = self.m.match(prompt, ns, len(prompt) - 1)
        self._check_hit(match, prompt, ns)
        plans = plan_placements(spans, match.num_tokens, len(prompt), repair, BS)
        if not plans or not self.m.can_allocate(match, len(prompt)):
            self.m.free(source.table)
            return
        table = self.m.allocate(prompt, ns, match, len(prompt))
        seq = Seq(table, prompt, table.num_cached_tokens)
        if table.num_slots < len(prompt):  # a tier entry lost: the scheduler drops placements
            self.m.free(source.table)
            self.seqs.append(seq)
            self._compute(seq, len(prompt) - match.num_tokens + table.num_cached_tokens)
            return
        _, start, end = plans[0]
        assert start >= seq.num_computed  # placed spans start past the exact hit
        page_of = self.m.local.page_of
        for pos in range(start, end):  # the same positions: the first flagged document
            src, dst = source.table.block_ids[pos // BS], table.block_ids[pos // BS]
            seq.placed[pos] = self.kv[dst, pos % BS] = placed_value(int(self.kv[src, pos % BS]))
        for pos in range(max(start, end - self.window + 1), end):
            src, dst = (page_of[t.block_ids[pos // BS]] for t in (source.table, table))
            assert src != NULL_PAGE, "a chunk's last window lost a local page before placement"
            assert dst != NULL_PAGE
            value = placed_value(int(self.local_kv[src, pos % BS]))
            seq.placed_local[pos] = self.local_kv[dst, pos % BS] = value
        seq.exact = start
        self.m.free(source.table)  # the chunk entry stays cached
        self.seqs.append(seq)
        event("chunk placed" if stored.num_tokens < whole else "stored chunk placed")
        self._compute(seq, min(len(prompt), seq.num_computed + chunk))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, MAX_SEQS - 1), n=st.integers(1, 9), tok=st.integers(0, 4))
    def step(self, i: int, n: int, tok: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(tok)  # a decode: the sampled token joins the history
        target = min(len(seq.tokens), seq.num_computed + n)
        if not self.m.can_grow(seq.table, target):
            self._free(seq)  # preempted
            return
        self.m.grow(seq.table, target)
        self._compute(seq, target)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, MAX_SEQS - 1))
    def free(self, i: int) -> None:
        self._free(self.seqs[i % len(self.seqs)])

    @rule(base=st.integers(0, 1), length=st.integers(4, 28), ns=st.sampled_from(NAMESPACES))
    def pin(self, base: int, length: int, ns: str) -> None:
        self.m.pin(BASES[base][:length], ns)

    @rule(base=st.integers(0, 1), length=st.integers(4, 28), ns=st.sampled_from(NAMESPACES))
    def unpin(self, base: int, length: int, ns: str) -> None:
        self.m.unpin(BASES[base][:length], ns)

    @rule(include_pinned=st.booleans(), keep_tier=st.booleans())
    def evict_all(self, include_pinned: bool, keep_tier: bool) -> None:
        self.m.evict_all(include_pinned=include_pinned, keep_tier=keep_tier)

    @precondition(
        lambda self: self.manager is not None and self.manager.tier and len(self.seqs) < MAX_SEQS
    )
    @rule(base=st.integers(0, 1), length=st.integers(2, 28), ns=st.sampled_from(NAMESPACES))
    def spill_and_readmit(self, base: int, length: int, ns: str) -> None:
        """Everything idle into the tier, then a prompt that may hit it."""
        self.m.evict_all(keep_tier=True)
        self.admit(base, length, [], ns, 28)

    @precondition(lambda self: self.manager is not None and self.manager.tier is not None)
    @rule(local=st.booleans(), i=st.integers(0, 40))
    def corrupt(self, local: bool, i: int) -> None:
        """Damage one entry's bytes: a later reload or refill must read it as a miss."""
        tier = self.m.local_tier if local else self.m.tier
        assert tier is not None
        digests = list(tier._entries)
        if digests and tier.slot_bytes:
            tier.corrupt_slot(digests[i % len(digests)])

    # ---- helpers

    def _compute(self, seq: Seq, target: int) -> None:
        """The model's step: write [num_computed, target) into both groups, then commit."""
        h = history(seq.table.namespace, seq.tokens)
        local = self.m.local_table(seq.table)
        for p in range(seq.num_computed, target):
            if p in seq.placed:
                continue
            assert local[p // BS] != NULL_PAGE, "a write into a slid-out or missing local page"
            self.kv[seq.table.block_ids[p // BS], p % BS] = h[p]
            self.local_kv[local[p // BS], p % BS] = h[p]
        seq.num_computed = target
        while seq.num_computed in seq.placed:  # Sequence.skip_placed
            seq.num_computed += 1
        exact = seq.num_computed if seq.exact is None else min(seq.num_computed, seq.exact)
        self.m.commit(seq.table, seq.tokens, exact)
        if exact < seq.num_computed:  # as the scheduler does past placed KV
            self.m.slide(seq.table, seq.num_computed)

    def _free(self, seq: Seq) -> None:
        self.m.free(seq.table)
        self.seqs.remove(seq)

    def _check_hit(self, match: PrefixMatch, tokens: list[int], ns: str) -> None:
        n = match.num_tokens
        if n == 0:
            return
        h = history(ns, tokens)
        blocks = match.blocks + [-1] * len(match.tier)
        blocks += [match.partial_block] if match.partial_tokens else []
        page_of = self.m.local.page_of
        for p in range(max(0, n - self.window + 1), n):
            block = blocks[p // BS]
            page = page_of[block] if block >= 0 else NULL_PAGE
            if page == NULL_PAGE and self.m.local_tier is not None:
                continue  # refilled at allocation (checked then, by the invariant)
            assert page != NULL_PAGE, f"a hit of {n} claims block {p // BS} without a local page"
            assert self.local_kv[page, p % BS] == h[p], "a hit's window reads another history"
        for p in range(n):
            if blocks[p // BS] >= 0:  # a tier block: checked once reloaded
                assert self.kv[blocks[p // BS], p % BS] == h[p]

    # ---- invariants

    @invariant()
    def pages_read_back_their_history(self) -> None:
        if self.manager is None:
            return
        self.m.check_invariants()
        held: Counter[int] = Counter()
        for seq in self.seqs:
            t = seq.table
            h = history(t.namespace, seq.tokens)
            assert t.num_released_blocks == min(
                self.m.window_start(seq.num_computed), len(t.block_ids)
            )
            for p in range(seq.num_computed):
                want = seq.placed.get(p, h[p])
                assert self.kv[t.block_ids[p // BS], p % BS] == want, "global page"
            local = self.m.local_table(t)
            for j in range(t.num_released_blocks, len(t.block_ids)):
                assert local[j] != NULL_PAGE, "a block inside the window has no local page"
                held[local[j]] += 1
            for p in range(max(0, seq.num_computed - self.window + 1), seq.num_computed):
                assert p not in seq.placed or p in seq.placed_local, "a window reads unplaced KV"
                want = seq.placed_local.get(p, h[p])
                assert self.local_kv[local[p // BS], p % BS] == want, "local page"
        holders = self.m.local.holders
        for page in range(1, self.m.local.num_pages):
            assert holders[page] == held[page], f"local page {page}: holds off"


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- unit tests


def manager(window: int, num_local: int, num_blocks: int = 16) -> HybridBlockManager:
    return HybridBlockManager(num_blocks, BS, b"id", window, num_local, lambda s, d, k: None)


def fill(m: HybridBlockManager, tokens: list[int]) -> BlockTable:
    t = m.allocate(tokens, "", m.match(tokens, "", 0), len(tokens))
    m.commit(t, tokens, len(tokens))
    return t


def test_hit_shrinks_to_the_largest_complete_window() -> None:
    m = manager(window=6, num_local=17)
    tokens = list(range(20))  # 5 blocks
    m.free(fill(m, tokens))
    assert m.match(tokens, "", 19).num_tokens == 19  # partial hit of 3 in block 4
    blocks = m.match(tokens, "", 19).blocks
    local = m.local
    page = local.page_of[blocks[3]]  # keys 12..15: inside the window of 14..18
    local._unidle(page)
    local.page_of[blocks[3]], local.block_of[page] = NULL_PAGE, -1
    local._free.append(page)
    m.check_invariants()
    # 19 needs keys 14..18 (blocks 3, 4): block 3 is missing, so at most 12 (keys 7..11: 1, 2)
    assert m.match(tokens, "", 19).num_tokens == 12
    assert m.match(tokens, "", 13).num_tokens == 12
    assert m.match(tokens, "", 12).num_tokens == 12
    page1 = local.page_of[blocks[1]]  # now 12 misses too: keys 7..11 need block 1
    local._unidle(page1)
    local.page_of[blocks[1]], local.block_of[page1] = NULL_PAGE, -1
    local._free.append(page1)
    assert m.match(tokens, "", 19).num_tokens == 4  # keys 0..3 only: block 0
    assert m.shrunk_tokens > 0
    m.check_invariants()


def test_a_long_prompt_keeps_only_its_window_held() -> None:
    m = manager(window=5, num_local=17)
    tokens = list(range(30))
    t = fill(m, tokens)
    # next query at 30 needs keys 26..29: block 6 (24..27) and 7 (28..29)
    assert t.num_released_blocks == 6
    assert m.local_table(t)[:6] == [NULL_PAGE] * 6
    assert m.local.num_held == 2 and m.local.num_idle == 6
    m.free(t)
    assert m.local.num_held == 0 and m.local.num_idle == 7  # the private tail block is freed


def test_capacity_counts_the_local_pool() -> None:
    m = manager(window=8, num_local=4)  # 3 usable local pages, 16 global
    tokens = list(range(40))
    nothing = PrefixMatch([], None, 0, BS)
    assert not m.can_allocate(nothing, 16)  # 4 blocks: global room, no local room
    with pytest.raises(OutOfBlocksError):
        m.allocate(tokens, "", nothing, 16)
    t = m.allocate(tokens, "", nothing, 12)
    assert not m.can_grow(t, 13) and m.local.num_available == 0
    m.commit(t, tokens, 12)  # the window (keys 5..11) leaves block 0: its page goes idle
    assert m.local.num_idle == 1 and m.can_grow(t, 13)
    m.grow(t, 13)  # takes the idle page: block 0 loses its local page (detached)
    assert m.local.num_detached == 1 and m.local.page_of[t.block_ids[0]] == NULL_PAGE
    m.check_invariants()


def test_pinned_blocks_keep_their_local_pages_longest() -> None:
    m = manager(window=4, num_local=6)  # 5 usable local pages
    pinned, other = list(range(100, 108)), list(range(200, 208))
    m.free(fill(m, pinned))
    m.free(fill(m, other))
    m.pin(pinned, "")
    assert m.local.num_idle == 4 and m.local.num_free == 1
    t = m.allocate(list(range(16)), "", PrefixMatch([], None, 0, BS), 12)  # 3 pages: 1 free
    assert all(m.local.page_of[b] for b in m.match(pinned, "", 8).blocks)  # 2 detached: other's
    assert m.match(pinned, "", 7).num_tokens == 7 and m.match(other, "", 7).num_tokens == 0
    m.grow(t, 16)  # nothing unpinned is left: a pinned block's page goes, its interior first
    first, last = m.match(pinned, "", 8).blocks
    assert m.local.page_of[first] == NULL_PAGE and m.local.page_of[last] != NULL_PAGE
    assert m.match(pinned, "", 7).num_tokens == 7  # keys 4..6: the window at its end
    m.check_invariants()


def test_local_pool_size_floor_and_cap() -> None:
    assert local_pool_size(1000, 0.5, 512, 16, 4, 2048) == 501
    floor = 256 * (32 + 2) + 128 + 1
    assert local_pool_size(100_000, 0.01, 512, 16, 256, 2048) == floor
    assert local_pool_size(100, 0.5, 512, 16, 256, 2048) == 101  # one per block at most


def test_the_kv_budget_is_split_between_the_groups() -> None:
    spec = KVCacheSpec(num_layers=6, num_kv_heads=1, head_dim=8, block_size=16)
    windows = (32, 32, 0, 32, 32, 0)
    config = EngineConfig(
        kv_memory_bytes=spec.bytes_per_block * 100, max_num_seqs=2, max_num_batched_tokens=64
    )
    num_blocks, num_local = hybrid_pool_sizes(config, spec, windows)
    page = spec.bytes_per_layer_page
    assert num_blocks * 2 * page + num_local * 4 * page <= config.kv_memory_bytes
    assert num_blocks > 100  # the sliding layers take less than their share
    assert num_local == int(0.5 * num_blocks) + 1


def test_the_default_config_keeps_a_real_global_pool_for_gemma3_sizes() -> None:
    """Gemma 3 270M's shape at the defaults (512 MiB, 256 sequences, 2,048-token steps): the
    floor for 256 windows (8,833 local pages, 2 GiB) cannot fit, and once took the global
    pool down to one block. The ratio's split stands, floored for one sequence."""
    spec = KVCacheSpec(num_layers=18, num_kv_heads=1, head_dim=256, block_size=16)
    windows = tuple(0 if i % 6 == 5 else 512 for i in range(18))
    config = EngineConfig()
    num_blocks, num_local = hybrid_pool_sizes(config, spec, windows)
    page = spec.bytes_per_layer_page
    assert num_blocks * 3 * page + num_local * 15 * page <= config.kv_memory_bytes
    # the ratio's split (about 25K tokens of global KV in fp32, 50K in bf16), not one block
    assert num_blocks >= config.kv_memory_bytes // (3 * page + 0.5 * 15 * page) - 4
    one_sequence = ceil_div(511, 16) + 2 + 2048 // 16 + 1
    assert one_sequence <= num_local == int(0.5 * num_blocks) + 1


def test_a_partial_hit_source_evicted_for_the_same_table_frees_its_local_page() -> None:
    """The copy source of a partial hit is the only idle block, so the table's later blocks
    evict it: its local page must not be held then (the state machine found this once)."""
    m = manager(window=4, num_local=17, num_blocks=4)
    cached = list(range(8))
    m.free(fill(m, cached))
    prompt = cached[:6] + list(range(100, 110))  # block 0 whole, 2 tokens of block 1
    match = m.match(prompt, "", len(prompt) - 1)
    assert match.num_tokens == 6 and match.partial_block is not None
    source = match.partial_block
    assert m.can_allocate(match, len(prompt))
    t = m.allocate(prompt, "", match, len(prompt))  # 4 blocks: two free, then evicts source
    assert t.num_cached_tokens == 6 and source in t.block_ids[2:]
    m.check_invariants()
    m.commit(t, prompt, len(prompt))
    m.free(t)
    m.check_invariants()


def test_a_partial_hit_without_room_for_its_copy_ends_at_the_full_blocks() -> None:
    """Only the source itself is left to take: the copy is dropped and the hit refitted."""
    m = manager(window=4, num_local=17, num_blocks=2)
    cached = list(range(8))
    m.free(fill(m, cached))
    prompt = cached[:6] + [100, 101]
    match = m.match(prompt, "", len(prompt) - 1)
    assert match.num_tokens == 6
    assert m.can_allocate(match, len(prompt))
    t = m.allocate(prompt, "", match, len(prompt))
    assert t.num_cached_tokens == 4 == m.honoured(match).num_tokens
    m.check_invariants()
    m.free(t)
    m.check_invariants()


def test_a_live_tail_hit_that_needs_a_refill_allocates() -> None:
    """The scheduler's live-tail match (a running table's partly filled block as the partial)
    whose window needs a page from the local tier: the prefetch's pool match is honoured as
    ``allocate`` honours it (a review found the copy skipped and the source evicted while
    held: an assertion, and an orphaned local page)."""
    kv, local_kv = np.zeros((7, BS), np.int64), np.zeros((6, BS), np.int64)

    def copy(src: int, dst: int, k: int) -> None:
        kv[dst, :k] = kv[src, :k]

    def copy_local(src: int, dst: int, k: int) -> None:
        local_kv[dst, :k] = local_kv[src, :k]

    m = HybridBlockManager(
        7, BS, b"id", 3, 6, copy, copy_local, tier=tier_of(kv, 8), local_tier=tier_of(local_kv, 8)
    )
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    first = base + [9, 9, 9, 9]
    t0 = m.allocate(first, "", m.match(first, "", 0), 12)
    m.commit(t0, first, 12)
    m.free(t0)
    other = [*base, 9, 50, 51, 52]  # a partial hit on the last block: copied into a live one
    running = m.allocate(other, "", m.match(other, "", 11), 12)
    m.commit(running, other, 10)
    live = running.block_ids[2]
    window = m.match(base, "", 8).blocks[1]  # an 8-token hit reads keys 6..7
    node, local = m._tree.node_of(window), m.local
    assert node is not None and m.local_tier is not None
    page = local.page_of[window]  # taken, as local pressure does: into the tier
    m.local_tier.spill(node.digest, node.parent_digest, node.tokens, page)
    local._unidle(page)
    local.block_of[page], local.page_of[window] = -1, NULL_PAGE
    local._free.append(page)
    unrelated = [100 + i for i in range(12)]  # the last free global pages and two local ones
    tx = m.allocate(unrelated, "", m.match(unrelated, "", 0), 12)
    m.commit(tx, unrelated, 12)
    seq = [*base, 9, 77]
    match = m.match(seq, "", 9)
    assert match.num_tokens == 8 and m._num_refills(match) == 1
    tail = PrefixMatch(match.blocks, live, 1, BS)  # what _extend_with_live_tail builds
    assert m.can_allocate(tail, 10)
    table = m.allocate(seq, "", tail, 10)
    assert table.num_cached_tokens >= 8
    m.check_invariants()


def test_a_file_saved_with_a_tier_keeps_a_window_complete_in_the_pool() -> None:
    """A window page only the local tier holds counts for a hit here, not in a file: the
    saved window is that of the longest hit complete in the pool, which a fresh engine then
    hits (a review found a window with a hole saved: no hit at all after loading)."""
    from prefixcache.engine.memory import prefix_store
    from prefixcache.engine.memory.kv_cache import KVCache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS)

    def make(tier: bool) -> tuple[HybridBlockManager, KVCache]:
        cache = KVCache(spec, 16, 8, [0])
        for layer in cache.layers:
            layer.uniform_()
        kw = {}
        if tier:
            g, loc = cache.global_io, cache.local_io
            kw = {
                "tier": KVTier(HostSlots(8, g.bytes_per_block, False), g, writer=False),
                "local_tier": KVTier(HostSlots(8, loc.bytes_per_block, False), loc, writer=False),
            }
        m = HybridBlockManager(16, BS, b"id", 9, 8, cache.copy_slots, cache.copy_local_slots, **kw)
        return m, cache

    tokens = list(range(1, 25))  # 6 blocks; a hit of 24 reads blocks 3-5
    m, cache = make(tier=True)
    t = m.allocate(tokens, "", m.match(tokens, "", 0), 24)
    m.commit(t, tokens, 24)
    m.free(t)
    m.pin(tokens, "")
    block = m.match(tokens + [0], "", 24).blocks[4]
    node, local = m._tree.node_of(block), m.local
    assert node is not None and m.local_tier is not None
    m.local_tier.spill(node.digest, node.parent_digest, node.tokens, local.page_of[block])
    page = local.page_of[block]  # then taken from the block, as local pressure does
    local._unidle(page)
    local.block_of[page], local.page_of[block] = -1, NULL_PAGE
    local._free.append(page)
    m.check_invariants()
    assert m.match(tokens + [0], "", 24).num_tokens == 24  # here: refilled from the tier
    snap = prefix_store.snapshot(m, cache)
    fresh, fresh_cache = make(tier=False)
    prefix_store.restore(snap, fresh, fresh_cache)
    fresh.check_invariants()
    assert fresh.match(tokens + [0], "", 24).num_tokens == 16  # keys 8..15: blocks 2 and 3


def test_a_pinned_prefix_loses_its_last_window_last() -> None:
    """Pinning goes deepest block first (the global LRU's order); the idle local pages are
    then re-ordered root first, so local pressure takes a pinned prefix's interior pages
    before the window at its end that a hit on it reads."""
    m = manager(window=6, num_local=17)
    tokens = list(range(20))  # 5 blocks
    table = fill(m, tokens)
    blocks = list(table.block_ids)
    m.free(table)
    m.pin(tokens, "")
    page_of = m.local.page_of
    assert list(m.local._idle_pinned) == [page_of[b] for b in blocks]  # LRU head first
    m.check_invariants()


def test_the_window_of_a_shared_prefix_outlives_a_prompts_interior() -> None:
    """A document read by two prompts longer than a window: for both, its last window is a
    prompt's interior (taken first under local pressure), but the second hit it, so its
    release keeps it with the last windows; a third prompt over the document still hits
    after pressure took every free page and three idle ones (it found nothing before)."""
    m = manager(window=6, num_local=15, num_blocks=40)
    doc = list(range(100, 112))  # 3 blocks; a hit of 12 reads keys 7..11: blocks 1 and 2

    def run(tokens: list[int]) -> int:
        match = m.match(tokens, "", len(tokens) - 1)
        t = m.allocate(tokens, "", match, len(tokens))
        m.commit(t, tokens, len(tokens))
        m.free(t)
        return match.num_tokens

    assert run(doc + list(range(200, 210))) == 0
    assert run(doc + list(range(300, 310))) == 12
    pressure = m.local.num_free + 3
    m.allocate(list(range(900, 900 + BS * pressure)), "", m.match([], "", 0), BS * pressure)
    assert m.local.num_free == 0
    assert m.match(doc + list(range(400, 410)), "", 21).num_tokens == 12
    m.check_invariants()


@pytest.mark.parametrize("case", ["shorter", "nested", "sibling"])
def test_a_second_pin_over_shared_blocks_keeps_the_first_ones_order(case: str) -> None:
    """Pinning a shorter prefix of A, pinning and unpinning one, or pinning a sibling that
    shares A's first blocks leaves A's local pages where they were: its last window still
    leaves last (a review found the shared root moved behind it: A's hit fell from 20 to 8)."""
    m = manager(window=6, num_local=17, num_blocks=40)
    a = list(range(100, 100 + 5 * BS))
    table = fill(m, a)
    blocks = list(table.block_ids)
    m.free(table)
    sibling = a[: 2 * BS] + list(range(500, 500 + 3 * BS))
    if case == "sibling":
        m.free(fill(m, sibling))
    m.pin(a, "")
    if case == "shorter":
        m.pin(a[: 2 * BS], "")
    elif case == "nested":
        m.pin(a[: 2 * BS], "")
        m.unpin(a[: 2 * BS], "")
    else:
        m.pin(sibling, "")
    order = [m.local.block_of[p] for p in m.local._idle_pinned]
    assert order[: len(blocks)] == blocks
    pressure = m.local.num_free + 3
    m.allocate(list(range(900, 900 + BS * pressure)), "", m.match([], "", 0), BS * pressure)
    assert m.match([*a, 1], "", len(a)).num_tokens == len(a)
    m.check_invariants()
