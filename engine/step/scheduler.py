"""Continuous batching: which sequences compute how many tokens in the next step.

One step has a token budget. Running sequences go first, decodes before prefill chunks, so a
long prompt never stalls decoding; what is left of the budget admits waiting sequences, each
starting after its cached prefix. Out of blocks, the least important running sequence is
preempted (freed, recomputed later; its committed blocks stay cached, so it re-hits them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..memory.block_manager import BlockManager
from ..memory.block_types import PrefixMatch
from ..memory.hybrid.manager import HybridBlockManager
from ..request import SegmentMiss
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .chunk_reuse import ChunkReuse, Placement

ExplainMiss = Callable[[Sequence, PrefixMatch], SegmentMiss | None]

_HIT_REFRESH_PER_STEP = 16


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # with placed spans (chunk_reuse.py) in between: the runs of those tokens, [start, end)
    runs: list[tuple[int, int]] | None = None

    def token_runs(self) -> list[tuple[int, int]]:
        start = self.seq.num_computed_tokens
        return self.runs or [(start, start + self.num_tokens)]


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.explain_miss: ExplainMiss | None = None  # at first admission, before allocating
        self.reuse: ChunkReuse | None = None  # reuse="anywhere" segments (chunk_reuse.py)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.num_steps
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.block_manager.expire_pins()  # lapsed TTL pins: ordinary LRU entries from now on
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # a step that had to preempt admits nothing new
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        order = sorted(self.running, key=lambda s: (not s.is_decoding, s.priority, s.arrival_order))
        for i, seq in enumerate(order):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_tokens = min(seq.num_tokens_to_compute, budget)
            target = seq.num_computed_tokens + num_tokens
            while not self.block_manager.can_grow(seq.table, target):
                victim = _least_important(
                    [s for s in order[i:] if s.status is SequenceStatus.RUNNING] or [seq]
                )
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.grow(seq.table, target)
                out.chunks.append(_chunk(seq, num_tokens))
                budget -= num_tokens
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        manager = self.block_manager
        leaders = [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]
        tails = self._live_tails()
        for seq in self._admission_order():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            match = self._match(seq)  # fresh: an earlier admission may have evicted blocks
            match = self._extend_with_live_tail(seq, match, tails)
            if self._waits_for_leader(seq, match, leaders):
                continue
            placements = self._acquire_chunks(seq, match)
            if placements:  # computing a chunk may have evicted some of the prefix hit
                match = self._extend_with_live_tail(seq, self._match(seq), tails)
                placements = self._drop_covered(placements, match.num_tokens)
            num_tokens = min(seq.num_tokens - match.num_tokens, budget)
            target = seq.num_tokens if placements else match.num_tokens + num_tokens
            if not manager.can_allocate(match, target):
                self._release_chunks(placements)
                break  # head of line waits for memory; smaller requests do not jump it
            if seq.num_cached_tokens is None and self.explain_miss is not None:
                seq.miss = self.explain_miss(seq, match)
            seq.table = manager.allocate(seq.token_ids, seq.namespace, match, target)
            seq.num_computed_tokens = seq.table.num_cached_tokens  # < match if no room to copy
            if placements and seq.table.num_slots < seq.num_tokens:  # hybrid tier entry lost
                self._release_chunks(placements)
                placements = []
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                seq.num_reloaded_tokens = seq.table.num_reloaded_tokens
                if manager.tier is not None:
                    seq.reload_tier = manager.tier.kind
                seq.first_scheduled_time = time.monotonic()
            if placements:
                assert self.reuse is not None
                self.reuse.place(seq, self._drop_covered(placements, seq.num_computed_tokens))
                seq.skip_placed()
                num_tokens = min(seq.num_tokens_to_compute, budget)
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            out.chunks.append(_chunk(seq, num_tokens))
            budget -= num_tokens
            leaders.append(seq)

    def _acquire_chunks(self, seq: Sequence, match: PrefixMatch) -> list[Placement]:
        if seq.wants_prompt_logprobs:  # placed KV has no logits
            return []
        if self.reuse is None or not self._caching or not seq.has_reuse_segments:
            return []
        return self.reuse.acquire(seq, match)

    def _release_chunks(self, placements: list[Placement]) -> None:
        if placements:
            assert self.reuse is not None
            self.reuse.release(placements)

    def _drop_covered(self, placements: list[Placement], cached: int) -> list[Placement]:
        """Placements after the exact prefix only (the rest are released)."""
        self._release_chunks([p for p in placements if p.start < cached])
        return [p for p in placements if p.start >= cached]

    def _admission_order(self) -> list[Sequence]:
        """Longest cached prefix first, with an age bound; arrival order when the queue is long.

        The order uses estimates of each waiting request's hit, refreshed for the stalest
        ``_HIT_REFRESH_PER_STEP`` requests each step: a match of a 20K-token prompt costs about
        1 ms, and admission matches afresh anyway."""
        if len(self.waiting) > self.config.lpm_queue_limit or not self._caching:
            return sorted(self.waiting, key=lambda s: (s.priority, s.arrival_order))
        stalest = sorted(self.waiting, key=lambda s: s.hit_estimate_step)
        for seq in stalest[:_HIT_REFRESH_PER_STEP]:
            seq.hit_estimate = self._match(seq).num_tokens
            seq.hit_estimate_step = self.num_steps
        max_wait = self.config.max_wait_steps

        def key(seq: Sequence) -> tuple[bool, int, int, int]:
            aged = self.num_steps - seq.arrival_step >= max_wait
            return (not aged, seq.priority, 0 if aged else -seq.hit_estimate, seq.arrival_order)

        return sorted(self.waiting, key=key)

    def _waits_for_leader(self, seq: Sequence, match: PrefixMatch, leaders: list[Sequence]) -> bool:
        """Burst dedupe: hold ``seq`` while a running sequence is still computing full blocks
        that ``seq`` shares beyond its cached match; they are committed when the step ends.
        (A shared remainder inside one block is not worth a step: it is copied from the
        leader's live block when the leader still runs, else recomputed.)"""
        if not self._caching or seq.wants_prompt_logprobs:
            return False
        for leader in leaders:
            if leader.namespace != seq.namespace:
                continue
            shared_blocks = self._common_prefix_len(seq, leader) // self.block_size
            if (
                shared_blocks > len(match.blocks)
                and leader.num_computed_tokens < shared_blocks * self.block_size
            ):
                return True
        return False

    def _live_tails(self) -> dict[tuple[str, bytes], list[Sequence]]:
        """Running sequences by the digest before their partly filled block (b"" at the root)."""
        tails: dict[tuple[str, bytes], list[Sequence]] = {}
        for seq in self.running:
            table = seq.table
            committed = table.num_committed_blocks
            if seq.num_computed_tokens > committed * self.block_size < table.num_slots:
                parent = table.hashes[committed - 1] if committed else b""
                tails.setdefault((seq.namespace, parent), []).append(seq)
        return tails

    def _extend_with_live_tail(
        self, seq: Sequence, match: PrefixMatch, tails: dict[tuple[str, bytes], list[Sequence]]
    ) -> PrefixMatch:
        """Only full blocks enter the tree; a running sequence's partly filled block can still
        lend the written slots it shares with ``seq`` (copied, like a partial hit). This keeps a
        burst exact when the shared prefix does not end on a block boundary."""
        if not self._caching or match.tier or match.partial_tokens == self.block_size - 1:
            return match
        if seq.wants_prompt_logprobs:
            return match
        full, bs = len(match.blocks), self.block_size
        parent = self._hashes(seq)[full - 1] if full else b""
        best = match
        limit = min(bs, seq.num_tokens - 1 - full * bs)  # at least one prompt token is computed
        for other in tails.get((seq.namespace, parent), ()):
            if other.table.num_committed_blocks != full:
                continue
            written = min(limit, min(other.num_computed_tokens, other.exact_tokens) - full * bs)
            k = 0
            while k < written and seq.token_ids[full * bs + k] == other.token_ids[full * bs + k]:
                k += 1
            if k > best.partial_tokens:
                best = PrefixMatch(match.blocks, other.table.block_ids[full], k, bs)
        return best

    def _common_prefix_len(self, a: Sequence, b: Sequence) -> int:
        ha, hb = self._hashes(a), self._hashes(b)
        lo, hi = 0, min(len(ha), len(hb))  # chained digests: equal at k means equal before k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ha[mid - 1] == hb[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        start = lo * self.block_size
        end = min(start + self.block_size, a.num_tokens, b.num_tokens)
        k = start
        while k < end and a.token_ids[k] == b.token_ids[k]:
            k += 1
        return k

    def _hashes(self, seq: Sequence) -> list[bytes]:
        if len(seq.block_hashes) != seq.num_tokens // self.block_size:
            seq.block_hashes = self.block_manager.block_hashes(seq.token_ids, seq.namespace)
        return seq.block_hashes

    def _match(self, seq: Sequence) -> PrefixMatch:
        if seq.wants_prompt_logprobs:  # every prompt token's logits: computed whole
            return PrefixMatch([], None, 0, self.block_size)
        return self.block_manager.match(seq.token_ids, seq.namespace, seq.num_tokens - 1)

    @property
    def _caching(self) -> bool:
        return self.block_manager.enable_caching

    def on_step_done(self, out: SchedulerOutput) -> int:
        """The step wrote KV for every chunk: advance progress and publish full blocks.

        Returns the number of prompt tokens computed in the step."""
        prompt_tokens = 0
        for chunk in out.chunks:
            seq = chunk.seq
            prompt, runs = seq.num_prompt_tokens, chunk.token_runs()
            for start, end in runs:
                computed = max(0, min(end, prompt) - min(start, prompt))
                seq.num_computed_prompt_tokens += computed
                prompt_tokens += computed
            seq.num_computed_tokens = runs[-1][1]
            seq.skip_placed()
            exact = min(seq.num_computed_tokens, seq.exact_tokens)
            self.block_manager.commit(seq.table, seq.token_ids, exact)
            if exact < seq.num_computed_tokens and isinstance(
                self.block_manager, HybridBlockManager
            ):
                # placed KV is never committed, but its blocks still slide out of the window
                self.block_manager.slide(seq.table, seq.num_computed_tokens)
        return prompt_tokens

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.table)
        seq.table = None
        seq.num_computed_tokens = 0
        seq.placements = []  # placed again (or computed) at the next admission
        self.running.remove(seq)
        self.waiting.append(seq)
        seq.status = SequenceStatus.WAITING

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.table is not None:
            self.block_manager.free(seq.table)
            seq.table = None
        seq.status = SequenceStatus.FINISHED


def _chunk(seq: Sequence, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(seq, num_tokens, seq.compute_runs(num_tokens) if seq.placements else None)


def _least_important(candidates: list[Sequence]) -> Sequence:
    """Preemption victim: lowest priority (highest value), newest first."""
    return max(candidates, key=lambda s: (s.priority, s.arrival_order))
