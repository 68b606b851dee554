"""AsyncClient: send prompts to a prefixcache sidecar, an OpenAI-compatible server or the
Anthropic API, each in its own rendering, and read usage back in one shape.

Runs on asyncio and trio (httpx + anyio). One core does every request: build the body, send,
retry while no byte of a stream has been handed out, map errors to typed exceptions. Every
finished request is also recorded per prompt family for ``cache_report()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar, Unpack, get_args

import anyio
import httpx
import msgspec

from . import anthropic_wire, errors
from .prompt import Prompt
from .retries import RETRY_STATUS, retry_wait
from .session_report import Prices, SessionLedger, SessionReport
from .stream import CompletionStream
from .timeouts import Timeouts, deadline_in, http_timeout, remaining
from .types import (
    CacheReport,
    CacheStats,
    ChatCompletion,
    Completion,
    LoadResult,
    ResetPrefixCacheResult,
    SaveResult,
    Usage,
    WarmResult,
    to_completion,
)

Backend = Literal["sidecar", "openai", "anthropic"]
Wire = Literal["chat", "messages"]  # what a sidecar is spoken to in: Chat Completions or Messages
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
_BACKEND_DEFAULTS: dict[str, tuple[str, str, str]] = {  # base URL env, base URL, key env
    "sidecar": ("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL, "PREFIXCACHE_API_KEY"),
    "openai": ("OPENAI_BASE_URL", "https://api.openai.com/v1", "OPENAI_API_KEY"),
    "anthropic": ("ANTHROPIC_BASE_URL", "https://api.anthropic.com/v1", "ANTHROPIC_API_KEY"),
}
PromptLike = Prompt | Sequence[Mapping[str, Any]]


class PromptFields(TypedDict, total=False):
    """Chat's prompt fields a warm or unpin renders the prefix with: pass those the requests
    that will reuse it send (keyword arguments of ``warm`` / ``unpin``)."""

    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    documents: Sequence[Mapping[str, str]] | None
    add_special_tokens: bool | None
    continue_final_message: bool | None
    chat_template_kwargs: Mapping[str, Any] | None


class AsyncClient:
    """``backend`` says what the server speaks and so how a ``Prompt`` is rendered:

    - ``"sidecar"`` (default): a prefixcache sidecar; a ``Prompt`` goes as ``segments``.
      ``base_url`` defaults to $PREFIXCACHE_BASE_URL, then http://127.0.0.1:8000/v1;
      ``api_key`` to $PREFIXCACHE_API_KEY. ``send_segments=False`` sends the OpenAI rendering
      instead (as ``backend="openai"`` does). ``wire="messages"`` speaks the sidecar's
      ``/v1/messages`` instead: the same Anthropic rendering (breakpoints and all) and usage
      as ``backend="anthropic"``, plus the sidecar's cache report, so one prompt has one
      rendering locally and hosted.
    - ``"openai"``: OpenAI or an OpenAI-compatible server (vLLM, SGLang, llama.cpp):
      ``messages`` + ``tools`` + ``prompt_cache_key`` (unless ``prompt_cache_key=False``).
      Defaults: $OPENAI_BASE_URL, then https://api.openai.com/v1; $OPENAI_API_KEY.
    - ``"anthropic"``: the Messages API with ``cache_control`` breakpoints, ``x-api-key`` and
      ``anthropic-version`` headers. Defaults: $ANTHROPIC_BASE_URL, then
      https://api.anthropic.com/v1; $ANTHROPIC_API_KEY.

    Plain message lists are accepted everywhere. ``family_through`` sets how much of the
    stable part names a prompt family in ``cache_report()``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        model: str | None = None,
        timeouts: Timeouts | None = None,
        max_retries: int = 2,
        retry_backoff: float = 0.5,
        send_segments: bool = True,
        prompt_cache_key: bool = True,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        backend: Backend = "sidecar",
        family_through: str = "static",
        wire: Wire = "chat",
    ) -> None:
        if backend not in get_args(Backend):
            raise ValueError(f"backend must be one of {get_args(Backend)}, got {backend!r}")
        if wire not in get_args(Wire) or (wire == "messages" and backend != "sidecar"):
            raise ValueError(f"wire={wire!r} needs backend='sidecar' (and is 'chat' or 'messages')")
        # Anthropic's Messages wire: the Anthropic API, or a sidecar's /v1/messages
        self.speaks_messages = backend == "anthropic" or wire == "messages"
        url_env, default_url, key_env = _BACKEND_DEFAULTS[backend]
        self.backend: Backend = backend
        self.base_url = base_url or os.environ.get(url_env) or default_url
        self.model = model
        self.timeouts = timeouts or Timeouts()
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.send_segments = send_segments
        self.prompt_cache_key = prompt_cache_key
        self._ledger = SessionLedger(family_through)
        api_key = api_key or os.environ.get(key_env)
        all_headers = {"User-Agent": "prefixcache-sdk/0.1"}
        if self.speaks_messages:
            all_headers["anthropic-version"] = anthropic_wire.ANTHROPIC_VERSION
        if backend == "anthropic":
            if api_key:
                all_headers["x-api-key"] = api_key
        elif api_key:
            all_headers["Authorization"] = f"Bearer {api_key}"
        all_headers.update(headers or {})
        self._http = httpx.AsyncClient(
            base_url=self.base_url.rstrip("/") + "/",
            headers=all_headers,
            timeout=http_timeout(self.timeouts),
            transport=transport,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- generation --------------------------------------------------------------------

    async def complete(self, prompt: PromptLike, **params: Any) -> Completion:
        """Generate a whole answer. ``params``: model, max_tokens, temperature, top_p, stop,
        seed, cache_salt, ... (None values are dropped), and ``timeouts``. Anthropic needs
        ``max_tokens``; ``stop`` becomes its ``stop_sequences``. ``ttl`` ("5m", "1h") goes into
        the cache breakpoints: Anthropic's ``cache_control``, and the same marks on the
        sidecar's segments (retention hints); OpenAI has no such field, so it is dropped."""
        timeouts = params.pop("timeouts", None) or self.timeouts
        body = self._chat_body(prompt, stream=False, params=params)
        deadline = deadline_in(timeouts.total)
        response = await self._send(
            "POST", self._chat_path, body, deadline, stream=False, timeouts=timeouts
        )
        if self.speaks_messages:
            out = anthropic_wire.to_completion(_decode(response, anthropic_wire.AnthropicMessage))
        else:
            out = to_completion(_decode(response, ChatCompletion))
        self._record(prompt, out.usage, out.cache, out.model or body.get("model"))
        return out

    def stream(self, prompt: PromptLike, **params: Any) -> CompletionStream:
        """Stream an answer: ``async for delta in client.stream(p)``, or ``async with`` to
        close it early. Same ``params`` as ``complete``."""
        timeouts = params.pop("timeouts", None) or self.timeouts
        if not self.speaks_messages:  # the Messages API always streams usage
            params.setdefault("stream_options", {"include_usage": True})
        body = self._chat_body(prompt, stream=True, params=params)
        return CompletionStream(
            self._send,
            self._chat_path,
            body,
            timeouts,
            anthropic=self.speaks_messages,
            on_finished=lambda usage, cache, model: self._record(prompt, usage, cache, model),
        )

    def cache_report(self, prices: Prices | None = None) -> SessionReport:
        """What this client's finished requests got from the cache, per prompt family.

        ``prices``: a ``Price`` (per million tokens) or a mapping from model name to ``Price``
        (key "*" for any other model), for the estimated savings. ``print(report)`` shows a
        short table."""
        return self._ledger.report(prices)

    # --- cache admin -------------------------------------------------------------------

    async def warm(
        self,
        prompt: PromptLike,
        pin: bool = False,
        cache_salt: str | None = None,
        ttl_s: float | None = None,
        **fields: Unpack[PromptFields],
    ) -> WarmResult:
        """Compute and cache the prompt's stable part (dynamic segments are left out), as the
        server's chat renders it with the same ``tools``, ``tool_choice``, ``documents``,
        ``add_special_tokens``, ``continue_final_message`` and ``chat_template_kwargs``: pass
        those the requests that will reuse it send. With ``pin`` keep it cached, for
        ``ttl_s`` seconds (renewed by hits) or until unpinned."""
        self._require_sidecar("warm")
        body = self._cache_body(
            prompt, pin=pin, cache_salt=cache_salt, ttl_s=ttl_s, **_prompt_fields(fields)
        )
        response = await self._admin("POST", "cache/warm", body)
        return _decode(response, WarmResult)

    async def unpin(
        self,
        prompt: PromptLike,
        cache_salt: str | None = None,
        **fields: Unpack[PromptFields],
    ) -> int:
        """Unpin what ``warm`` pinned for the same prompt and fields."""
        self._require_sidecar("unpin")
        body = self._cache_body(prompt, cache_salt=cache_salt, **_prompt_fields(fields))
        response = await self._admin("POST", "cache/unpin", body)
        return int(_decode(response, dict).get("unpinned_blocks", 0))

    async def evict(self, include_pinned: bool = False) -> int:
        """Evict every idle cached block (pinned ones too with ``include_pinned``)."""
        self._require_sidecar("evict")
        body = {"include_pinned": True} if include_pinned else {}
        response = await self._admin("POST", "cache/evict", body)
        return int(_decode(response, dict).get("evicted_blocks", 0))

    async def reset_prefix_cache(
        self, reset_external: bool | None = None
    ) -> ResetPrefixCacheResult:
        """vLLM's ``POST /reset_prefix_cache`` at the server's root (beside ``/v1``): drop
        every idle cached prefix (pins kept on a sidecar), e.g. between benchmark runs.
        ``reset_external=False`` keeps the lower KV tier, as vLLM keeps its connector's
        (left out: the server's default). Also for vLLM (``backend="openai"``), which serves
        it in dev mode only. Check ``success``: false while running requests held blocks."""
        if self.backend == "anthropic":
            raise errors.UnsupportedError(
                "reset_prefix_cache() is a vLLM and prefixcache operation; this client's "
                "backend is 'anthropic'"
            )
        root = self.base_url.rstrip("/").removesuffix("/v1")
        url = f"{root}/reset_prefix_cache"
        if reset_external is not None:
            url += f"?reset_external={str(reset_external).lower()}"
        response = await self._admin("POST", url, None)
        if not response.content.strip():  # an older vLLM answers 200 with no body
            return ResetPrefixCacheResult(success=True)
        return _decode(response, ResetPrefixCacheResult)

    async def cache_stats(self) -> CacheStats:
        self._require_sidecar("cache_stats")
        response = await self._admin("GET", "cache/stats", None)
        return _decode(response, CacheStats)

    async def cache_save(self, name: str = "pinned", allow_empty: bool = False) -> SaveResult:
        """Write the server's pinned prefixes with their KV to ``name`` in its --cache-dir
        (with nothing pinned, an existing file is kept: a 409, unless ``allow_empty``)."""
        self._require_sidecar("cache_save")
        body: dict[str, Any] = {"name": name}
        if allow_empty:
            body["allow_empty"] = True
        response = await self._admin("POST", "cache/save", body)
        return _decode(response, SaveResult)

    async def cache_load(self, name: str = "pinned") -> LoadResult:
        """Cache and pin the prefixes a ``cache_save`` wrote (same model on the server)."""
        self._require_sidecar("cache_load")
        response = await self._admin("POST", "cache/load", {"name": name})
        return _decode(response, LoadResult)

    async def models(self) -> list[str]:
        response = await self._admin("GET", "models", None)
        data = _decode(response, dict).get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and "id" in m]

    # --- the core ----------------------------------------------------------------------

    @property
    def _chat_path(self) -> str:
        return "messages" if self.speaks_messages else "chat/completions"

    def _require_sidecar(self, operation: str) -> None:
        if self.backend != "sidecar":
            raise errors.UnsupportedError(
                f"{operation}() is a prefixcache sidecar operation; this client's backend is "
                f"{self.backend!r}"
            )

    def _record(
        self, prompt: PromptLike, usage: Usage | None, cache: CacheReport | None, model: Any
    ) -> None:
        if usage is None or usage.prompt_tokens is None:
            return  # the server did not say: nothing to count
        if not isinstance(prompt, Prompt):
            try:  # plain messages: a family with no static part, turns as session segments
                prompt = Prompt.from_messages(prompt, stability="session")
            except (KeyError, TypeError, ValueError):
                return
        self._ledger.record(prompt, usage, cache, model if isinstance(model, str) else "")

    def _chat_body(
        self, prompt: PromptLike, *, stream: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        if self.speaks_messages:
            return self._anthropic_body(prompt, stream=stream, params=params)
        body: dict[str, Any] = {}
        model = params.pop("model", None) or self.model
        if model is not None:
            body["model"] = model
        ttl = params.pop("ttl", None)  # OpenAI has no per-request TTL: dropped there
        if isinstance(prompt, Prompt):
            if self.backend == "sidecar" and self.send_segments:
                body["segments"] = prompt.to_segments(ttl)
            else:
                through = "shared" if self.prompt_cache_key else None
                body.update(prompt.to_openai(cache_key_through=through))
        else:
            body["messages"] = [dict(m) for m in prompt]
        body.update({k: v for k, v in params.items() if v is not None})
        body["stream"] = stream
        return body

    def _anthropic_body(
        self, prompt: PromptLike, *, stream: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        model = params.pop("model", None) or self.model
        max_tokens = params.pop("max_tokens", None)
        if max_tokens is None:
            raise ValueError("the Anthropic Messages API needs max_tokens")
        ttl = params.pop("ttl", None)
        stop = params.pop("stop", None)
        if stop is not None:
            params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        if not isinstance(prompt, Prompt):
            prompt = Prompt.from_messages(prompt)
        body = prompt.to_anthropic(model=model, max_tokens=max_tokens, ttl=ttl)
        body.update({k: v for k, v in params.items() if v is not None})
        body["stream"] = stream
        return body

    def _cache_body(self, prompt: PromptLike, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.model is not None:
            body["model"] = self.model
        if isinstance(prompt, Prompt):
            body["segments"] = prompt.to_segments()
        else:
            body["messages"] = [dict(m) for m in prompt]
        body.update({k: v for k, v in fields.items() if v is not None})
        return body

    async def _admin(self, method: str, path: str, body: Any) -> httpx.Response:
        deadline = deadline_in(self.timeouts.total)
        return await self._send(method, path, body, deadline, stream=False)

    async def _send(
        self,
        method: str,
        path: str,
        body: Any,
        deadline: float | None,
        *,
        stream: bool,
        deadline_kind: errors.TimeoutKind = "total",
        timeouts: Timeouts | None = None,
    ) -> httpx.Response:
        """A 2xx response (body unread when ``stream``), retrying what is safe to retry.
        ``timeouts`` (default: the client's) gives httpx its connect, write and pool limits.

        Retried: connection failures before anything was sent, and 408/429/502/503/504,
        waiting ``Retry-After`` when the server gives one (up to 60 s), else exponential
        backoff from ``retry_backoff`` seconds with jitter. Never retried: anything after a
        2xx response arrived.
        """
        limits = http_timeout(timeouts or self.timeouts)
        attempt = 0
        while True:
            request = self._http.build_request(method, path, json=body, timeout=limits)
            response: httpx.Response | None = None
            try:
                with anyio.fail_after(remaining(deadline)):
                    response = await self._http.send(request, stream=stream)
            except TimeoutError:
                raise errors.APITimeoutError(
                    f"{deadline_kind} timeout exceeded", kind=deadline_kind
                ) from None
            except httpx.ConnectTimeout:
                error: errors.APIError = errors.APITimeoutError(
                    "timed out connecting to the server", kind="connect"
                )
            except httpx.ConnectError as exc:
                error = errors.APIConnectionError(f"cannot connect to {self.base_url}: {exc}")
            except httpx.TimeoutException as exc:
                kind = _HTTPX_TIMEOUT_KINDS.get(type(exc), "read")  # "read": a transport's own
                raise errors.APITimeoutError(str(exc) or "timed out", kind=kind) from exc
            except httpx.TransportError as exc:
                raise errors.APIConnectionError(f"connection failed: {exc!r}") from exc
            else:
                if response.is_success:
                    return response
                if stream:
                    await response.aread()
                    await response.aclose()
                error = errors.status_error(response)
                if response.status_code not in RETRY_STATUS:
                    raise error
            if attempt >= self.max_retries:
                raise error
            wait = retry_wait(attempt, response, self.retry_backoff)
            if deadline is not None and anyio.current_time() + wait > deadline:
                raise error
            await anyio.sleep(wait)
            attempt += 1


_HTTPX_TIMEOUT_KINDS: dict[type[httpx.TimeoutException], errors.TimeoutKind] = {
    httpx.ReadTimeout: "read",
    httpx.WriteTimeout: "write",
    httpx.PoolTimeout: "pool",
}


T = TypeVar("T")


def _decode(response: httpx.Response, type_: type[T]) -> T:
    try:
        return msgspec.json.decode(response.content, type=type_)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.ResponseFormatError(
            f"unexpected response from {response.request.url}: {exc}",
            status_code=response.status_code,
            response=response,
        ) from exc


def _prompt_fields(fields: PromptFields) -> dict[str, Any]:
    """Chat's prompt fields for a warm / unpin body, mappings as dicts (what JSON encodes);
    None values are left out of the body. A name it does not know is a TypeError, as a
    misspelt keyword argument is (the TypedDict checks it for type checkers only)."""
    unknown = sorted(set(fields) - set(PromptFields.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    tools, documents = fields.get("tools"), fields.get("documents")
    tool_choice, kwargs = fields.get("tool_choice"), fields.get("chat_template_kwargs")
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = dict(tool_choice)
    return {
        "tools": None if tools is None else [dict(t) for t in tools],
        "tool_choice": tool_choice,
        "documents": None if documents is None else [dict(d) for d in documents],
        "add_special_tokens": fields.get("add_special_tokens"),
        "continue_final_message": fields.get("continue_final_message"),
        "chat_template_kwargs": None if kwargs is None else dict(kwargs),
    }
