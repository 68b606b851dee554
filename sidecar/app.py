"""The Starlette app: OpenAI-compatible routes, the segment extension and cache admin.

``create_app(engine, settings)`` takes any object with the AsyncEngine interface
(docs/internals.md, "Engine"), so tests can inject one. Every check runs before the engine sees
a request: auth, readiness, body size, JSON types, prompt rendering, context length, queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from jinja2.exceptions import TemplateError as JinjaError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prefixcache.engine.request import (
    EngineRequest,
    RequestTiming,
    SamplingParams,
    SegmentSpan,
    Usage,
)
from prefixcache.engine.tokenizer import ChatTemplateError

from . import protocol as p
from .admission import Admission, EngineStream
from .errors import (
    APIError,
    bad_request,
    model_not_found,
    not_ready,
    server_error,
)
from .http_io import decode_json, exception_handlers, read_body
from .http_metrics import HTTPMetrics
from .rendering import PromptRenderer, RenderedPrompt, TemplateError
from .responses import (
    cache_report,
    chat_logprobs,
    completion_logprobs,
    server_timing,
    usage_info,
)
from .streaming import DONE, SSEResponse, run_until_disconnect, sse_event
from .tenancy import KeyStore, Tenant, cache_namespace

log = logging.getLogger("prefixcache.sidecar")
S = TypeVar("S")


@dataclass(slots=True)
class SidecarSettings:
    keys: KeyStore = field(default_factory=KeyStore)
    secret: bytes = field(default_factory=lambda: os.urandom(32))  # namespace HMAC key
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting: int = 1024  # admitted requests without output yet; over it: 429
    retry_after_s: int = 1
    manage_engine: bool = True  # start the engine on app start-up, shut it down at the end
    # Further names the served model answers to (vLLM-style clients send the --model path).
    model_aliases: tuple[str, ...] = ()
    use_generation_config: bool = True  # unset sampling fields take the model's values
    cache_dir: Path | None = None  # where /v1/cache/save and /load keep pinned-prefix files
    load_on_start: tuple[str, ...] = ()  # files in cache_dir loaded once the engine is up


@dataclass(slots=True)
class Collected:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[Any]
    timing: RequestTiming | None


@dataclass(slots=True)
class Job:
    """One admitted generation request and what its responses need."""

    id: str
    kind: str  # "chat" | "completion"
    model: str
    created: int
    spans: list[SegmentSpan]
    stream: EngineStream
    want_logprobs: bool
    include_usage: bool
    fingerprint: str  # system_fingerprint


def create_app(engine: Any, settings: SidecarSettings | None = None) -> Starlette:
    sidecar = Sidecar(engine, settings or SidecarSettings())
    app = Starlette(
        routes=sidecar.routes(),
        middleware=[
            Middleware(HTTPMetrics, paths=sidecar.paths(), registry=sidecar.metrics_registry)
        ],
        exception_handlers=exception_handlers(),
        lifespan=sidecar.lifespan,
    )
    app.state.sidecar = sidecar
    return app


class Sidecar:
    def __init__(self, engine: Any, settings: SidecarSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.keys = settings.keys
        self.admission = Admission(engine, settings.max_waiting, settings.retry_after_s)
        self.metrics_registry = CollectorRegistry()
        self.created = int(time.time())
        self.start_error: str | None = None
        self.loading_cache = False  # /health says 503 until the start-up cache files are in
        self._renderer: PromptRenderer | None = None
        self._fingerprint: str | None = None
        self._namespaces: dict[tuple[str, str | None], str] = {}
        self._sampling_defaults: dict[str, float] | None = None

    def routes(self) -> list[Route]:
        return [  # matched in order: the hot routes first
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/cache/stats", self.cache_stats, methods=["GET"]),
            Route("/v1/cache/warm", self.cache_warm, methods=["POST"]),
            Route("/v1/cache/unpin", self.cache_unpin, methods=["POST"]),
            Route("/v1/cache/evict", self.cache_evict, methods=["POST"]),
            Route("/v1/cache/save", self.cache_save, methods=["POST"]),
            Route("/v1/cache/load", self.cache_load, methods=["POST"]),
        ]

    def paths(self) -> list[str]:
        return [route.path for route in self.routes()]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if not self.settings.manage_engine:
            yield
            return
        # Start in the background: the server answers /health (503) while the model loads.
        starting = asyncio.create_task(self._start_engine())
        try:
            yield
        finally:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await self.engine.shutdown()

    async def _start_engine(self) -> None:
        self.loading_cache = bool(self.settings.load_on_start)
        try:
            await self.engine.start()
            await self._load_on_start()
        except Exception as exc:
            self.start_error = f"{type(exc).__name__}: {exc}"
            log.exception("engine failed to start")
        finally:
            self.loading_cache = False

    async def _load_on_start(self) -> None:
        for name in self.settings.load_on_start:  # a bad file is logged; the server serves
            try:
                result = await self.engine.load_pinned(self._cache_file(name))
            except Exception as exc:  # PrefixStoreError, or worse: the server serves regardless
                message = exc.message if isinstance(exc, APIError) else str(exc)
                log.error("pinned prefixes %r not loaded: %s", name, message)
            else:
                log.info(
                    "pinned prefixes %r: %d prefixes, %d blocks restored, %d already cached, "
                    "%d skipped (no room)",
                    name,
                    result.prefixes,
                    result.restored_blocks,
                    result.reused_blocks,
                    result.skipped_blocks,
                )

    # --- plain routes ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.engine.is_ready and not self.loading_cache:
            return JSONResponse({"status": "ok"})
        if self.start_error is not None:
            return JSONResponse({"status": "failed", "error": self.start_error}, 503)
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        status = "loading cache" if self.loading_cache else "starting"
        return JSONResponse({"status": status}, 503, headers=headers)

    async def metrics(self, request: Request) -> Response:
        body = generate_latest(self.metrics_registry)
        registry = getattr(self.engine, "registry", None)
        if registry is not None:
            body = generate_latest(registry) + body
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        self.keys.authenticate(request.headers.get("authorization"))
        self._require_ready()
        return _json(p.ModelList(data=[self._model_card()]))

    async def model(self, request: Request) -> Response:
        """OpenAI's retrieve: the card of a name this server answers to, else 404."""
        self.keys.authenticate(request.headers.get("authorization"))
        self._require_ready()
        self._check_model(request.path_params["model"] or "?")
        return _json(self._model_card())

    def _model_card(self) -> p.ModelCard:
        name = self.engine.model_name
        return p.ModelCard(name, self.created, root=name, max_model_len=self.engine.max_model_len)

    # --- generation -----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        tenant = self.keys.authenticate(request.headers.get("authorization"))
        self._require_ready()
        req = await self._read(request, p.ChatCompletionRequest)
        _check(p.check_chat, req)
        self._check_model(req.model)
        prompt = self._render(
            lambda r: r.render_chat(
                req.messages,
                req.segments,
                bool(req.add_generation_prompt),
                req.template_kwargs,
                bool(req.continue_final_message),
            )
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        job = self._submit(
            "chat", f"chatcmpl-{uuid.uuid4().hex}", req, tenant, prompt, max_tokens, top
        )
        return await self._respond(job, req.stream, request)

    async def completions(self, request: Request) -> Response | SSEResponse:
        tenant = self.keys.authenticate(request.headers.get("authorization"))
        self._require_ready()
        req = await self._read(request, p.CompletionRequest)
        _check(p.check_completion, req)
        self._check_model(req.model)
        prompt = RenderedPrompt(self._completion_tokens(p.completion_prompt(req)), [])
        job = self._submit(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            req,
            tenant,
            prompt,
            req.max_tokens,
            req.logprobs,
        )
        return await self._respond(job, req.stream, request)

    def _submit(
        self,
        kind: str,
        request_id: str,
        req: p.SamplingFields,
        tenant: Tenant,
        prompt: RenderedPrompt,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> Job:
        num_prompt = len(prompt.token_ids)
        context = self.engine.max_model_len
        if num_prompt >= context:
            raise bad_request(
                f"The prompt is {num_prompt} tokens; the model's context length is {context} "
                "tokens and at least one must be left to generate",
                "messages" if kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = context - num_prompt
        elif num_prompt + max_tokens > context:
            raise bad_request(
                f"max_tokens={max_tokens} plus the prompt's {num_prompt} tokens exceeds the "
                f"model's context length of {context} tokens (at most {context - num_prompt})",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=self._sampling(req.temperature, "temperature"),
                top_k=int(self._sampling(req.top_k, "top_k")),
                top_p=self._sampling(req.top_p, "top_p"),
                seed=req.seed,
                stop=req.stop_list,
                stop_token_ids=self._stop_token_ids(req.stop_token_ids),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=self._sampling(req.repetition_penalty, "repetition_penalty"),
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        engine_request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            namespace=self._namespace(tenant.name, req.cache_salt),
            priority=req.priority,
            segments=prompt.spans or None,
        )
        return Job(
            id=request_id,
            kind=kind,
            model=self.engine.model_name,
            created=int(time.time()),
            spans=prompt.spans,
            stream=self.admission.admit(engine_request),  # 429 here when the queue is full
            want_logprobs=logprobs is not None,
            include_usage=req.include_usage,
            fingerprint=self.system_fingerprint,
        )

    async def _respond(self, job: Job, stream: bool, request: Request) -> Response | SSEResponse:
        if stream:
            return SSEResponse(self._events(job), on_close=job.stream.aclose)
        try:
            result = await run_until_disconnect(self._collect(job), request.receive)
        finally:
            await job.stream.aclose()  # aborts the engine request if it is still running
        usage = usage_info(result.usage)
        report = cache_report(result.usage, job.spans)
        head = (job.id, job.created, job.model)
        if job.kind == "chat":
            logprobs = self._chat_logprobs(result.logprobs) if job.want_logprobs else None
            message = p.ChatMessage("assistant", result.text)
            choice = p.ChatChoice(0, message, result.finish_reason, logprobs)
            body: Any = p.ChatCompletion(*head, [choice], usage, report, job.fingerprint)
        else:
            decode = self._decode_token
            logprobs = completion_logprobs(result.logprobs, decode) if job.want_logprobs else None
            choice = p.CompletionChoice(0, result.text, result.finish_reason, logprobs)
            body = p.Completion(*head, [choice], usage, report, job.fingerprint)
        response = _json(body)
        if result.timing is not None:
            response.headers["server-timing"] = server_timing(result.timing)
        return response

    async def _collect(self, job: Job) -> Collected:
        parts: list[str] = []
        logprobs: list[Any] = []
        num_tokens = 0
        async for out in job.stream:
            _raise_engine_error(out.error, out.finish_reason)
            parts.append(out.text_delta)
            num_tokens += len(out.new_token_ids)
            logprobs.extend(out.logprobs or ())
            if out.finished:
                usage = out.usage or self._fallback_usage(job, num_tokens)
                reason = out.finish_reason or "stop"
                return Collected("".join(parts), reason, usage, logprobs, out.timing)
        raise server_error("the engine ended the request without a final output")

    async def _events(self, job: Job) -> AsyncIterator[bytes]:
        """SSE frames of one request. Errors after the first frame go in-band, then [DONE]."""
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        no_usage = None if job.include_usage else msgspec.UNSET  # OpenAI: null until the last

        def frame(choices: list, **extra: Any) -> bytes:
            extra.setdefault("usage", no_usage)
            chunk = p.StreamChunk(
                job.id, obj, job.created, job.model, job.fingerprint, choices, **extra
            )
            return sse_event(chunk)

        if job.kind == "chat":
            yield frame([p.ChatChunkChoice(0, p.ChatDelta(role="assistant", content=""))])
        num_tokens = 0
        offset = 0
        try:
            async for out in job.stream:
                _raise_engine_error(out.error, out.finish_reason)
                num_tokens += len(out.new_token_ids)
                logprobs = None
                if job.want_logprobs and out.logprobs:
                    if job.kind == "chat":
                        logprobs = self._chat_logprobs(out.logprobs)
                    else:
                        logprobs = completion_logprobs(out.logprobs, self._decode_token, offset)
                offset += len(out.text_delta)
                if out.text_delta or logprobs is not None:
                    yield frame([self._delta_choice(job, out.text_delta, None, logprobs)])
                if out.finished:
                    usage = out.usage or self._fallback_usage(job, num_tokens)
                    final = self._delta_choice(job, None, out.finish_reason or "stop", None)
                    yield frame([final], prefixcache=cache_report(usage, job.spans))
                    if job.include_usage:
                        yield frame([], usage=usage_info(usage))
                    break
        except APIError as exc:
            yield sse_event(exc.body())
        except Exception as exc:
            log.exception("stream %s failed", job.id)
            yield sse_event(server_error(f"generation failed: {type(exc).__name__}").body())
        yield DONE

    @staticmethod
    def _delta_choice(job: Job, text: str | None, finish: str | None, logprobs: Any) -> Any:
        if job.kind == "chat":
            return p.ChatChunkChoice(0, p.ChatDelta(content=text), finish, logprobs)
        return p.CompletionChoice(0, text or "", finish, logprobs)

    @staticmethod
    def _fallback_usage(job: Job, num_tokens: int) -> Usage:
        num_prompt = len(job.stream.request.prompt_token_ids)
        return Usage(num_prompt, 0, num_prompt, num_tokens)

    # --- cache admin ----------------------------------------------------------------------

    async def cache_stats(self, request: Request) -> Response:
        self.keys.authenticate_admin(request.headers.get("authorization"))
        self._require_ready()
        stats = dict(self.engine.cache_stats())
        pieces = getattr(self.engine.tokenizer, "piece_cache", None)
        if pieces is not None:  # the tokenizer's memo of text between special tokens
            stats["tokenizer_pieces"] = dataclasses.asdict(pieces.stats)
        return _json(stats)

    async def cache_warm(self, request: Request) -> Response:
        token_ids, namespace, req = await self._cache_target(request)
        with _engine_refusals():
            result = await self.engine.warm(token_ids, namespace, bool(req.pin))
        return _json(p.WarmResponse(result.tokens, result.cached_tokens, result.pinned_blocks))

    async def cache_unpin(self, request: Request) -> Response:
        token_ids, namespace, _ = await self._cache_target(request)
        with _engine_refusals():
            unpinned = await self.engine.unpin(token_ids, namespace)
        return _json(p.UnpinResponse(unpinned))

    async def cache_evict(self, request: Request) -> Response:
        self.keys.authenticate_admin(request.headers.get("authorization"))
        self._require_ready()
        body = await read_body(request, self.settings.max_body_bytes)
        req = decode_json(body, p.EvictRequest) if body.strip() else p.EvictRequest()
        with _engine_refusals():
            if req.include_pinned:
                evicted = await self.engine.evict_all(include_pinned=True)
            else:
                evicted = await self.engine.evict_all()
        return _json(p.EvictResponse(evicted))

    async def cache_save(self, request: Request) -> Response:
        """Write every pinned prefix and its KV to a file in --cache-dir."""
        req = await self._cache_file_request(request)
        result = await self.engine.save_pinned(self._cache_file(req.name))
        return _json(p.CacheSaveResponse(req.name, result.prefixes, result.blocks, result.bytes))

    async def cache_load(self, request: Request) -> Response:
        """Cache and pin the prefixes of a file /v1/cache/save wrote with this model."""
        req = await self._cache_file_request(request)
        try:
            r = await self.engine.load_pinned(self._cache_file(req.name))
        except ValueError as exc:  # PrefixStoreError: missing, damaged, another model's
            raise bad_request(str(exc), "name", "cache_file_refused") from None
        return _json(
            p.CacheLoadResponse(
                req.name,
                r.prefixes,
                r.blocks,
                r.restored_blocks,
                r.reused_blocks,
                r.skipped_blocks,
                r.pinned_prefixes,
            )
        )

    async def _cache_file_request(self, request: Request) -> p.CacheFileRequest:
        self.keys.authenticate_admin(request.headers.get("authorization"))
        self._require_ready()
        body = await read_body(request, self.settings.max_body_bytes)
        return decode_json(body, p.CacheFileRequest) if body.strip() else p.CacheFileRequest()

    def _cache_file(self, name: str) -> Path:
        if self.settings.cache_dir is None:
            raise bad_request(
                "saving and loading pinned prefixes is off: start the server with --cache-dir",
                code="cache_dir_not_configured",
            )
        return self.settings.cache_dir / f"{name}.safetensors"

    async def _cache_target(self, request: Request) -> tuple[list[int], str, p.CacheRequest]:
        """Token ids and namespace of a warm/unpin body: the stable part, as chat renders it."""
        tenant = self.keys.authenticate_admin(request.headers.get("authorization"))
        self._require_ready()
        req = await self._read(request, p.CacheRequest)
        _check(p.check_prompt_source, req.messages, req.segments)
        _check(p.check_template_kwargs, req.chat_template_kwargs)
        self._check_model(req.model)
        prompt = self._render(
            lambda r: r.render_stable(req.messages, req.segments, req.template_kwargs)
        )
        if not prompt.token_ids:
            raise bad_request("nothing to cache: every segment is dynamic", "segments")
        if len(prompt.token_ids) >= self.engine.max_model_len:
            raise bad_request(
                f"the prefix is {len(prompt.token_ids)} tokens; a cached prefix must be shorter "
                f"than the model's context length of {self.engine.max_model_len}",
                "messages" if req.messages is not None else "segments",
                code="context_length_exceeded",
            )
        namespace = cache_namespace(self.settings.secret, tenant.name, req.cache_salt)
        return prompt.token_ids, namespace, req

    # --- request helpers ------------------------------------------------------------------

    def _require_ready(self) -> None:
        if not self.engine.is_ready:
            raise not_ready(self.settings.retry_after_s)

    def _check_model(self, model: str | None) -> None:
        if model and model != self.engine.model_name and model not in self.settings.model_aliases:
            raise model_not_found(self.engine.model_name)

    async def _read(self, request: Request, type_: type[S]) -> S:
        return decode_json(await read_body(request, self.settings.max_body_bytes), type_)

    @property
    def renderer(self) -> PromptRenderer:
        if self._renderer is None:
            self._renderer = PromptRenderer(self.engine.tokenizer)
        return self._renderer

    @property
    def system_fingerprint(self) -> str:
        """``fp_`` + 10 hex digits of the model, tokenizer and dtype identity (stable)."""
        if self._fingerprint is None:
            self._fingerprint = _system_fingerprint(self.engine)
        return self._fingerprint

    def _render(self, render: Callable[[PromptRenderer], RenderedPrompt]) -> RenderedPrompt:
        try:
            return render(self.renderer)
        except TemplateError as exc:
            raise bad_request(str(exc), "segments", "template_not_incremental") from None
        except (ChatTemplateError, JinjaError) as exc:
            message = f"The chat template rejected the conversation: {exc}"
            raise bad_request(message, "messages", "chat_template_error") from None

    def _namespace(self, tenant: str, salt: str | None) -> str:
        """The HMAC-derived cache namespace, remembered (a few per tenant in practice)."""
        key = (tenant, salt)
        namespace = self._namespaces.get(key)
        if namespace is None:
            if len(self._namespaces) >= 65536:
                self._namespaces.clear()
            namespace = self._namespaces[key] = cache_namespace(self.settings.secret, tenant, salt)
        return namespace

    def _sampling(self, value: float | None, name: str) -> float:
        """A request's value, else the model's generation_config.json one, else OpenAI's."""
        if value is not None:
            return value
        if self._sampling_defaults is None:  # the engine is ready by now: resolve once
            model = getattr(self.engine, "sampling_defaults", {})
            use_model = self.settings.use_generation_config
            self._sampling_defaults = {**p.SAMPLING_FALLBACKS, **(model if use_model else {})}
        return self._sampling_defaults[name]

    def _stop_token_ids(self, ids: list[int] | None) -> list[int]:
        vocab = getattr(self.engine.tokenizer, "vocab_size", None)
        if ids and vocab is not None and max(ids) >= vocab:
            raise bad_request(
                f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids"
            )
        return list(ids or ())

    def _completion_tokens(self, prompt: str | list[int]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):  # as AutoTokenizer(prompt): the tokenizer's special tokens
            return tokenizer.encode(prompt, add_special_tokens=True)
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and max(prompt) >= vocab:
            raise bad_request(f"token ids must be below the vocabulary size {vocab}", "prompt")
        return prompt

    def _decode_token(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        raw = getattr(self.engine.tokenizer, "token_bytes", None)
        if raw is None:  # a tokenizer without raw bytes: the decoded text's
            return self._decode_token([token_id]).encode()
        return raw(token_id)

    def _chat_logprobs(self, entries: list[Any]) -> dict:
        return chat_logprobs(entries, self._decode_token, self._token_bytes)


def _check(check: Callable[..., None], *args: Any) -> None:
    try:
        check(*args)
    except p.Error as exc:
        raise bad_request(str(exc), exc.param) from None


@contextlib.contextmanager
def _engine_refusals() -> Iterator[None]:
    """The engine's own input checks raise ValueError: the request's fault, so 400."""
    try:
        yield
    except ValueError as exc:
        raise bad_request(f"the engine refused the request: {exc}") from None


def _system_fingerprint(engine: Any) -> str:
    try:
        identity = engine.engine.cache_identity(engine.engine.loaded)
    except Exception:  # not an AsyncEngine (tests inject others): name + tokenizer
        tokenizer = getattr(engine.tokenizer, "fingerprint", type(engine.tokenizer).__name__)
        identity = f"{engine.model_name}|{tokenizer}".encode()
    return "fp_" + hashlib.sha256(identity).hexdigest()[:10]


def _raise_engine_error(error: str | None, finish_reason: str | None) -> None:
    if finish_reason == "abort":  # e.g. the engine is shutting down
        message = f"the request was aborted: {error or 'by the engine'}"
        raise APIError(503, message, type="server_error", code="aborted")
    if error is not None or finish_reason == "error":
        raise server_error(f"generation failed: {error or 'engine error'}")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")
