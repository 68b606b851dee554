"""The cache as the SDK's ``CacheStats`` shows it: the block manager's counts, the KV tier's
occupancy, the tokenizer's piece memo. Torch-free (both sides of a process engine use it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from prefixcache.sdk.cache_stats import (
    BlockStats,
    CacheStats,
    LocalPageStats,
    TierBlockStats,
    TokenizerPieceStats,
    TokenStats,
)

if TYPE_CHECKING:
    from ..memory.block_types import ManagerStats
    from ..memory.kv_tier import TierStats
    from ..text.tokenizer import Tokenizer


def cache_stats(
    s: ManagerStats,
    tier: TierStats | None,
    pieces: TokenizerPieceStats | msgspec.UnsetType = msgspec.UNSET,
    kv_cache_dtype: str = "",
    local_tier: TierStats | None = None,
) -> CacheStats:
    return CacheStats(
        block_size=s.block_size,
        kv_cache_dtype=kv_cache_dtype,
        blocks=BlockStats(
            total=s.num_blocks,
            free=s.num_free_blocks,
            cached_idle=s.num_cached_idle_blocks,
            in_use=s.num_used_blocks,
            pinned=s.num_pinned_blocks,
        ),
        tokens=TokenStats(
            queries=s.query_tokens,
            hits=s.hit_tokens,
            inserted=s.inserted_tokens,
            evicted=s.evicted_tokens,
        ),
        hit_rate=s.hit_tokens / s.query_tokens if s.query_tokens else 0.0,
        tokenizer_pieces=pieces,
        tier=tier_blocks(tier, local_tier) if tier is not None else msgspec.UNSET,
        local_pages=local_pages(s) if s.num_local_pages else msgspec.UNSET,
    )


def local_pages(s: ManagerStats) -> LocalPageStats:
    return LocalPageStats(
        total=s.num_local_pages,
        held=s.num_local_held,
        idle=s.num_local_idle,
        free=s.num_local_pages - s.num_local_held - s.num_local_idle,
    )


def tier_blocks(t: TierStats, local: TierStats | None = None) -> TierBlockStats:
    """The tier's blocks (their global layers' KV) and, for a hybrid model, its local pages;
    bytes count both."""
    out = TierBlockStats(
        kind=t.kind,
        total=t.num_slots,
        used=t.num_entries,
        bytes_total=t.num_slots * t.slot_bytes,
        bytes_used=t.bytes_used,
    )
    if local is not None:
        out.local_total, out.local_used = local.num_slots, local.num_entries
        out.bytes_total += local.num_slots * local.slot_bytes
        out.bytes_used += local.bytes_used
    return out


def piece_stats(tokenizer: Tokenizer | None) -> TokenizerPieceStats | msgspec.UnsetType:
    """The tokenizer's memo of text between special tokens; UNSET where it keeps none."""
    pieces = tokenizer.piece_cache if tokenizer is not None else None
    if pieces is None:
        return msgspec.UNSET
    s = pieces.stats
    return TokenizerPieceStats(hits=s.hits, misses=s.misses, entries=s.entries, chars=s.chars)
