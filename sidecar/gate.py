"""``RequestGate``: every check a request passes before the engine sees it.

Auth, readiness, body size and JSON types, the model name, prompt rendering and token ids;
and the caller's cache namespace, derived once per (tenant, salt) for generation and the
cache admin routes alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError as JinjaError
from starlette.requests import Request

from prefixcache.engine.api import EngineAPI
from prefixcache.engine.tokenizer import ChatTemplateError

from . import protocol as p
from .errors import bad_request, model_not_found, not_ready
from .http_io import decode_json, read_body
from .rendering import PromptRenderer, RenderedPrompt, TemplateError
from .settings import SidecarSettings
from .tenancy import Tenant, cache_namespace

S = TypeVar("S")
R = TypeVar("R", bound=p.SamplingFields)

_MAX_NAMESPACES = 65536  # remembered (tenant, salt) pairs; a few per tenant in practice


class RequestGate:
    def __init__(self, engine: EngineAPI, settings: SidecarSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._renderer: PromptRenderer | None = None
        self._namespaces: dict[tuple[str, str | None], str] = {}

    # -- who is asking, and can we answer --------------------------------------------------

    def caller(self, request: Request) -> Tenant:
        """The authenticated tenant of a serving route; 401, then 503 while loading."""
        tenant = self.settings.keys.authenticate(request.headers.get("authorization"))
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
        name = self.engine.model_name
        if model and model != name and model not in self.settings.model_aliases:
            raise model_not_found(name)

    def namespace(self, tenant: str, salt: str | None) -> str:
        """The HMAC-derived cache namespace, remembered."""
        key = (tenant, salt)
        namespace = self._namespaces.get(key)
        if namespace is None:
            if len(self._namespaces) >= _MAX_NAMESPACES:
                self._namespaces.clear()
            namespace = cache_namespace(self.settings.secret, tenant, salt)
            self._namespaces[key] = namespace
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
    def check(check: Callable[..., None], *args: Any) -> None:
        """Run a protocol.py cross-field check; its error is a 400 naming the field."""
        try:
            check(*args)
        except p.Error as exc:
            raise bad_request(str(exc), exc.param) from None

    # -- the prompt ----------------------------------------------------------------------------

    @property
    def renderer(self) -> PromptRenderer:
        if self._renderer is None:  # the tokenizer exists once the engine is ready
            self._renderer = PromptRenderer(self.engine.tokenizer)
        return self._renderer

    def render(self, render: Callable[[PromptRenderer], RenderedPrompt]) -> RenderedPrompt:
        try:
            return render(self.renderer)
        except TemplateError as exc:
            raise bad_request(str(exc), "segments", "template_not_incremental") from None
        except (ChatTemplateError, JinjaError) as exc:
            message = f"The chat template rejected the conversation: {exc}"
            raise bad_request(message, "messages", "chat_template_error") from None

    def completion_tokens(self, prompt: str | list[int]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):  # as AutoTokenizer(prompt): the tokenizer's special tokens
            return tokenizer.encode(prompt, add_special_tokens=True)
        vocab = tokenizer.vocab_size
        if max(prompt) >= vocab:
            raise bad_request(f"token ids must be below the vocabulary size {vocab}", "prompt")
        return prompt

    def stop_token_ids(self, ids: list[int] | None) -> list[int]:
        vocab = self.engine.tokenizer.vocab_size
        if ids and max(ids) >= vocab:
            raise bad_request(
                f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids"
            )
        return list(ids or ())
