"""Bodies of vLLM's ``/tokenize`` and ``/detokenize`` (its field names and defaults)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .prompt_parts import CacheSalt, Error, Message

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A completion prompt (``prompt``) or a conversation (``messages``, rendered as
    /v1/chat/completions renders it: the chat fields of that body apply too)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # vLLM's defaults: a prompt as AutoTokenizer encodes it (true); a conversation as its
    # template renders it (false: the template writes the special tokens; true adds the
    # tokenizer's own on top, a second BOS where the template wrote one)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    cache_salt: CacheSalt | None = None
    # vLLM's TokenizeChatRequest fields this server does not honour: decoded so that
    # check_chat_fields refuses them by name rather than ignoring them
    chat_template: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None


_UNSERVED_CHAT_FIELDS = {
    "chat_template": "a chat template in the request is not accepted (vLLM refuses it too "
    "unless started with --trust-request-chat-template): serve the model with --chat-template",
    "media_io_kwargs": "media_io_kwargs is not supported: the model takes text only",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported: the model takes text only",
}


def check_chat_fields(req: TokenizeRequest) -> None:
    """A conversation's fields that vLLM reads and this server cannot honour: a 400 naming
    the field (``null``, ``""`` and ``{}`` change nothing and pass)."""
    for name, message in _UNSERVED_CHAT_FIELDS.items():
        if getattr(req, name) not in (None, "", {}):
            raise Error(message, name)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=1 << 20)]
