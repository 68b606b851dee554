"""Bodies of the cache admin routes: /v1/cache/{warm,unpin} (``CacheRequest``), evict, save
and load; the query of vLLM's /reset_prefix_cache. Unknown fields are refused (a 400), unlike
the OpenAI routes': an admin's typo (``"nmae"``, ``"include_pined"``) must not run the default
action (overwrite the default snapshot, keep the pins)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

from .prompt_parts import MAX_SEGMENTS, CacheSalt, Error, Message, Segment, fill_defaults
from .tool_requests import MAX_TOOLS, ToolChoice, ToolDef

# A file name inside --cache-dir: no separators, no leading dot, so never a path elsewhere.
CacheFileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")]


class CacheRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of /v1/cache/warm and /v1/cache/unpin: a chat prompt's fields, as the requests
    that will reuse it send them (protocol.stable_chat() makes it the chat request of its
    stable part), and what to do with it."""

    model: str | None = None
    messages: list[Message] | None = None
    segments: Annotated[list[Segment], msgspec.Meta(max_length=MAX_SEGMENTS)] | None = None
    pin: bool | None = False
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=30 * 86400)] | None = None  # pin's lifetime
    cache_salt: CacheSalt | None = None
    # chat's fields that change the rendered prompt
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # "none": a template without tools renders none
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool | None = False
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = False  # true refused: never part of the stable part

    def __post_init__(self) -> None:
        fill_defaults(
            self,
            {
                "pin": False,
                "add_special_tokens": False,
                "continue_final_message": False,
                "add_generation_prompt": False,
            },
        )
        if self.ttl_s is not None and not self.pin:
            raise Error('ttl_s is the lifetime of a pin: it needs "pin": true', "ttl_s")


class EvictRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of /v1/cache/evict (optional)."""

    include_pinned: bool = False  # unpin everything first
    keep_tier: bool = False  # the pool's blocks spill into the KV tier instead of being lost


class CacheFileRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of /v1/cache/save and /v1/cache/load: which file in --cache-dir."""

    name: CacheFileName = "pinned"


class CacheSaveRequest(CacheFileRequest, kw_only=True, forbid_unknown_fields=True):
    """Body of /v1/cache/save: with nothing pinned, an existing file is kept unless
    ``allow_empty`` (a scheduled save after a restart whose load failed must not wipe it)."""

    allow_empty: bool = False


# vLLM's /reset_prefix_cache takes FastAPI ``bool`` query parameters: these spellings, any case
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})
RESET_QUERY = ("reset_running_requests", "reset_external")
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # named back in an error as it is


def reset_query(items: Iterable[tuple[str, str]]) -> dict[str, bool | None]:
    """vLLM's /reset_prefix_cache query parameters, None where not given (the last of a
    repeated one counts, as in FastAPI). A value that is no boolean is refused, as vLLM does;
    so is a name vLLM does not take (vLLM ignores it: here a typo must not reset anyway)."""
    given: dict[str, bool | None] = dict.fromkeys(RESET_QUERY)
    for name, value in items:
        if name not in given:
            plain = _PLAIN_NAME.fullmatch(name) is not None
            raise Error(
                f"unknown query parameter{f' {name!r}' if plain else ''}: /reset_prefix_cache "
                f"takes {' and '.join(RESET_QUERY)}",
                name if plain else None,
            )
        word = value.lower()
        if word not in _TRUE and word not in _FALSE:
            raise Error(f"{name} must be a boolean: true or false", name)
        given[name] = word in _TRUE
    return given
