"""A tiny in-process stand-in for AsyncEngine, for the sidecar's fast validation tests.

Byte-level tokenizer, a simple chat template, a block-granular prefix cache per namespace and
a deterministic "model" that echoes the prompt's bytes back. It implements ``EngineAPI``
(engine/api.py) so the app cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from prefixcache.engine.api import RequestRecord, TreeSnapshot, WarmResult
from prefixcache.engine.request import EngineRequest, RequestOutput, SegmentUsage, Usage
from prefixcache.sdk.cache_stats import BlockStats, CacheStats, TokenStats

BOS, EOS, OFFSET = 1, 2, 3


class FakeTokenizer:
    bos_token_id = BOS
    eos_token_ids = (EOS,)
    vocab_size = 256 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = False, namespace: str = "") -> list[int]:
        ids = [b + OFFSET for b in text.encode()]
        return [BOS, *ids] if add_special_tokens else ids

    def forget(self, text: str, namespace: str = "") -> None:
        pass  # no memo

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def token_piece(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: object
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass(slots=True, frozen=True)
class SaveResult:  # the fields of engine.prefix_store.SaveResult, without importing torch
    path: str
    prefixes: int
    blocks: int
    bytes: int


@dataclass(slots=True, frozen=True)
class LoadResult:  # as engine.prefix_store.LoadResult
    path: str
    prefixes: int
    blocks: int
    restored_blocks: int
    reused_blocks: int
    skipped_blocks: int
    pinned_prefixes: int


class FakeEngine:
    def __init__(self, block_size: int = 4, max_model_len: int = 512, delay: float = 0.0):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model_name = "fake"
        self.tokenizer = FakeTokenizer()
        self.cache_identity = b"fake|FakeTokenizer"
        self.output_identity = self.cache_identity
        self.dtype = "float32"
        self.sampling_defaults: dict[str, float] = {}
        self.registry = CollectorRegistry()
        self.steps = Counter("fake_engine_steps", "steps", registry=self.registry)
        self.delay = delay  # seconds per generated token
        self.is_ready = False
        self.error: str | None = None
        self.num_waiting = 0
        self.num_running = 0
        self.cached: set[bytes] = set()
        self.pinned: set[bytes] = set()
        self.warm_ttls: list[float | None] = []  # ttl_s of each warm, in order
        self.queries = self.hits = 0
        self.received: list[EngineRequest] = []  # everything that reached the engine

    async def start(self) -> None:
        self.is_ready = True

    async def shutdown(self) -> None:
        self.is_ready = False

    def _digests(self, ids: list[int], namespace: str) -> list[bytes]:
        out, parent = [], namespace.encode()
        for i in range(len(ids) // self.block_size):
            block = ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hashlib.sha256(parent + bytes(str(block), "ascii")).digest()
            out.append(parent)
        return out

    def _hit(self, ids: list[int], namespace: str) -> int:
        hit = 0
        for digest in self._digests(ids[:-1], namespace):
            if digest not in self.cached:
                break
            hit += self.block_size
        return hit

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        self.received.append(request)
        ids, sampling = request.prompt_token_ids, request.sampling
        cached = self._hit(ids, request.namespace)
        self.queries += len(ids)
        self.hits += cached
        self.cached.update(self._digests(ids, request.namespace))
        self.num_running += 1
        try:
            produced = 0
            while produced < sampling.max_tokens:
                await asyncio.sleep(self.delay)
                token = ids[produced % len(ids)]
                produced += 1
                last = produced == sampling.max_tokens
                usage = None
                if last:
                    segments = [
                        SegmentUsage(s.tag, s.end - s.start, max(0, min(s.end, cached) - s.start))
                        for s in request.segments or []
                    ]
                    usage = Usage(len(ids), cached, len(ids) - cached, produced, segments or None)
                text = self.tokenizer.decode([token])
                yield RequestOutput(
                    request.request_id,
                    [token],
                    text,
                    finished=last,
                    finish_reason="length" if last else None,
                    usage=usage,
                )
        finally:
            self.num_running -= 1

    def abort(self, request_id: str) -> None:
        pass

    def abort_all(self, message: str) -> int:
        return 0

    async def warm(
        self,
        token_ids: list[int],
        namespace: str = "",
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> WarmResult:
        self.warm_ttls.append(ttl_s)
        cached = self._hit([*token_ids, 0], namespace)
        digests = self._digests(token_ids, namespace)
        self.cached.update(digests)
        if pin:
            self.pinned.update(digests)
        return WarmResult(len(token_ids), cached, len(digests) if pin else 0)

    async def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        digests = set(self._digests(token_ids, namespace)) & self.pinned
        self.pinned -= digests
        return len(digests)

    async def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        if include_pinned:
            self.pinned.clear()
        evicted = len(self.cached - self.pinned)
        self.cached &= self.pinned
        return evicted

    def cache_stats(self) -> CacheStats:
        return CacheStats(
            block_size=self.block_size,
            blocks=BlockStats(
                total=64,
                free=64 - len(self.cached),
                cached_idle=len(self.cached),
                in_use=self.num_running,
                pinned=len(self.pinned),
            ),
            tokens=TokenStats(queries=self.queries, hits=self.hits),
            hit_rate=self.hits / self.queries if self.queries else 0.0,
        )

    async def cache_tree(self) -> TreeSnapshot:
        """Each cached digest as a top block of one namespace (the fake keeps no parents, no
        TTL pins and no KV tier)."""
        n = len(self.cached)
        return TreeSnapshot(
            self.block_size, 0.0, ["fake"], [-1] * n, [False] * n,
            [d in self.pinned for d in self.cached], [0] * n, [0.0] * n, [""] * n, [0.0] * n,
        )  # fmt: skip

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        return []

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        """The pinned block digests as a JSON list (one "prefix" per block)."""
        data = json.dumps(sorted(d.hex() for d in self.pinned)).encode()
        Path(path).write_bytes(data)
        return SaveResult(str(path), len(self.pinned), len(self.pinned), len(data))

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        try:
            digests = {bytes.fromhex(h) for h in json.loads(Path(path).read_bytes())}
        except (OSError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot load {path}: {exc}") from None
        reused = len(digests & self.cached)
        self.cached |= digests
        self.pinned |= digests
        n = len(digests)
        return LoadResult(str(path), n, n, n - reused, reused, 0, n)


class ScriptedEngine(FakeEngine):
    """Replies with ``script`` (three characters an output, finishing "stop"), whatever the
    prompt; ``tokenizer`` replaces the byte tokenizer (one that renders tools, say)."""

    def __init__(self, tokenizer: FakeTokenizer | None = None) -> None:
        super().__init__(max_model_len=8192)
        if tokenizer is not None:
            self.tokenizer = tokenizer
        self.script = ""

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        self.received.append(request)
        pieces = [self.script[i : i + 3] for i in range(0, len(self.script), 3)] or [""]
        n = len(request.prompt_token_ids)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(
                request.request_id,
                [5],
                piece,
                finished=last,
                finish_reason="stop" if last else None,
                usage=Usage(n, 0, n, len(pieces)) if last else None,
            )
