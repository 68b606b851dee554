"""OpenAI Responses API bodies: the request, its input items, and the ``response`` object.

Input items are decoded one by one (convert.py) because a message item may leave out its
``type``; everything else is decoded straight into these Structs, so a wrong type or value is
a 400 naming the JSON path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ..wire.prompt_parts import CacheSalt, FunctionName, PromptCacheBreakpoint
from ..wire.protocol import PositiveInt, Temperature, TopP

MAX_INPUT_ITEMS = 4096


# --- the request ------------------------------------------------------------------------------


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str  # only "function": other tool types are refused by name
    name: FunctionName | None = None
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedFunction


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect here


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[FunctionTool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    prompt_cache_key: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: narrows the tenant's cache namespace
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, Annotated[str, msgspec.Meta(max_length=512)]] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None  # accepted, no effect here
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # Options this server does not implement: refused by name unless null (convert.py).
    reasoning: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


# --- input items ------------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # input_text | output_text | refusal; anything else is refused
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # a retention hint, as chat's


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: Annotated[str, msgspec.Meta(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: Annotated[str, msgspec.Meta(min_length=1)]
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


# --- the response -----------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0  # as chat's prompt_tokens_details


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str
    param: str | None = None
    type: str | None = None  # the error's OpenAI type, e.g. invalid_request_error


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str  # in_progress | completed | incomplete | failed
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    text: Any = None
    truncation: str = "disabled"
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    store: bool = True
    prompt_cache_key: str | None = None
    user: str | None = None
    prefixcache: Any = None  # the engine's cache report (extension)
