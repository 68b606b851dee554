"""The ``/v1/cache/*`` admin routes: stats, warm, unpin, evict, save and load of pinned
prefixes; vLLM's ``/reset_prefix_cache`` (evict's default, in vLLM's shape); and the start-up
load of --load-cache files. Every route needs an admin key."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http.errors import APIError, bad_request
from ..http.io import decode_json, read_body
from ..http.tenancy import cache_file_key
from ..wire import protocol as p
from ..wire import reply_types as rt
from .generation import GenerationRoutes
from .responses import json_response

log = logging.getLogger("prefixcache.sidecar")


class CacheRoutes:
    def __init__(
        self,
        generation: GenerationRoutes,
        cache_dir: Path | None,
        secret: bytes,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.generation = generation  # warm and unpin render as chat renders
        self.engine = generation.engine
        self.gate = generation.gate
        self.cache_dir = cache_dir
        self.file_key = cache_file_key(secret)  # files signed and checked with it (HMAC)
        # A --load-cache that fails at start leaves the server serving (and /health ok): this
        # is what an operator alerts on.
        self.loads = Counter(
            "prefixcache:cache_file_loads",
            "Pinned-prefix files loaded (--load-cache and /v1/cache/load), by result",
            ["result"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        for result in ("loaded", "refused"):
            self.loads.labels(result)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/cache/stats", self.stats, methods=["GET"]),
            Route("/v1/cache/warm", self.warm, methods=["POST"]),
            Route("/v1/cache/unpin", self.unpin, methods=["POST"]),
            Route("/v1/cache/evict", self.evict, methods=["POST"]),
            Route("/v1/cache/save", self.save, methods=["POST"]),
            Route("/v1/cache/load", self.load, methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
        ]

    async def stats(self, request: Request) -> Response:
        self.gate.admin(request)
        return json_response(self.engine.cache_stats())

    async def warm(self, request: Request) -> Response:
        token_ids, namespace, req = await self._target(request)
        with _engine_refusals():
            result = await self.engine.warm(token_ids, namespace, bool(req.pin), req.ttl_s)
        return json_response(
            rt.WarmResponse(
                result.tokens,
                result.cached_tokens,
                result.pinned_blocks,
                req.ttl_s if result.pinned_blocks else None,
            )
        )

    async def unpin(self, request: Request) -> Response:
        token_ids, namespace, _ = await self._target(request)
        with _engine_refusals():
            unpinned = await self.engine.unpin(token_ids, namespace)
        return json_response(rt.UnpinResponse(unpinned))

    async def evict(self, request: Request) -> Response:
        self.gate.admin(request)
        req = await self.gate.read_optional(request, p.EvictRequest)
        with _engine_refusals():
            evicted = await self.engine.evict_all(
                include_pinned=bool(req.include_pinned), keep_tier=req.keep_tier
            )
        return json_response(rt.EvictResponse(evicted))

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's reset, for benchmark scripts: what /v1/cache/evict does with no body (idle
        blocks evicted, the KV tier emptied, pins kept). Running requests keep their blocks
        and run on; ``success`` is false when some held blocks (they stay cached), as vLLM
        answers while blocks are held."""
        self.gate.admin(request)
        try:
            query = p.reset_query(request.query_params.multi_items())
        except p.Error as exc:
            raise bad_request(str(exc), exc.param) from None
        if query["reset_running_requests"]:
            raise bad_request(
                "reset_running_requests=true is not supported: this server does not preempt "
                "running requests to drop their blocks; reset without it (running requests "
                'keep their blocks and finish, and "success" says whether any held some)',
                "reset_running_requests",
            )
        body = await read_body(request, self.gate.settings.max_body_bytes)
        if body.strip() and decode_json(body, dict):  # vLLM reads no body; {} is harmless
            raise bad_request(
                "/reset_prefix_cache takes no body: its options are query parameters "
                "(reset_external); /v1/cache/evict takes evict's options"
            )
        # reset_external=false keeps the tier as vLLM keeps its connector's: the pool's blocks
        # spill into it; by default (and with true) it is emptied, as evict empties it
        keep_tier = query["reset_external"] is False
        with _engine_refusals():
            evicted = await self.engine.evict_all(keep_tier=keep_tier)
        blocks = self.engine.cache_stats().blocks  # as of the eviction (its reply carries it)
        log.info(
            "prefix cache reset: %d blocks evicted, %d pinned kept, %d held by running requests",
            evicted,
            blocks.pinned,
            blocks.in_use,
        )
        return json_response(
            rt.ResetPrefixCacheResponse(blocks.in_use == 0, evicted, blocks.pinned, blocks.in_use)
        )

    async def save(self, request: Request) -> Response:
        """Write every pinned prefix and its KV to a file in --cache-dir."""
        self.gate.admin(request)
        req = await self.gate.read_optional(request, p.CacheSaveRequest)
        path = self.cache_file(req.name)
        if not req.allow_empty and path.exists() and not self.engine.cache_stats().blocks.pinned:
            raise APIError(
                409,
                f"nothing is pinned: saving would replace {req.name!r} with an empty file; "
                'pin prefixes first, or send "allow_empty": true',
                param="name",
                code="nothing_pinned",
            )
        try:
            result = await self.engine.save_pinned(path, self.file_key)
        except OSError as exc:  # a read-only or full --cache-dir: the operator's to fix
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            log.error("cache file %r not saved: %s", req.name, exc.strerror or exc)
            raise APIError(
                507 if full else 500,
                f"cannot write {req.name!r} in --cache-dir: {exc.strerror or exc}",
                type="server_error",
                code="cache_file_unwritable",
            ) from None
        return json_response(
            rt.CacheSaveResponse(req.name, result.prefixes, result.blocks, result.bytes)
        )

    async def load(self, request: Request) -> Response:
        """Cache and pin the prefixes of a file /v1/cache/save wrote with this model."""
        self.gate.admin(request)
        req = await self.gate.read_optional(request, p.CacheFileRequest)
        try:
            r = await self.engine.load_pinned(self.cache_file(req.name), self.file_key)
        except ValueError as exc:  # PrefixStoreError: missing, damaged, another model's
            self.loads.labels("refused").inc()
            raise bad_request(str(exc), "name", "cache_file_refused") from None
        self.loads.labels("loaded").inc()
        return json_response(
            rt.CacheLoadResponse(
                req.name,
                r.prefixes,
                r.blocks,
                r.restored_blocks,
                r.reused_blocks,
                r.skipped_blocks,
                r.pinned_prefixes,
            )
        )

    async def load_files(self, names: tuple[str, ...]) -> None:
        """Load each file at start-up; a bad one is logged and the server serves regardless."""
        for name in names:
            try:
                result = await self.engine.load_pinned(self.cache_file(name), self.file_key)
            except Exception as exc:  # PrefixStoreError, or worse
                message = exc.message if isinstance(exc, APIError) else str(exc)
                log.error("pinned prefixes %r not loaded: %s", name, message)
                self.loads.labels("refused").inc()
            else:
                self.loads.labels("loaded").inc()
                log.info(
                    "pinned prefixes %r: %d prefixes, %d blocks restored, %d already cached, "
                    "%d skipped (no room)",
                    name,
                    result.prefixes,
                    result.restored_blocks,
                    result.reused_blocks,
                    result.skipped_blocks,
                )

    def cache_file(self, name: str) -> Path:
        if self.cache_dir is None:
            raise bad_request(
                "saving and loading pinned prefixes is off: start the server with --cache-dir",
                code="cache_dir_not_configured",
            )
        return self.cache_dir / f"{name}.safetensors"

    async def _target(self, request: Request) -> tuple[list[int], str, p.CacheRequest]:
        """Token ids and namespace of a warm/unpin body: the stable part, as chat renders it
        (the chat route's own rendering: tools, documents, add_special_tokens and all)."""
        gate = self.gate
        tenant = gate.admin(request)
        req = await gate.read(request, p.CacheRequest)
        chat = gate.check(p.stable_chat, req)
        gate.check_model(req.model)
        namespace = gate.namespace(tenant.name, req.cache_salt)
        prompt = await self.generation.render_chat(chat, namespace)
        if not prompt.token_ids:  # a template that renders none of the stable part
            raise bad_request(
                "nothing to cache: the stable part renders to no tokens",
                "messages" if req.messages is not None else "segments",
            )
        context = self.engine.max_model_len
        if len(prompt.token_ids) >= context:
            gate.forget(prompt)
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, the prefix "
                f"resulted in {len(prompt.token_ids)} tokens; a cached prefix must be shorter.",
                "messages" if req.messages is not None else "segments",
                code="context_length_exceeded",
            )
        return prompt.token_ids, namespace, req


@contextlib.contextmanager
def _engine_refusals() -> Iterator[None]:
    """The engine's own input checks raise ValueError: the request's fault, so 400."""
    try:
        yield
    except ValueError as exc:
        raise bad_request(f"the engine refused the request: {exc}") from None
