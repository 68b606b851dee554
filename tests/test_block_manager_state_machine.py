"""Random interleavings of allocate, prefill, decode, commit, fork, free, evict, pin and unpin,
with a small KV tier below the pool (spill on eviction, reload on match, damaged slots) and TTL
pins on an injected clock (renewal by hits, expiry).

A fake KV store holds one int per token slot. Each sequence writes, into the slots it owns, a
value derived from its namespace and its whole token history up to that position (so token id,
position and prefix). After every step, reading a sequence's block table back must give exactly
its own history: wrong sharing, a block handed out twice, a bad copy-on-write or a dedupe that
frees before re-pointing all show up as a wrong value, not only as a leak.

Chunk entries (reuse="anywhere" documents, engine/step/chunk_reuse.py) live in each namespace's
chunk namespace, written with their standalone history; a sequence that places one copies its
values, changed as a re-rotation changes K, into its own pages, and commits only up to its
first placed token. A placed value reaching the tree would show up in a later match's check.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from block_table_fork import can_fork
from block_table_fork import fork as fork_table
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.block_types import BlockTable, OutOfBlocksError, PrefixMatch
from prefixcache.engine.memory.kv_tier import HostSlots, KVTier, TierEntry, checksum
from prefixcache.engine.memory.prefix_tree import root_digest
from prefixcache.engine.request import SegmentSpan
from prefixcache.engine.step.chunk_reuse import chunk_namespace, plan_placements, stored_length

BS = 4
NUM_BLOCKS = 20
TIER_SLOTS = 12
MAX_SEQS = 4
NAMESPACES = ("tenant-a", "tenant-b")
_rng = random.Random(7)
BASES = [[_rng.randrange(6) for _ in range(24)] for _ in range(2)]
DOCS = [[_rng.randrange(6) for _ in range(n)] for n in (9, 12)]  # reuse="anywhere" segments
MOD = (1 << 61) - 1


def history_values(namespace: str, tokens: list[int]) -> list[int]:
    """Value of slot p: a rolling hash of (namespace, tokens[: p + 1]); depends on the position."""
    h = zlib.crc32(namespace.encode()) + 1
    out = []
    for tok in tokens:
        h = (h * 1_000_003 + tok + 1) % MOD
        out.append(h)
    return out


def placed_value(stored: int, delta: int) -> int:
    """What placing a stored chunk value at ``delta`` positions later writes (not its history)."""
    return (stored * 31 + delta + 7) % MOD


@dataclass(eq=False)  # identity: twin sequences are equal by value
class Seq:
    table: BlockTable
    tokens: list[int]
    num_computed: int
    placed: dict[int, int] | None = None  # position -> placed (approximate) value
    exact: int | None = None  # first placed position: commits stop there

    @property
    def committable(self) -> int:
        return self.num_computed if self.exact is None else min(self.num_computed, self.exact)

    def expected(self) -> list[int]:
        values = history_values(self.table.namespace, self.tokens[: self.num_computed])
        for pos, value in (self.placed or {}).items():
            if pos < self.num_computed:
                values[pos] = value
        return values


class FakePages:
    """``PageIO`` over the machine's slot values: a page is BS int64s."""

    bytes_per_block = BS * 8

    def __init__(self, kv: np.ndarray) -> None:
        self.kv = kv

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return self.kv[pages].view(np.uint8).copy()

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self.kv[pages] = np.ascontiguousarray(data).view(np.int64).reshape(len(pages), BS)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = np.zeros((NUM_BLOCKS, BS), dtype=np.int64)
        slots = HostSlots(TIER_SLOTS, FakePages.bytes_per_block, pin_memory=False)
        self.tier = KVTier(slots, FakePages(self.kv), writer=False)
        self.now = 0.0
        self.bm = BlockManager(
            NUM_BLOCKS, BS, b"model|tok|fp32", self.copy_slots, tier=self.tier, clock=self.clock
        )
        self.seqs: list[Seq] = []
        self.pins: list[tuple[list[int], str]] = []
        self.damaged: dict[bytes, TierEntry] = {}  # tier entries whose slot a rule corrupted

    def clock(self) -> float:
        return self.now

    def copy_slots(self, src: int, dst: int, k: int) -> None:
        assert src != dst and 0 < k <= BS
        self.kv[dst, :k] = self.kv[src, :k]

    def write(self, seq: Seq, start: int, end: int) -> None:
        values = history_values(seq.table.namespace, seq.tokens[:end])
        for pos in range(start, end):
            if seq.placed and pos in seq.placed:
                continue  # placed, not computed
            block = seq.table.block_ids[pos // BS]
            # a sequence writes only into its private blocks: shared ones are read-only
            assert pos // BS >= seq.table.num_committed_blocks or self.bm.ref_count(block) == 1
            self.kv[block, pos % BS] = values[pos]

    def counters(self) -> tuple[int, int, int, int]:
        bm = self.bm
        return (
            bm.num_free_blocks,
            bm.num_cached_idle_blocks,
            bm.num_used_blocks,
            bm.num_pinned_blocks,
        )

    def pinned_idle(self) -> list[int]:
        return self.bm._pool.idle_order(pinned=True)

    def check_pinned_evicted_last(self, pinned_idle: list[int], exempt: int | None = None) -> None:
        """If this step evicted a pinned block, no unpinned idle block may be left."""
        if any(self.bm._tree.node_of(b) is None for b in pinned_idle):
            event("pinned block evicted")
            assert set(self.bm._pool.idle_order(pinned=False)) <= {exempt}

    # ---- rules

    prompts = st.builds(
        lambda base, n, suffix: base[:n] + suffix,
        st.sampled_from(BASES),
        st.integers(0, 24),
        st.lists(st.integers(0, 5), max_size=6),
    ).filter(bool)

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(prompt=prompts, namespace=st.sampled_from(NAMESPACES), chunk=st.integers(1, 32))
    def allocate(self, prompt: list[int], namespace: str, chunk: int) -> None:
        self._allocate(prompt, namespace, chunk)

    @precondition(lambda self: len(self.seqs) < MAX_SEQS - 1)
    @rule(prompt=prompts, namespace=st.sampled_from(NAMESPACES))
    def allocate_twins(self, prompt: list[int], namespace: str) -> None:
        """Two sequences compute the same blocks before either commits: the dedupe path."""
        self._allocate(prompt, namespace, len(prompt))
        self._allocate(prompt, namespace, len(prompt))

    def _allocate(self, prompt: list[int], namespace: str, chunk: int) -> None:
        match = self.checked_match(prompt, namespace, len(prompt) - 1)
        if not self.bm.can_allocate(match, len(prompt)):
            before = self.counters()
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(prompt, namespace, match, len(prompt))
            assert self.counters() == before
            event("allocate refused")
            return
        evicted = self.bm.stats().evicted_tokens
        pinned_idle = self.pinned_idle()
        bad = {d for d, e in self.damaged.items() if self.tier._entries.get(d) is e}
        table = self.bm.allocate(prompt, namespace, match, len(prompt))
        self.check_pinned_evicted_last(pinned_idle, exempt=match.partial_block)
        if self.bm.stats().evicted_tokens > evicted:
            event("allocate evicted")
        if table.num_cached_tokens % BS:
            event("partial block copied")
        assert table.num_slots >= len(prompt)
        if match.tier:
            reloaded = table.num_reloaded_tokens
            assert reloaded % BS == 0 and reloaded <= len(match.tier) * BS
            assert table.num_cached_tokens == len(match.blocks) * BS + reloaded
            assert not set(match.tier[: reloaded // BS]) & bad, "reloaded a damaged slot"
            missed = match.tier[reloaded // BS : reloaded // BS + 1]
            if missed and missed[0] in bad:
                assert missed[0] not in self.tier, "a damaged slot stays in the tier"
                event("damaged slot read as a miss")
            event("reloaded from the tier" if reloaded else "tier reload missed")
        else:
            assert table.num_cached_tokens in (match.num_tokens, len(match.blocks) * BS)
        assert table.block_ids[: len(match.blocks)] == match.blocks
        seq = Seq(table, list(prompt), table.num_cached_tokens)
        self.seqs.append(seq)
        self.compute(seq, chunk)

    def checked_match(self, prompt: list[int], namespace: str, max_tokens: int) -> PrefixMatch:
        match = self.bm.match(prompt, namespace, max_tokens)
        assert match.num_tokens <= max_tokens
        assert match.partial_tokens < BS
        # what the match points at really is this prompt's history (never placed values)
        expected = history_values(namespace, prompt)
        for pos in range(match.num_tokens - len(match.tier) * BS):  # the pool's part
            block = match.blocks[pos // BS] if pos // BS < len(match.blocks) else None
            block = match.partial_block if block is None else block
            assert self.kv[block, pos % BS] == expected[pos]
        return match

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(
        prefix=st.sampled_from([[], BASES[0][:3], BASES[1][:8]]),  # repeats: later hits
        doc=st.sampled_from(DOCS),
        suffix=st.lists(st.integers(0, 5), min_size=1, max_size=4),
        namespace=st.sampled_from(NAMESPACES),
        repair=st.integers(0, 5),
        chunk=st.integers(1, 32),
    )
    def allocate_with_chunk(
        self,
        prefix: list[int],
        doc: list[int],
        suffix: list[int],
        namespace: str,
        repair: int,
        chunk: int,
    ) -> None:
        """A prompt with a reuse="anywhere" document: find or store the document's chunk
        entry (stored after the context before it, here ``prefix``, to a block boundary),
        allocate the prompt, place the chunk's values (delta 0: the first flagged document)."""
        context = len(prefix)
        stored_tokens = prefix + doc[: stored_length(context, len(doc), BS)]
        whole = len(stored_tokens)
        chunk_ns = chunk_namespace(namespace)
        stored = self.checked_match(stored_tokens, chunk_ns, whole)
        if whole == 0 or not self.bm.can_allocate(stored, whole):
            return
        source = Seq(self.bm.allocate(stored_tokens, chunk_ns, stored, whole), stored_tokens, 0)
        source.num_computed = source.table.num_cached_tokens
        self.compute(source, whole)
        self.bm.commit(source.table, source.tokens, whole)
        if stored.num_tokens == whole:
            event("chunk entry hit")
        prompt = prefix + doc + suffix
        spans = [
            SegmentSpan("prefix", 0, len(prefix)),
            SegmentSpan("doc", len(prefix), len(prefix) + len(doc), "anywhere"),
            SegmentSpan("suffix", len(prefix) + len(doc), len(prompt)),
        ]
        match = self.checked_match(prompt, namespace, len(prompt) - 1)
        plans = plan_placements(spans, match.num_tokens, len(prompt), repair, BS)
        if not plans or not self.bm.can_allocate(match, len(prompt)):
            self.bm.free(source.table)
            return
        table = self.bm.allocate(prompt, namespace, match, len(prompt))
        seq = Seq(table, prompt, table.num_cached_tokens, placed={})
        (_, start, end) = plans[0]
        assert start >= seq.num_computed  # placed spans start past the exact hit
        for pos in range(start, end):
            src = source.table.block_ids[pos // BS]  # the chunk's slot at the same position
            value = placed_value(int(self.kv[src, pos % BS]), len(prefix) - context)
            assert self.bm.ref_count(table.block_ids[pos // BS]) == 1
            self.kv[table.block_ids[pos // BS], pos % BS] = value
            seq.placed[pos] = value
        seq.exact = start
        self.bm.free(source.table)  # the chunk entry stays cached
        self.seqs.append(seq)
        event("chunk placed")
        self.compute(seq, chunk)

    def compute(self, seq: Seq, chunk: int) -> None:
        end = min(len(seq.tokens), seq.num_computed + chunk)
        self.write(seq, seq.num_computed, end)
        seq.num_computed = end
        while seq.placed and seq.num_computed in seq.placed:  # Sequence.skip_placed
            seq.num_computed += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 16), token=st.integers(0, 5), commit=st.booleans())
    def step(self, data: st.DataObject, chunk: int, token: int, commit: bool) -> None:
        """Prefill the next chunk, or decode one token once the prompt is done."""
        seq = data.draw(st.sampled_from(self.seqs))
        self._step(seq, chunk, token)
        if commit:
            self.bm.commit(seq.table, seq.tokens, seq.committable)

    def _step(self, seq: Seq, chunk: int, token: int) -> None:
        if seq.num_computed < len(seq.tokens):
            self.compute(seq, chunk)
            return
        n = len(seq.tokens) + 1
        if not self.bm.can_grow(seq.table, n):
            before = self.counters()
            with pytest.raises(OutOfBlocksError):
                self.bm.grow(seq.table, n)
            assert self.counters() == before
            return
        pinned_idle = self.pinned_idle()
        self.bm.grow(seq.table, n)
        self.check_pinned_evicted_last(pinned_idle)
        seq.tokens.append(token)
        self.compute(seq, 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        before = list(seq.table.block_ids)
        self.bm.commit(seq.table, seq.tokens, seq.committable)
        if before != seq.table.block_ids:
            event("commit deduped")
        assert seq.table.num_committed_blocks == seq.committable // BS
        assert len(seq.table.hashes) == seq.table.num_committed_blocks
        hashes = self.bm.block_hashes(seq.tokens[: seq.committable], seq.table.namespace)
        assert seq.table.hashes == hashes

    @precondition(lambda self: 0 < len(self.seqs) < MAX_SEQS)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if not can_fork(self.bm, seq.table):
            return
        pinned_idle = self.pinned_idle()
        written = max([seq.num_computed, *((p + 1) for p in seq.placed or ())])  # placed ahead
        table = fork_table(self.bm, seq.table, seq.tokens, written, self.copy_slots)
        placed = dict(seq.placed) if seq.placed is not None else None
        self.check_pinned_evicted_last(pinned_idle)
        assert table.num_slots == seq.table.num_slots
        shared = seq.table.num_committed_blocks
        assert table.block_ids[:shared] == seq.table.block_ids[:shared]
        assert not set(table.block_ids[shared:]) & set(seq.table.block_ids)
        self.seqs.append(Seq(table, list(seq.tokens), seq.num_computed, placed, seq.exact))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), commit=st.booleans())
    def free(self, data: st.DataObject, commit: bool) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if commit:
            self.bm.commit(seq.table, seq.tokens, seq.committable)
        self.seqs.remove(seq)
        self.bm.free(seq.table)
        assert seq.table.block_ids == []

    @rule()
    def evict_all(self) -> None:
        pinned_before = self.bm.num_pinned_blocks
        used_before = self.bm.num_used_blocks
        idle_before = self.bm.num_cached_idle_blocks
        evicted = self.bm.evict_all()
        assert evicted == idle_before - self.bm.num_cached_idle_blocks
        assert self.bm.num_pinned_blocks == pinned_before
        assert self.bm.num_used_blocks == used_before
        assert self.bm.evict_all() == 0

    @rule()
    def evict_all_including_pinned(self) -> None:
        used_before = self.bm.num_used_blocks
        self.bm.evict_all(include_pinned=True)
        self.pins.clear()
        assert self.bm.num_pinned_blocks == 0
        assert self.bm.num_cached_idle_blocks == 0
        assert self.bm.num_used_blocks == used_before

    @rule(
        data=st.data(),
        namespace=st.sampled_from(NAMESPACES),
        ttl=st.one_of(st.none(), st.floats(1, 20)),
    )
    def pin(self, data: st.DataObject, namespace: str, ttl: float | None) -> None:
        choices = [(s.tokens, s.table.namespace) for s in self.seqs]
        choices += [(b, namespace) for b in BASES]
        tokens, ns = data.draw(st.sampled_from(choices))
        depth = self.bm.pin(tokens, ns, ttl_s=ttl, max_blocks=6 if ttl else None)
        if depth and ttl is None:
            self.pins.append((list(tokens), ns))
        elif depth:
            pin = self.bm.ttl_pin_of(tokens[: depth * BS], ns)
            assert pin is not None and pin.expires >= self.now + ttl and pin.depth == depth
            event("TTL pin")
        if ttl is not None:  # the cap: TTL pins of one namespace cover at most 6 blocks
            assert sum(p.depth for p in self.bm._ttl.values() if p.namespace == ns) <= 6

    @rule(dt=st.floats(0, 10))
    def tick_and_expire(self, dt: float) -> None:
        self.now += dt
        pinned_before = self.bm.num_pinned_blocks
        if self.bm.expire_pins():
            event("TTL pin expired")
            assert self.bm.num_pinned_blocks <= pinned_before
        assert all(p.expires > self.now for p in self.bm._ttl.values())

    @rule(data=st.data())
    def spill_all_to_tier(self, data: st.DataObject) -> None:
        """Evict every idle block into the tier (the pool forgets, the tier remembers)."""
        pinned = self.bm.num_pinned_blocks
        if self.bm.evict_all(keep_tier=True):
            event("spilled to the tier")
        assert self.bm.num_pinned_blocks == pinned

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(prompt=prompts, namespace=st.sampled_from(NAMESPACES), chunk=st.integers(1, 32))
    def spill_then_allocate(self, prompt: list[int], namespace: str, chunk: int) -> None:
        """The pool forgets its idle blocks; a prompt over them reloads what the tier kept."""
        self.bm.evict_all(keep_tier=True)
        self._allocate(prompt, namespace, chunk)

    @precondition(lambda self: len(self.tier))
    @rule(data=st.data(), reload=st.booleans())
    def damage_tier_slot(self, data: st.DataObject, reload: bool) -> None:
        """Corrupt a slot; then (maybe) ask for its prefix: the reload must stop before it."""
        digest = data.draw(st.sampled_from(list(self.tier._entries)))
        self.tier.corrupt_slot(digest)
        self.damaged[digest] = self.tier._entries[digest]
        found = self.prefix_of(digest)
        if reload and found is not None and len(self.seqs) < MAX_SEQS:
            tokens, namespace = found
            self.bm.evict_all(keep_tier=True)
            self._allocate(tokens + [0], namespace, 1)

    def prefix_of(self, digest: bytes) -> tuple[list[int], str] | None:
        """The token ids and namespace of the prefix ending at a tier entry's block."""
        roots = {root_digest(b"model|tok|fp32", ns): ns for ns in NAMESPACES}
        chunks: list[bytes] = []
        while digest not in roots:
            entry = self.tier._entries.get(digest)
            node = self.bm._tree._nodes.get(digest)
            if entry is not None:
                chunks.append(entry.tokens)
                digest = entry.parent
            elif node is not None:
                chunks.append(node.tokens)
                digest = node.parent_digest
            else:
                return None  # its parent is gone from both levels
        data = b"".join(reversed(chunks))
        return list(array("I", data)), roots[digest]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        tokens, namespace = data.draw(st.sampled_from(self.pins))
        self.pins.remove((tokens, namespace))
        pinned_before = self.bm.num_pinned_blocks
        if self.bm.unpin(tokens, namespace) == 0:
            event("pinned prefix was evicted")
        assert self.bm.num_pinned_blocks <= pinned_before

    # ---- invariants, checked after every step

    @invariant()
    def pool_adds_up(self) -> None:
        self.bm.check_invariants()
        free, idle, used, _ = self.counters()
        assert free + idle + used == NUM_BLOCKS

    @invariant()
    def ref_counts_match_live_tables(self) -> None:
        refs: Counter[int] = Counter()
        for seq in self.seqs:
            assert len(set(seq.table.block_ids)) == len(seq.table.block_ids)
            refs.update(seq.table.block_ids)
        for block in range(NUM_BLOCKS):
            assert self.bm.ref_count(block) == refs[block], block
        assert self.bm.num_used_blocks == len(refs)

    @invariant()
    def only_committed_blocks_are_shared(self) -> None:
        owners: dict[int, list[tuple[Seq, int]]] = {}
        for seq in self.seqs:
            for i, block in enumerate(seq.table.block_ids):
                owners.setdefault(block, []).append((seq, i))
        for users in owners.values():
            if len(users) > 1:
                assert all(i < seq.table.num_committed_blocks for seq, i in users)

    @invariant()
    def tier_entries_hold_their_blocks(self) -> None:
        """Every undamaged tier entry's slot holds exactly its block's history values."""
        live = self.tier._entries
        self.damaged = {d: e for d, e in self.damaged.items() if live.get(d) is e}
        self.tier.check()
        stats = self.tier.stats()
        assert stats.bytes_used == len(self.tier._entries) * FakePages.bytes_per_block
        for digest, entry in self.tier._entries.items():
            assert entry.written
            if digest in self.damaged:
                continue
            values = self.tier.storage.slots[entry.slot].view(np.int64)
            assert checksum(self.tier.storage.slots[entry.slot]) == entry.checksum
            assert (
                digest not in self.bm._tree._nodes
                or values.tolist() == self.kv[self.bm._tree._nodes[digest].block].tolist()
            )

    @invariant()
    def every_table_reads_back_its_own_history(self) -> None:
        for seq in self.seqs:
            expected = seq.expected()
            for pos, value in enumerate(expected):
                assert self.kv[seq.table.block_ids[pos // BS], pos % BS] == value, pos


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
