"""``POST /v1/responses``: a Responses API body checked, turned into a chat request
(convert.py) and served by the engine path's own rendering, admission and tenancy; errors in
OpenAI's shape, as the other OpenAI routes.

``previous_response_id`` continues a stored conversation (store.py) of the same tenant;
``store: false`` keeps nothing. ``prompt_cache_key`` is echoed: on one engine every request
of a tenant already shares its cache, so it changes nothing here. ``prompt_cache_retention:
"24h"`` keeps the input's prefix as a TTL pin.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from prefixcache.engine.request import RetentionHint

from ..chat.rendering import PromptRenderer, RenderedPrompt, common_prefix
from ..http.errors import APIError, bad_request
from ..http.streaming import SSEResponse, run_until_disconnect
from ..server.generation import GenerationRoutes, Retention
from ..server.responses import collect, json_response, server_timing
from ..wire import protocol as p
from ..wire.prompt_parts import FunctionCall, ToolCallItem
from . import convert
from . import wire as w
from .replies import finish, new_id, output_items, stream_events
from .store import ResponseStore

EXTENDED_RETENTION_S = 24 * 3600.0


class ResponsesRoutes:
    def __init__(self, generation: GenerationRoutes, store: ResponseStore | None = None) -> None:
        self.generation = generation
        self.gate = generation.gate
        self.store = store or ResponseStore()

    async def create(self, request: Request) -> Response | SSEResponse:
        gate = self.gate
        tenant = gate.caller(request)
        req = await gate.read(request, w.ResponsesRequest)
        namespace = gate.namespace(tenant.name, None)  # the store is per tenant
        history: list[p.Message] = []
        if req.previous_response_id is not None:
            found = self.store.get(namespace, req.previous_response_id)
            if found is None:
                raise APIError(
                    400,
                    f"Previous response with id '{req.previous_response_id[:128]}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = found
        try:
            convert.check_unsupported(req)
            chat_req = convert.chat_request(req, history)
        except p.Error as exc:
            raise bad_request(str(exc), exc.param) from None
        response_id = new_id("resp")
        assert chat_req.messages is not None
        retention = None
        if req.prompt_cache_retention == "24h":
            retention = extended_retention(chat_req.messages)
        try:  # the chat path's checks: their errors name the Responses fields
            gate.check(p.check_chat, chat_req)
            gate.check_model(req.model)
            job = await self.generation.chat_job(tenant, chat_req, response_id, retention)
        except APIError as exc:
            raise convert.renamed(exc) from None
        used = {
            k: self.generation.sampling_value(getattr(req, k), k) for k in ("temperature", "top_p")
        }
        response = self._response(req, response_id, job.model, used)
        conversation = chat_req.messages[1:] if req.instructions else chat_req.messages

        def keep(done: w.Response) -> None:
            if req.store:
                self.store.put(namespace, done.id, [*conversation, *_as_messages(done.output)])

        if req.stream:
            return SSEResponse(stream_events(job, response, keep), on_close=job.stream.aclose)
        try:
            result = await run_until_disconnect(collect(job), request.receive)
        finally:
            await job.stream.aclose()
        response.output = output_items(job, result.text, result.finish_reason)
        finish(response, result.finish_reason, result.usage, job)
        keep(response)
        reply = json_response(response)
        if result.timing is not None:
            reply.headers["server-timing"] = server_timing(result.timing)
        return reply

    @staticmethod
    def _response(
        req: w.ResponsesRequest, response_id: str, model: str, used: dict[str, float]
    ) -> w.Response:
        """The response object as it starts (``in_progress``), echoing the request; ``used``:
        the temperature and top_p it runs with (the request's, else the model's defaults)."""
        tools = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict if t.strict is not None else True,
            }
            for t in req.tools or ()
        ]
        choice = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        return w.Response(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            model=model,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            temperature=used["temperature"],
            top_p=used["top_p"],
            tool_choice=choice if choice is not None else "auto",
            tools=tools,
            text={"format": fmt if fmt is not None else {"type": "text"}},
            truncation=req.truncation or "disabled",
            metadata=req.metadata or {},
            store=req.store is not False,
            prompt_cache_key=req.prompt_cache_key,
            user=req.user,
        )


def extended_retention(messages: list[p.Message]) -> Retention:
    """``prompt_cache_retention: "24h"``: the whole input (all but the generation prompt) kept
    cached for 24 h, a retention hint like a Messages breakpoint's (the TTL is capped by
    ``--max-pin-ttl``)."""

    def hints(
        renderer: PromptRenderer, prompt: RenderedPrompt, template_kwargs: dict[str, Any]
    ) -> list[RetentionHint]:
        head = renderer.render_chat(
            messages, None, False, template_kwargs, False, prompt.namespace
        ).token_ids
        return [RetentionHint(common_prefix(head, prompt.token_ids), EXTENDED_RETENTION_S)]

    return hints


def _as_messages(output: list[w.OutputItem]) -> list[p.Message]:
    """A response's output as the assistant turn a later request continues from."""
    text = "".join(
        part.text for item in output if isinstance(item, w.OutputMessage) for part in item.content
    )
    calls = [
        ToolCallItem(item.call_id, FunctionCall(item.name, item.arguments))
        for item in output
        if isinstance(item, w.OutputFunctionCall)
    ]
    return [p.Message("assistant", text, tool_calls=calls or None)]
