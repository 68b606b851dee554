"""Bodies of vLLM's ``/tokenize`` and ``/detokenize`` (its field names and defaults)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .prompt_parts import CacheSalt, Message

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A completion prompt (``prompt``) or a conversation (``messages``, rendered as
    /v1/chat/completions renders it: that body's chat fields apply, checked as chat checks
    them, so ``chat_template`` is refused by name on both)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # vLLM's defaults: a prompt as AutoTokenizer encodes it (true); a conversation as its
    # template renders it (false: the template writes the special tokens; true adds the
    # tokenizer's own on top, a second BOS where the template wrote one)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    cache_salt: CacheSalt | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=1 << 20)]
