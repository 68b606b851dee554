"""``RequestGate``: every check a request passes before the engine sees it.

Auth, readiness, body size and JSON types, the model name, prompt rendering and token ids;
and the caller's cache namespace, derived once per (tenant, salt) for generation and the
cache admin routes alike.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError as JinjaError
from starlette.requests import Request

from prefixcache.engine.api import EngineAPI
from prefixcache.engine.text.tokenizer import ChatTemplateError

from ..chat.rendering import PromptRenderer, RenderedPrompt, TemplateError
from ..http.errors import bad_request, model_not_found, not_ready
from ..http.io import decode_json, read_body
from ..http.tenancy import Tenant, cache_namespace
from ..wire import protocol as p
from .settings import SidecarSettings

S = TypeVar("S")
R = TypeVar("R", bound=p.SamplingFields)

_NAMESPACE_MEMO_BYTES = 4 * 1024**2  # remembered (tenant, salt) -> namespace, oldest out
_NAMESPACE_ENTRY_OVERHEAD = 300  # the key tuple, the 64-char hex value, the dict slot
# A prompt this large (characters of content) is rendered and tokenized on a worker thread,
# so that the event loop goes on answering other requests meanwhile.
OFF_LOOP_CHARS = 32 * 1024


class RequestGate:
    def __init__(self, engine: EngineAPI, settings: SidecarSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._renderer: PromptRenderer | None = None
        self._namespaces: OrderedDict[tuple[str, str | None], str] = OrderedDict()
        self._namespace_bytes = 0

    # -- who is asking, and can we answer --------------------------------------------------

    def caller(self, request: Request, accept_x_api_key: bool = False) -> Tenant:
        """The authenticated tenant of a serving route; 401, then 503 while loading.
        ``accept_x_api_key``: the key may come as Anthropic's ``x-api-key`` header instead."""
        authorization = request.headers.get("authorization")
        how = "'Authorization: Bearer <key>'"
        if accept_x_api_key:
            how = "'x-api-key: <key>' or " + how
            if authorization is None and "x-api-key" in request.headers:
                authorization = f"Bearer {request.headers['x-api-key']}"
        tenant = self.settings.keys.authenticate(authorization, how)
        self.require_ready()
        return tenant

    def admin(self, request: Request) -> Tenant:
        """As ``caller``, for the cache admin routes: 403 without an admin key."""
        tenant = self.settings.keys.authenticate_admin(request.headers.get("authorization"))
        self.require_ready()
        return tenant

    def require_ready(self) -> None:
        if not self.engine.is_ready:
            raise not_ready(self.settings.retry_after_s)

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            raise model_not_found(self.model_names[0])

    @property
    def model_names(self) -> list[str]:
        """Every name requests may use: the aliases (served names, then the --model value),
        then the model's own; the first is what a reply names when its request named none."""
        return list(dict.fromkeys((*self.settings.model_aliases, self.engine.model_name)))

    def namespace(self, tenant: str, salt: str | None) -> str:
        """The HMAC-derived cache namespace, remembered (bounded in bytes, oldest out)."""
        key = (tenant, salt)
        namespace = self._namespaces.get(key)
        if namespace is not None:
            self._namespaces.move_to_end(key)
            return namespace
        namespace = cache_namespace(self.settings.secret, tenant, salt)
        self._namespaces[key] = namespace
        self._namespace_bytes += _namespace_entry_bytes(key)
        while self._namespace_bytes > _NAMESPACE_MEMO_BYTES:
            old, _ = self._namespaces.popitem(last=False)
            self._namespace_bytes -= _namespace_entry_bytes(old)
        return namespace

    # -- the body ------------------------------------------------------------------------------

    async def read(self, request: Request, type_: type[S]) -> S:
        return decode_json(await read_body(request, self.settings.max_body_bytes), type_)

    async def read_optional(self, request: Request, type_: type[S]) -> S:
        """As ``read``; an empty body is ``type_()`` (every field at its default)."""
        body = await read_body(request, self.settings.max_body_bytes)
        return decode_json(body, type_) if body.strip() else type_()

    async def generation_request(
        self, request: Request, type_: type[R], check: Callable[[R], None]
    ) -> tuple[Tenant, R]:
        """The caller and its generation body, checked across fields and for the model."""
        tenant = self.caller(request)
        req = await self.read(request, type_)
        self.check(check, req)
        self.check_model(req.model)
        return tenant, req

    @staticmethod
    def check(check: Callable[..., S], *args: Any) -> S:
        """Run a protocol.py cross-field check (its result back); its error is a 400 naming
        the field."""
        try:
            return check(*args)
        except p.Error as exc:
            raise bad_request(str(exc), exc.param) from None

    # -- the prompt ----------------------------------------------------------------------------

    @property
    def renderer(self) -> PromptRenderer:
        if self._renderer is None:  # the tokenizer exists once the engine is ready
            self._renderer = PromptRenderer(self.engine.tokenizer)
        return self._renderer

    async def render(
        self, render: Callable[[PromptRenderer], RenderedPrompt], size: int
    ) -> RenderedPrompt:
        """``render(renderer)``; on a worker thread when the content is ``size`` >=
        ``OFF_LOOP_CHARS`` characters. Template failures are 400s."""
        renderer = self.renderer
        try:
            if size >= OFF_LOOP_CHARS:
                return await asyncio.to_thread(render, renderer)
            return render(renderer)
        except RecursionError:
            raise bad_request("the conversation is nested too deeply to render") from None
        except TemplateError as exc:
            raise bad_request(str(exc), "segments", "template_not_incremental") from None
        except (ChatTemplateError, JinjaError) as exc:
            message = f"The chat template rejected the conversation: {exc}"
            raise bad_request(message, "messages", "chat_template_error") from None

    def forget(self, prompt: RenderedPrompt) -> None:
        """Keep nothing in the memos for a prompt whose request was refused."""
        self.renderer.forget(prompt)

    async def completion_prompt(
        self, prompt: str | list[int], namespace: str, add_special_tokens: bool = True
    ) -> RenderedPrompt:
        """A completion's prompt ids (a string is encoded off the loop when large); by default
        as AutoTokenizer(prompt) encodes it, with the tokenizer's special tokens."""
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):

            def encode() -> list[int]:
                return tokenizer.encode(prompt, add_special_tokens, namespace=namespace)

            ids = await asyncio.to_thread(encode) if len(prompt) >= OFF_LOOP_CHARS else encode()
            if not ids:
                raise bad_request(
                    "'prompt' must not be empty (this model's tokenizer adds no start token)",
                    "prompt",
                )
            return RenderedPrompt(ids, [], namespace, [prompt])
        return RenderedPrompt(self.completion_tokens(prompt), [], namespace)

    def completion_tokens(self, prompt: list[int]) -> list[int]:
        tokenizer = self.engine.tokenizer
        vocab = tokenizer.vocab_size
        if max(prompt) >= vocab:
            raise bad_request(f"token ids must be below the vocabulary size {vocab}", "prompt")
        return prompt

    def logit_bias(self, bias: dict[int, float] | None) -> dict[int, float] | None:
        vocab = self.engine.tokenizer.vocab_size
        if bias and max(bias) >= vocab:
            raise bad_request(
                f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias"
            )
        return bias

    def stop_token_ids(self, ids: list[int] | None) -> list[int]:
        return list(self.token_ids(ids, "stop_token_ids") or ())

    def token_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        """Token ids a request names, each in the vocabulary (else a 400 naming ``param``)."""
        vocab = self.engine.tokenizer.vocab_size
        if ids and max(ids) >= vocab:
            raise bad_request(f"{param} must be below the vocabulary size {vocab}", param)
        return ids


def _namespace_entry_bytes(key: tuple[str, str | None]) -> int:
    tenant, salt = key
    return len(tenant) + len(salt or "") + _NAMESPACE_ENTRY_OVERHEAD


def content_size(messages: list[p.Message] | None, segments: list[p.Segment] | None) -> int:
    """Characters of content in a chat prompt: decides whether it renders off the loop."""
    if segments is not None:
        return sum(len(s.content) for s in segments)
    return sum(len(m.text) for m in messages or ())
