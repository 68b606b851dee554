"""``CacheStats``: the shape of ``GET /v1/cache/stats``, one definition for both ends.

The engine fills it (``AsyncEngine.cache_stats()``), the sidecar encodes it, the SDK decodes
it. Imports only msgspec, so the engine may import it and the SDK stays torch-free. Every field
has a default, so a server that omits one still parses.
"""

from __future__ import annotations

import msgspec


class BlockStats(msgspec.Struct):
    total: int = 0
    free: int = 0
    cached_idle: int = 0
    in_use: int = 0
    pinned: int = 0


class TokenStats(msgspec.Struct):
    queries: int = 0
    hits: int = 0
    inserted: int = 0
    evicted: int = 0


class TokenizerPieceStats(msgspec.Struct):
    """The tokenizer's memo of the text between special tokens."""

    hits: int = 0
    misses: int = 0
    entries: int = 0
    chars: int = 0


class TierBlockStats(msgspec.Struct, repr_omit_defaults=True):
    """The KV tier below the pool (``--kv-offload``): evicted blocks whose KV it keeps, so a
    later hit copies them back instead of computing them."""

    kind: str = ""  # "host" | "disk"
    total: int = 0  # blocks it can hold
    used: int = 0  # blocks it holds
    bytes_total: int = 0
    bytes_used: int = 0
    # hybrid models only: the sliding layers' pages it can hold and holds (bytes_* count them)
    local_total: int | msgspec.UnsetType = msgspec.UNSET
    local_used: int | msgspec.UnsetType = msgspec.UNSET


class LocalPageStats(msgspec.Struct):
    """Hybrid models (sliding-window layers beside global ones): the sliding layers' own pool
    of pages. A running request holds only the pages inside its window; the rest stay with
    their cached blocks (idle, evictable) until the pool needs them."""

    total: int = 0
    held: int = 0  # inside running requests' windows
    idle: int = 0  # attached to a cached block, held by none
    free: int = 0


class CacheStats(msgspec.Struct, repr_omit_defaults=True):
    block_size: int = 0
    # What the KV pages hold: the model's dtype ("bfloat16", "float32") or "fp8_e4m3" /
    # "fp8_e5m2" (--kv-cache-dtype); "" from a server that does not say.
    kv_cache_dtype: str = ""
    blocks: BlockStats = msgspec.field(default_factory=BlockStats)
    tokens: TokenStats = msgspec.field(default_factory=TokenStats)
    hit_rate: float = 0.0
    # Left out of the JSON (UNSET) where the tokenizer keeps no such memo.
    tokenizer_pieces: TokenizerPieceStats | msgspec.UnsetType = msgspec.UNSET
    # Left out of the JSON (UNSET) where the engine has no KV tier.
    tier: TierBlockStats | msgspec.UnsetType = msgspec.UNSET
    # Left out of the JSON (UNSET) where the model has no sliding-window layers.
    local_pages: LocalPageStats | msgspec.UnsetType = msgspec.UNSET
