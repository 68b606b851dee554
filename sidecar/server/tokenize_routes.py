"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: a prompt's
token ids exactly as the generation routes would compute them (a completion prompt, or a
conversation through the chat template, tools and ``chat_template_kwargs`` included;
``add_special_tokens`` on a conversation adds the tokenizer's special tokens on top, as vLLM),
ids back to text, and the tokenizer's special tokens and template. vLLM's chat fields this
server cannot honour are refused by name. Serving routes: the caller's key, the caller's
tokenization namespace, and nothing kept of the text."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http.errors import bad_request
from ..http.io import decode_json, read_body
from ..wire import protocol as p
from ..wire import reply_types as rt
from ..wire.tokenize_requests import DetokenizeRequest, TokenizeRequest
from .generation import GenerationRoutes
from .responses import json_response


class TokenizeRoutes:
    def __init__(self, generation: GenerationRoutes) -> None:
        self.generation = generation
        self.gate = generation.gate

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        ]

    async def tokenize(self, request: Request) -> Response:
        gate = self.gate
        tenant = gate.caller(request)
        body = await read_body(request, gate.settings.max_body_bytes)
        req = decode_json(body, TokenizeRequest)
        gate.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        namespace = gate.namespace(tenant.name, req.cache_salt)
        tokenizer = self.generation.engine.tokenizer
        if req.prompt is not None:
            if isinstance(req.prompt, list) and not req.prompt:  # "" is a prompt, as for
                raise bad_request("'prompt' must not be empty", "prompt")  # /v1/completions
            special = req.add_special_tokens is None or req.add_special_tokens
            prompt = await gate.completion_prompt(req.prompt, namespace, special)
            ids = prompt.token_ids
        else:
            # the chat fields of the body, add_special_tokens among them (false by default),
            # checked and rendered as /v1/chat/completions does
            chat = decode_json(body, p.ChatCompletionRequest)
            gate.check(p.check_chat, chat)
            prompt = await self.generation.render_chat(chat, namespace)
            ids = prompt.token_ids
        gate.forget(prompt)  # tokenized, not served: keep nothing of it
        pieces = None
        if req.return_token_strs:
            pieces = await off_the_loop_if_long(
                len(ids), lambda: list(map(tokenizer.token_piece, ids))
            )
        max_len = self.generation.engine.max_model_len
        return json_response(rt.TokenizeResponse(len(ids), max_len, ids, pieces))

    async def detokenize(self, request: Request) -> Response:
        gate = self.gate
        gate.caller(request)
        req = await gate.read(request, DetokenizeRequest)
        gate.check_model(req.model)
        tokenizer = self.generation.engine.tokenizer
        if req.tokens and max(req.tokens) >= tokenizer.vocab_size:
            raise bad_request(
                f"token ids must be below the vocabulary size {tokenizer.vocab_size}", "tokens"
            )
        tokens = req.tokens
        text = await off_the_loop_if_long(
            len(tokens), lambda: tokenizer.decode(tokens, skip_special_tokens=False)
        )
        return json_response(rt.DetokenizeResponse(text))

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info`` (its ``--enable-tokenizer-info-endpoint``): the special
        tokens and the chat template, what lm-evaluation-harness's remote tokenizer reads (with
        /tokenize and /detokenize it then needs no local copy of the tokenizer)."""
        self.gate.caller(request)
        tokenizer = self.generation.engine.tokenizer
        info = rt.TokenizerInfo(
            bos_token=getattr(tokenizer, "bos_token", None),
            eos_token=getattr(tokenizer, "eos_token", None),
            chat_template=getattr(tokenizer, "chat_template", None),
            model_max_length=self.generation.engine.max_model_len,
            vocab_size=tokenizer.vocab_size,
        )
        return json_response(info)


T = TypeVar("T")

# Ids at which listing or decoding them moves to a worker thread: 600K ids held the event
# loop 175 ms (the prompt's own rendering moves at 32K characters).
LONG_IDS = 32_768


async def off_the_loop_if_long(count: int, work: Callable[[], T]) -> T:
    if count < LONG_IDS:
        return work()
    return await anyio.to_thread.run_sync(work)
