"""Anthropic Messages API request bodies (``POST /v1/messages`` and its ``count_tokens``).

Decoded straight into these Structs, so a wrong type or value is a 400 naming the JSON path.
Content blocks are a tagged union on ``type``; block types this server cannot use (images,
documents, thinking, server tools) decode so that the checks can refuse them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ..wire.prompt_parts import CacheControl, CacheSalt, FunctionName

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None  # refused unless null/empty


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    """An earlier assistant turn's tool call."""

    id: NonEmpty
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result"):
    tool_use_id: NonEmpty
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


class ImageBlock(msgspec.Struct, tag_field="type", tag="image"):
    source: Any = None
    cache_control: Any = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document"):
    source: Any = None
    cache_control: Any = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: Any = None
    signature: Any = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking"):
    data: Any = None


Block = (
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ImageBlock
    | DocumentBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)
# Block types the engine cannot take in: refused by name (check.py).
UNSUPPORTED_BLOCKS = (ImageBlock, DocumentBlock, ThinkingBlock, RedactedThinkingBlock)


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    """A client tool. Server tools (``type`` other than "custom") are refused."""

    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" or absent
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct):
    user_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class ThinkingConfig(msgspec.Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JSONOutputFormat(msgspec.Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct):
    format: JSONOutputFormat | None = None  # structured output: through the grammar path
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect here


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """Body of /v1/messages/count_tokens: what shapes the prompt, no sampling."""

    model: str | None = None
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # automatic caching: the last block
    cache_salt: CacheSalt | None = None  # vLLM's: narrows the tenant's cache namespace
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted for compatibility, meaning nothing here (mcp_servers: refused unless empty).
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    # Sampling: the API's older fields (today's client sends them through extra_body).
    temperature: Unit | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stop_sequences: (
        Annotated[list[NonEmpty], msgspec.Meta(max_length=16)] | None  # as the chat path
    ) = None
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None  # refused unless null
    # Threads (a conversation the server holds between turns): refused unless null or false,
    # with the code that makes Anthropic's SDK send the whole conversation instead.
    thread: Any = None
