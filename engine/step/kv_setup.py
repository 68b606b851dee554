"""The engine's KV memory: the pages, the block manager over them, and the KV tier. A
hybrid (sliding-window + global) model gets two layer groups: its KV budget is split between
the global pages and the sliding layers' local pages (docs/architecture.md, "Hybrid models");
a model whose every layer slides keeps the global pages as the prefix tree's blocks only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from ..attention import kv_dtype
from ..config import EngineConfig, TierSpec
from ..memory.block_manager import BlockManager
from ..memory.block_types import BlockTable
from ..memory.hybrid.manager import HybridBlockManager
from ..memory.kv_cache import KVCache, KVCacheSpec
from ..memory.kv_tier import KVTier, create_tier
from ..model.loader import LoadedModel
from ..paging import ceil_div


@dataclass(slots=True)
class KVMemory:
    cache: KVCache
    manager: BlockManager
    tier: KVTier | None = None
    local_table_of: Callable[[BlockTable], list[int]] | None = None  # hybrid models only
    local_tier: KVTier | None = None  # hybrid models with a tier: their local pages' part


def cache_identity(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> bytes:
    """Root of every namespace: blocks never match across models, tokenizers, dtypes or KV
    page dtypes (an fp8 page is not a bf16 one; ``fp8`` and ``fp8_e4m3`` are one format)."""
    key = f"{loaded.fingerprint}|{loaded.tokenizer.fingerprint}|{loaded.dtype}"
    if kv_cache_dtype != "auto":
        key += f"|kv:{kv_dtype.name_of(kv_dtype.resolve(kv_cache_dtype, loaded.dtype))}"
    return hashlib.sha256(key.encode()).digest()


def build_kv(
    config: EngineConfig, loaded: LoadedModel, identity: bytes, clock: Callable[[], float]
) -> KVMemory:
    spec = loaded.kv_cache_spec(
        config.block_size, kv_dtype.resolve(config.kv_cache_dtype, loaded.dtype)
    )
    windows = effective_windows(config, loaded)
    if any(windows):
        cache, hybrid, tier, local_tier = build_hybrid(config, spec, windows, identity, clock)
        return KVMemory(cache, hybrid, tier, hybrid.local_table, local_tier)
    num_blocks = config.num_blocks or spec.num_blocks_for(config.kv_memory_bytes)
    cache = KVCache(spec, num_blocks)
    tier = None
    if config.kv_offload and config.enable_prefix_caching:
        tier = create_tier(
            TierSpec.parse(config.kv_offload),
            cache,
            str(loaded.device),
            keep_files=config.kv_offload_keep_files,
        )
    manager = BlockManager(
        num_blocks,
        config.block_size,
        identity=identity,
        copy_slots=cache.copy_slots,
        enable_caching=config.enable_prefix_caching,
        tier=tier,
        spill_policy=config.kv_spill_policy,
        clock=clock,
    )
    return KVMemory(cache, manager, tier)


def effective_windows(config: EngineConfig, loaded: LoadedModel) -> tuple[int, ...]:
    """The model's sliding windows, less those no sequence can outgrow (>= the context,
    ``--max-model-len``): such a layer attends as a global one, and the model keeps one
    layer group (with ``--kv-offload`` and prefix files) when every window is one of them."""
    cfg = loaded.config
    context = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return tuple(w if w < context else 0 for w in cfg.layer_windows)


def build_hybrid(
    config: EngineConfig,
    spec: KVCacheSpec,
    windows: tuple[int, ...],
    identity: bytes,
    clock: Callable[[], float],
) -> tuple[KVCache, HybridBlockManager, KVTier | None, KVTier | None]:
    """The two-group cache, its manager and (``--kv-offload``) the tier of each group."""
    num_blocks, num_local = hybrid_pool_sizes(config, spec, windows)
    local_layers = [i for i, w in enumerate(windows) if w > 0]
    cache = KVCache(spec, num_blocks, num_local, local_layers)
    tier = local_tier = None
    if config.kv_offload and config.enable_prefix_caching:
        tier, local_tier = hybrid_tiers(config, cache, spec.device)
    manager = HybridBlockManager(
        num_blocks,
        config.block_size,
        identity,
        window=max(windows),
        num_local_pages=num_local,
        copy_slots=cache.copy_slots,
        copy_local_slots=cache.copy_local_slots,
        enable_caching=config.enable_prefix_caching,
        clock=clock,
        tier=tier,
        local_tier=local_tier,
        spill_policy=config.kv_spill_policy,
    )
    return cache, manager, tier, local_tier


def hybrid_tiers(config: EngineConfig, cache: KVCache, device: str) -> tuple[KVTier, KVTier]:
    """The ``--kv-offload`` bytes split as the pool is: ``swa_pool_ratio`` local-page slots
    per global-page slot (a model whose every layer slides: global slots of no bytes, the
    tree's blocks only)."""
    spec = TierSpec.parse(config.kv_offload)
    g_bytes, l_bytes = cache.global_io.bytes_per_block, cache.local_io.bytes_per_block
    ratio = config.swa_pool_ratio
    num_global = int(spec.num_bytes // (g_bytes + ratio * l_bytes))
    num_local = int(ratio * num_global)
    if num_local < 1:
        raise ValueError(
            f"--kv-offload: {spec.num_bytes} bytes hold no {l_bytes}-byte local page "
            f"beside {1 / ratio:g} global ones"
        )
    keep = config.kv_offload_keep_files
    tier = create_tier(spec, cache.global_io, device, keep, num_slots=num_global)
    local_tier = create_tier(spec, cache.local_io, device, keep, num_slots=num_local)
    return tier, local_tier


def hybrid_pool_sizes(
    config: EngineConfig, spec: KVCacheSpec, windows: tuple[int, ...]
) -> tuple[int, int]:
    """(global pages, local pages incl. the null page) for a hybrid model: the KV budget split
    so that there are ``swa_pool_ratio`` local pages per global page (see
    ``local_pool_size`` for its floor and cap); ``num_blocks`` fixes the global side."""
    window, bs = max(windows), config.block_size
    num_local_layers = sum(1 for w in windows if w > 0)
    page = spec.bytes_per_layer_page
    g_bytes, l_bytes = (spec.num_layers - num_local_layers) * page, num_local_layers * page

    def local(n: int, seqs: int) -> int:
        ratio, step = config.swa_pool_ratio, config.max_num_batched_tokens
        return local_pool_size(n, ratio, window, bs, seqs, step)

    seqs = config.max_num_seqs
    if config.num_blocks:
        return config.num_blocks, local(config.num_blocks, seqs)
    budget = config.kv_memory_bytes
    if not g_bytes:
        # Every layer slides (Mistral): a global page holds no KV, only the prefix tree's
        # block, so the budget is all local pages, with 1 / swa_pool_ratio blocks per page.
        num_local = max(2, budget // l_bytes)
        return max(num_local, int(num_local / config.swa_pool_ratio)), num_local
    if local(1 << 40, seqs) * l_bytes > budget // 2:
        # Every sequence's window (max_num_seqs of them) would take over half the budget
        # (and once took the global pool down to one block): floor for one sequence. The
        # scheduler admits only what the local pages hold and preempts as for global pages.
        seqs = 1
    num_blocks = max(1, int(budget // (g_bytes + config.swa_pool_ratio * l_bytes)))
    num_local = local(num_blocks, seqs)
    if num_blocks * g_bytes + num_local * l_bytes > budget:  # the floor took more
        num_blocks = max(1, (budget - num_local * l_bytes) // g_bytes)
        num_local = local(num_blocks, seqs)
    return num_blocks, num_local


def local_pool_size(
    num_blocks: int,
    ratio: float,
    window: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """Local pages (null page included): ``ratio`` per global page, but never fewer than
    every running sequence's window plus one full step of new tokens needs (a sequence
    computing [s, e) holds blocks (s - w + 1) // bs .. (e - 1) // bs), and never more than
    one per block (more could not be used)."""
    per_seq = ceil_div(max(window - 1, 0), block_size) + 2
    floor = max_num_seqs * per_seq + ceil_div(max_num_batched_tokens, block_size) + 1
    return max(2, min(num_blocks + 1, max(int(ratio * num_blocks) + 1, floor)))
