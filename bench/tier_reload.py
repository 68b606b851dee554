"""Part 4 of ``bench/tiers.py``: how fast a KV tier gives blocks back.

``KVTier.reload`` timed alone, host tier and disk tier (its file in the page cache), in
bytes per second; a plain memory copy of the same bytes for scale; and, through the engine,
the same for a 1,008-token prefix evicted and hit again.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefixcache.engine.config import TierSpec
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.kv_cache import KVCache, KVCacheSpec
from prefixcache.engine.memory.kv_tier import create_tier
from prefixcache.engine.model.loader import LoadedModel


def reload_throughput(
    spec: KVCacheSpec, sizes: list[int], repeats: int, directory: str
) -> dict[str, dict[str, float]]:
    """Part 4: ``KVTier.reload`` of ``n`` blocks (spilled, the writer drained), GB/s (1e9)."""
    most = max(sizes)
    cache = KVCache(spec, 2 * most)
    rng = np.random.default_rng(4)
    for layer in cache.layers:  # KV that is not all zeros (a checksum of zeros is no test)
        layer.copy_(torch.from_numpy(rng.standard_normal(layer.shape, dtype=np.float32)))
    slot_bytes = cache.bytes_per_block
    gib = most * slot_bytes * 1.1 / 1024**3 + 0.001
    out: dict[str, dict[str, float]] = {}
    for kind in ("host", "disk"):
        tier = create_tier(TierSpec(kind, int(gib * 1024**3), directory), cache, "cpu")
        digests = [i.to_bytes(32, "little") for i in range(most)]
        for i, digest in enumerate(digests):
            tier.spill(digest, b"", b"", i, wait=True)
        tier.drain()
        for n in sizes:
            pages = list(range(most, most + n))
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                done = tier.reload(digests[:n], pages)
                seconds.append(time.perf_counter() - start)
                assert done == n, (kind, done, n)
            median = statistics.median(seconds)
            out[f"{kind}_{n}"] = {
                "blocks": n,
                "bytes": n * slot_bytes,
                "ms": median * 1e3,
                "gb_per_s": n * slot_bytes / median / 1e9,
            }
            rate = n * slot_bytes / median / 1e9
            print(f"reload {kind} {n} blocks ({n * slot_bytes / 1e6:.1f} MB): {rate:.2f} GB/s")
        tier.close()
    src = np.ones(most * slot_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - start)
    out["memcpy"] = {"bytes": src.nbytes, "gb_per_s": src.nbytes / statistics.median(copies) / 1e9}
    print(f"memcpy {src.nbytes / 1e6:.1f} MB: {out['memcpy']['gb_per_s']:.2f} GB/s")
    return out


def reload_over_pool_hit(
    loaded: LoadedModel,
    repeats: int,
    directory: str,
    make_engine: Callable[[str, float], LLMEngine],
    first_token: Callable[..., tuple[float, Any]],
) -> dict[str, dict[str, float]]:
    """Part 4, through the engine: a 1,008-token prefix (63 blocks) evicted to the tier and
    hit again, ``repeats`` times with a fresh question each time. The engine's own
    ``KVTier.reload`` call is timed (TTFT on a shared box swings by more than it), and the
    TTFT medians of the pool hit and the tier hit are given beside it."""
    rng = random.Random(5)
    vocab = loaded.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(1008)]
    out: dict[str, dict[str, float]] = {}
    for kind in ("host", "disk"):
        engine = make_engine(kind, 0.1)
        tier = engine.tier
        assert tier is not None
        spent: list[float] = []
        tier.reload = timed(tier.reload, spent)  # type: ignore[method-assign]
        first_token(engine, prefix + [3] * 16)  # computed once
        pool, hit = [], []
        for _ in range(repeats):
            question = [rng.randrange(3, vocab) for _ in range(16)]
            pool.append(first_token(engine, prefix + question)[0])
            engine.evict_all(keep_tier=True)
            question = [rng.randrange(3, vocab) for _ in range(16)]
            seconds, result = first_token(engine, prefix + question)
            assert result.usage.cached_tokens_by_tier.get(kind, 0) >= 1008 - 16, result.usage
            hit.append(seconds)
        engine.close()
        nbytes = 63 * tier.slot_bytes
        out[kind] = {
            "reload_ms": statistics.median(spent) * 1e3,
            "gb_per_s": nbytes / statistics.median(spent) / 1e9,
            "ttft_pool_ms": statistics.median(pool) * 1e3,
            "ttft_tier_ms": statistics.median(hit) * 1e3,
        }
        print(
            f"1,008-token prefix through the engine, {kind}: reload "
            f"{out[kind]['reload_ms']:.1f} ms ({out[kind]['gb_per_s']:.2f} GB/s); TTFT pool hit "
            f"{out[kind]['ttft_pool_ms']:.0f} ms, tier hit {out[kind]['ttft_tier_ms']:.0f} ms"
        )
    return out


def timed(reload: Callable[[list[bytes], list[int]], int], spent: list[float]):
    """``reload``, its wall time of each call appended to ``spent``."""

    def wrapper(digests: list[bytes], pages: list[int]) -> int:
        start = time.perf_counter()
        try:
            return reload(digests, pages)
        finally:
            spent.append(time.perf_counter() - start)

    return wrapper
