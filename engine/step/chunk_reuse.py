"""Position-independent reuse of document segments (a segment with ``reuse="anywhere"``).

A flagged segment's KV is computed without the other documents: after the prompt's context
before its first flagged segment (the system text, ``P`` tokens), at positions
``[P, P + n)``, as APE does, so that the chunk's tokens see the sequence start they were
trained to see rather than making their own first token one. It is kept by the block manager
under the request's chunk namespace (its namespace plus a suffix no server-derived namespace
can end with) as the continuation of that context: the same pool, LRU, pins and eviction as
prefix blocks, keyed by (model identity, namespace, the context, the segment's tokens; the
context's blocks are shared by every chunk after it), while no request's prefix lookup can
meet it, nor count as a prefix-cache lookup (the hit-rate counters). Placed at offset ``o`` of a prompt, the stored K is re-rotated by ``o - P`` (RoPE
composes) and copied with V into the request's own pages. The first ``repair`` tokens of each chunk
(EPIC-style) and its tail past the last full block are computed in place, as ordinary
prefill. Placed KV is approximate: the sequence never commits a block from its first placed
token on (``Sequence.exact_tokens``), so it never reaches the prefix tree.

Hybrid models (sliding-window + global layers, docs/architecture.md "Hybrid models"): each
layer's K is re-rotated with its own frequencies (Gemma 3's sliding layers have their own
rope base); a sliding layer's KV is copied between local pages, and only for the last window
of each placed span: every query computed after the span is at its end or later, so none sees
further back. That window is the chunk's own last window (a span ends where the chunk's
stored tokens end, or at the prompt's last token before that), whose local pages the chunk's
table holds from the lookup (``HybridBlockManager.fit`` finds a chunk only with its window
complete) or the computation until ``place``; a span cut short by the prompt's last token can
reach one block further back, and is computed in place if that page was taken meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import kv_dtype
from ..memory.block_manager import BlockManager
from ..memory.block_types import BlockTable, PrefixMatch
from ..memory.hybrid.local_pages import NULL_PAGE
from ..memory.hybrid.manager import HybridBlockManager
from ..memory.kv_cache import KVCache
from ..model.rope import shift_keys, shift_rotation
from ..request import SegmentSpan
from .model_runner import BatchEntry
from .sequence import Sequence

REUSE_ANYWHERE = "anywhere"
CHUNK_NAMESPACE_SUFFIX = "\x00reuse-anywhere"
DEFAULT_REPAIR_TOKENS = 16


def chunk_namespace(namespace: str) -> str:
    """Where a namespace's chunks live: a tenant's chunks are never another tenant's."""
    return namespace + CHUNK_NAMESPACE_SUFFIX


@dataclass(slots=True)
class Placement:
    """One flagged segment's stored KV placed into a sequence's pages."""

    segment: int  # index in the request's segments
    start: int  # first placed prompt position (the segment's start + the repair tokens)
    end: int  # one past the last placed position
    delta: int  # positions the stored keys move by (the segment's offset minus the context)
    stored: bool  # the chunk's KV was in the store (else computed for this request)
    table: BlockTable | None = None  # the chunk's own table, held until the copy is done

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def context_length(spans: list[SegmentSpan]) -> int:
    """``P``: the prompt tokens before its first flagged segment, which every chunk is
    computed after (0 without one)."""
    return next((s.start for s in spans if s.reuse == REUSE_ANYWHERE), 0)


