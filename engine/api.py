"""``EngineAPI``: everything the sidecar may ask of an engine, as a typed Protocol.

``AsyncEngine`` implements it in-process; tests inject a fake; a client of an engine process
can stand behind it later. The sidecar imports this module and the request/response types of
``request.py``, nothing else of the engine. Torch-free: importing it loads no model code.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from prefixcache.sdk.cache_stats import CacheStats

from .request import EngineRequest, RequestOutput, SamplingParams, SegmentMiss


@dataclass(slots=True)
class WarmResult:
    tokens: int
    cached_tokens: int  # of those, already cached before warming
    pinned_blocks: int


class PrefixStoreError(ValueError):
    """A cache file that cannot be loaded here: missing, damaged, or made by another engine."""


@dataclass(slots=True, frozen=True)
class SaveResult:
    """What ``save_pinned`` wrote (the file format: engine/memory/prefix_store.py)."""

    path: str
    prefixes: int
    blocks: int
    bytes: int


@dataclass(slots=True, frozen=True)
class LoadResult:
    path: str
    prefixes: int  # pinned prefixes in the file
    blocks: int  # blocks in the file
    restored_blocks: int
    reused_blocks: int
    skipped_blocks: int
    pinned_prefixes: int


async def compute_prefix(
    generate: Callable[[EngineRequest], AsyncGenerator[RequestOutput, None]],
    request_id: str,
    token_ids: list[int],
    namespace: str,
) -> int:
    """Run ``token_ids`` through ``generate`` as a one-token request so their full blocks get
    cached (what ``warm`` does before pinning); returns how many were cached already."""
    request = EngineRequest(
        request_id,
        list(token_ids),
        SamplingParams(max_tokens=1, ignore_eos=True),
        namespace=namespace,
    )
    final = None
    async for out in generate(request):
        final = out
    assert final is not None
    if final.error:
        raise ValueError(final.error)
    assert final.usage is not None
    return final.usage.cached_tokens


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """One finished request, as the cache saw it (the dashboard's recent activity)."""

    seq: int  # increasing: ask for the records after the last one seen
    finished_at: float  # unix time
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None  # None: ended before its first token
    finish_reason: str
    namespace: str  # an opaque label ("tenant/salt" prefixes of the server-side HMACs)
    miss: SegmentMiss | None  # why the cached prefix stopped (None: a full hit)


@dataclass(slots=True)
class TreeSnapshot:
    """Every cached block of the prefix tree as parallel lists (index i = one block), parents
    before children. ``parent[i]`` is the index of block i's parent, or ``-1 - k`` for a top
    block of ``namespaces[k]``."""

    block_size: int
    taken_at: float  # unix time
    namespaces: list[str]  # opaque labels, one per namespace root in use
    parent: list[int]
    in_use: list[bool]  # held by a running request
    pinned: list[bool]
    hits: list[int]  # requests whose cached prefix ended at this block
    last_used: list[float]  # unix time a request last ended its match or prompt here (0: never)
    tags: list[str]  # the tag of a segment starting in this block ("": none known)
    # unix time the TTL pins holding this block lapse, when only TTL pins hold it (the latest
    # deadline of those on its subtree); 0.0: not pinned, or also held by a pin without TTL
    ttl_expires: list[float]


class TokenizerAPI(Protocol):
    """What the sidecar uses of the served model's tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False, namespace: str = "") -> list[int]:
        """Ids of ``text``; any memo is used under the caller's cache ``namespace`` only."""
        ...

    def forget(self, text: str, namespace: str = "") -> None:
        """Keep nothing of ``text`` in any memo (it was encoded for a refused request)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (part of a UTF-8 character for some tokens), for logprobs."""
        ...

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's string for a token, as ``convert_ids_to_tokens`` gives it."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


class EngineAPI(Protocol):
    # -- lifecycle and readiness: the members below `is_ready` may raise until it is True --

    async def start(self) -> None:
        """Load the model and start serving (returns once requests can be submitted)."""
        ...

    async def shutdown(self) -> None:
        """Stop; requests still running end with finish_reason "abort"."""
        ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def error(self) -> str | None:
        """Why an engine that started cannot serve now (its last step failed as a whole, its
        thread died); None while it works. /health answers 503 with it."""
        ...

    # -- the model card and what the sidecar needs to check and render requests -----------

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int:
        """Context length: prompt plus generated tokens."""
        ...

    @property
    def tokenizer(self) -> TokenizerAPI: ...

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation_config.json sampling values, for unset request fields."""
        ...

    @property
    def dtype(self) -> str:
        """The weights' and KV cache's dtype as torch names it (``bfloat16``, ``float32``)."""
        ...

    @property
    def cache_identity(self) -> bytes:
        """Bytes naming the model weights, tokenizer and dtype (stable across restarts)."""
        ...

    @property
    def output_identity(self) -> bytes:
        """``cache_identity`` and what else changes the outputs (an opt-in LM head kernel):
        the sidecar's ``system_fingerprint``."""
        ...

    @property
    def registry(self) -> CollectorRegistry:
        """The engine's Prometheus series, served on /metrics with the HTTP ones."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet scheduled."""
        ...

    # -- requests ---------------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit and stream: deltas as they come, the last with finished=True and usage.
        Closing the iterator early aborts the request. Invalid requests raise ValueError."""
        ...

    def abort(self, request_id: str) -> None:
        """Free everything the request holds; unknown ids are ignored."""
        ...

    def abort_all(self, message: str) -> int:
        """End every request in flight now, each stream with a last output (finish reason
        "abort", ``message`` its error), and free what they hold; how many there were."""
        ...

    # -- cache admin (ValueError: the engine refused the input) ---------------------------

    async def warm(
        self,
        token_ids: list[int],
        namespace: str = "",
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> WarmResult: ...

    async def unpin(self, token_ids: list[int], namespace: str = "") -> int: ...

    async def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int: ...

    def cache_stats(self) -> CacheStats: ...

    async def cache_tree(self) -> TreeSnapshot:
        """Every cached block, copied on the engine's side (one pass over the tree)."""
        ...

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        """The finished requests with ``seq > after`` still remembered (a bounded ring)."""
        ...

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        """Write the pinned prefixes, signed with ``key`` (HMAC, from the server secret)."""
        ...

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        """Raises ValueError (PrefixStoreError) for a missing, damaged or foreign file, or one
        not signed with ``key``."""
        ...