def stored_length(context: int, tokens: int, block_size: int) -> int:
    """How many of a chunk's ``tokens`` are stored: up to the last block boundary of
    context + chunk (only whole blocks are committed; the rest is computed in place)."""
    return max(0, (context + tokens) // block_size * block_size - context)


def plan_placements(
    spans: list[SegmentSpan], first_free: int, prompt_len: int, repair: int, block_size: int
) -> list[tuple[int, int, int]]:
    """``(segment, start, end)`` of each flagged segment's placed span: past its ``repair``
    leading tokens and past the exact prefix hit (``first_free``: a hit covering a segment's
    first tokens is exact KV, better than placed), within its stored tokens (the tail is
    computed), before the prompt's last token (its logits are computed)."""
    plans, last_end = [], first_free
    context = context_length(spans)
    for i, span in enumerate(spans):
        if span.reuse != REUSE_ANYWHERE:
            continue
        whole = stored_length(context, span.end - span.start, block_size)
        start = max(span.start + repair, last_end)
        end = min(span.start + whole, prompt_len - 1)
        if end > start:
            plans.append((i, start, end))
            last_end = end
    return plans


class ChunkReuse:
    """The chunk store's two halves at admission: ``acquire`` (find or compute each flagged
    segment's KV, a ref held) and ``place`` (copy it into the sequence's table); ``release``
    lets go of acquired chunks that were not placed."""

    def __init__(
        self,
        manager: BlockManager,
        kv_cache: KVCache,
        execute: Callable[[list[BatchEntry]], torch.Tensor],
        layer_inv_freqs: list[torch.Tensor],
        repair: int = DEFAULT_REPAIR_TOKENS,
    ) -> None:
        """``layer_inv_freqs``: each layer's RoPE frequencies (``rope_inv_freq``'s form)."""
        if repair < 0:
            raise ValueError(f"the repair tokens must be >= 0, got {repair}")
        if len(layer_inv_freqs) != len(kv_cache.layers):
            raise ValueError("one set of RoPE frequencies per layer is needed")
        self.manager = manager
        self.kv_cache = kv_cache
        self.execute = execute
        self.layer_inv_freqs = layer_inv_freqs
        self.hybrid = manager if isinstance(manager, HybridBlockManager) else None
        self.repair = repair
        self.computed_tokens = 0  # chunk tokens computed on their own (all requests)
        self.on_namespace: Callable[[str], None] | None = None  # told each new chunk namespace
        self._namespaces: set[str] = set()

    def acquire(self, seq: Sequence, match: PrefixMatch) -> list[Placement]:
        spans = seq.request.segments or []
        bs = self.manager.block_size
        plans = plan_placements(spans, match.num_tokens, seq.num_prompt_tokens, self.repair, bs)
        context = context_length(spans)
        placements: list[Placement] = []
        try:
            for segment, start, end in plans:
                span = spans[segment]
                whole = stored_length(context, span.end - span.start, bs)
                tokens = seq.token_ids[:context] + seq.token_ids[span.start : span.start + whole]
                found = self._chunk_table(tokens, chunk_namespace(seq.namespace), seq)
                if found is None:
                    break  # no room for the chunk: it and the rest are computed in place
                table, stored = found
                delta = span.start - context
                placements.append(Placement(segment, start, end, delta, stored, table))
        except BaseException:
            self.release(placements)  # a failed chunk step holds nothing
            raise
        return placements

    def place(self, seq: Sequence, placements: list[Placement]) -> None:
        """Copy each chunk's KV (K re-rotated) into ``seq``'s table, which holds the whole
        prompt; the chunks' refs are dropped (their blocks stay cached)."""
        assert seq.table is not None and seq.table.num_slots >= seq.num_prompt_tokens
        if self.hybrid is not None:  # a span cut short by the prompt's end can reach back
            gone = [p for p in placements if NULL_PAGE in self._local_sources(p)]
            self.release(gone)  # past the chunk's held window: computed in place instead
            placements = [p for p in placements if p not in gone]
        for p in placements:
            assert p.table is not None
            src = range(p.start - p.delta, p.end - p.delta)
            self._copy(p.table.block_ids, src, seq.table.block_ids, p.start, p.delta)
        self.release(placements)
        seq.placements = placements

    def _local_sources(self, p: Placement) -> list[int]:
        """The chunk's local pages that the span's last window reads."""
        assert self.hybrid is not None and p.table is not None
        bs, page_of = self.manager.block_size, self.hybrid.local.page_of
        lo = max(p.start, p.end - self.hybrid.window + 1) - p.delta
        return [page_of[b] for b in p.table.block_ids[lo // bs : (p.end - 1 - p.delta) // bs + 1]]

    def release(self, placements: list[Placement]) -> None:
        for p in placements:
            if p.table is not None:
                self.manager.free(p.table)
                p.table = None

    def _chunk_table(
        self, tokens: list[int], namespace: str, seq: Sequence
    ) -> tuple[BlockTable, bool] | None:
        """The chunk's table with its KV written and committed: found, or computed now."""
        manager = self.manager
        if namespace not in self._namespaces and self.on_namespace is not None:
            if len(self._namespaces) >= 65536:  # bounded, as the manager's roots are
                self._namespaces.clear()
            self._namespaces.add(namespace)
            self.on_namespace(namespace)
        match = manager.match(tokens, namespace, len(tokens))
        if not manager.can_allocate(match, len(tokens)):
            return None
        table = manager.allocate(tokens, namespace, match, len(tokens))
        if table.num_slots < len(tokens):  # a tier entry lost at allocation: not this time
            manager.free(table)
            return None
        cached = table.num_cached_tokens
        if cached < len(tokens):
            local = self.hybrid.local_table(table) if self.hybrid is not None else None
            entry = BatchEntry(tokens[cached:], cached, table.block_ids, False, local)
            try:
                self.execute([entry])
            except BaseException:
                manager.free(table)
                raise
            manager.commit(table, tokens, len(tokens))
            self.computed_tokens += len(tokens) - cached
            seq.num_computed_prompt_tokens += len(tokens) - cached
        return table, cached == len(tokens)

    def _copy(
        self, src_blocks: list[int], src: range, dst_blocks: list[int], dst_start: int, delta: int
    ) -> None:
        """Slots ``src`` of the chunk's blocks into slots from ``dst_start`` of the sequence's,
        K rotated by ``delta``; a hybrid model's sliding layers between the blocks' local
        pages, for the span's last window only."""
        spec, local = self.kv_cache.spec, set(self.kv_cache.local_layers)
        global_rows = self._slot_rows(src_blocks, src, dst_blocks, dst_start)
        local_rows = None
        if self.hybrid is not None:
            page_of, bs = self.hybrid.local.page_of, self.manager.block_size
            window = range(max(src.start, src.stop - self.hybrid.window + 1), src.stop)
            src_pages, dst_pages = (
                [page_of[b] for b in src_blocks],
                [page_of[b] for b in dst_blocks],
            )
            dst_window = dst_start + window.start - src.start
            assert NULL_PAGE not in src_pages[window.start // bs : (window.stop - 1) // bs + 1]
            assert (
                NULL_PAGE
                not in dst_pages[dst_window // bs : (dst_window + len(window) - 1) // bs + 1]
            )
            local_rows = self._slot_rows(src_pages, window, dst_pages, dst_window)
        rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.kv_cache.layers):
            rows_of = local_rows if i in local else global_rows
            if rows_of is None or rows_of[0].numel() == 0:
                continue
            src_k, dst_k = rows_of
            src_v, dst_v = src_k + self.manager.block_size, dst_k + self.manager.block_size
            rows = layer.view(-1, spec.num_kv_heads * spec.head_dim)
            raw = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # fp8: its bytes
            raw.index_copy_(0, dst_v, raw.index_select(0, src_v))
            keys = raw.index_select(0, src_k)
            if delta:  # rotated in float32, then stored as the pages hold K
                freqs = self.layer_inv_freqs[i]
                if id(freqs) not in rotations:
                    rotations[id(freqs)] = shift_rotation(freqs, delta)
                k = keys.view(rows.dtype).view(-1, spec.num_kv_heads, spec.head_dim).float()
                k = shift_keys(k, *rotations[id(freqs)])
                keys = kv_dtype.to_kv(k, rows.dtype).view(raw.dtype)
            raw.index_copy_(0, dst_k, keys.reshape(len(src_k), -1))

    def _slot_rows(
        self, src_pages: list[int], src: range, dst_pages: list[int], dst_start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K rows of slots ``src`` of ``src_pages`` and of the slots from ``dst_start`` of
        ``dst_pages``, each layer seen as rows of ``[num_pages * 2 * bs, Hk * D]`` (K of slot
        s of page b at row ``b * 2 * bs + s``, its V ``bs`` rows further)."""
        bs, device = self.manager.block_size, self.kv_cache.layers[0].device
        src_pos = torch.arange(src.start, src.stop)
        dst_pos = torch.arange(dst_start, dst_start + len(src))
        src_k = torch.tensor(src_pages, dtype=torch.long)[src_pos // bs] * 2 * bs + src_pos % bs
        dst_k = torch.tensor(dst_pages, dtype=torch.long)[dst_pos // bs] * 2 * bs + dst_pos % bs
        return src_k.to(device), dst_k.to(device)
