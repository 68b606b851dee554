"""An Anthropic Messages request as the chat request the engine path already serves, plus its
cache breakpoints.

The conversation maps onto chat messages: ``system`` blocks become one system message,
``tool_use`` blocks an assistant turn's ``tool_calls``, each ``tool_result`` a ``tool``
message; text blocks of one message stay text parts of one message (joined as the chat path
joins them, so the same text sent to either endpoint renders to the same tokens). Consecutive
messages of one role are one turn, as Anthropic combines them: their blocks in order, as if
one message held them all. A final assistant message is a prefill: the model continues it
(an empty one is no prefill).

A breakpoint (``cache_control`` on a tool, a system block or a message block, or the
top-level automatic one, which marks the last block) is kept as the conversation cut just
after its block. Once the whole prompt is rendered, each cut is rendered alone and the tokens
it shares with the prompt are the prefix to keep: a retention hint (a TTL pin once computed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from prefixcache.engine.request import RetentionHint

from ..chat.rendering import PromptRenderer, RenderedPrompt, common_prefix
from ..wire import protocol as p
from ..wire.prompt_parts import (
    CACHE_TTLS,
    MAX_CACHE_BREAKPOINTS,
    CacheControl,
    FunctionCall,
    TextPart,
    ToolCallItem,
)
from ..wire.tool_requests import (
    ChosenFunction,
    FunctionDef,
    JSONSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolDef,
)
from . import wire as w

# A user turn that shares nothing with any prompt's content: where it starts, a tools-only
# prefix ends.
_PROBE = [p.Message("user", "\u2063probe\u2063")]


# Anthropic's tool_choice types as the chat path's modes ("tool" names one: NamedToolChoice).
_TOOL_MODES: dict[str, Literal["auto", "required", "none"]] = {
    "auto": "auto",
    "any": "required",
    "none": "none",
}


@dataclass(slots=True, frozen=True)
class Breakpoint:
    cut: list[p.Message] | None  # the conversation up to the marked block; None: the tools
    ttl: str  # "5m" | "1h"

    @property
    def ttl_s(self) -> float:
        return CACHE_TTLS[self.ttl]


@dataclass(slots=True)
class Conversation:
    messages: list[p.Message] = field(default_factory=list)
    breakpoints: list[Breakpoint] = field(default_factory=list)
    prefill: bool = False  # the last message is the assistant's: continue it


def conversation(req: w.CountTokensRequest) -> Conversation:
    """The chat messages and breakpoints of ``req``; ``p.Error`` for what cannot be served."""
    check_unsupported(req)
    out = Conversation()
    for tool in req.tools or ():
        if tool.cache_control is not None:
            out.breakpoints.append(Breakpoint(None, tool.cache_control.ttl))
    if req.system:
        blocks = [w.TextBlock(req.system)] if isinstance(req.system, str) else req.system
        parts: list[TextPart] = []
        for block in blocks:
            parts.append(TextPart("text", block.text))
            if block.cache_control is not None:
                out.breakpoints.append(
                    Breakpoint([p.Message("system", list(parts))], block.cache_control.ttl)
                )
        out.messages.append(p.Message("system", parts))
    check_turns(req.messages)
    turns = _turns(req.messages)
    if len(turns) > 1 and turns[-1].role == "assistant" and not turns[-1].content:
        turns.pop()  # the optional empty final assistant message: nothing to continue
    tool_use_ids: set[str] = set()
    for turn in turns:
        if isinstance(turn.content, str):
            out.messages.append(p.Message(turn.role, turn.content))
        elif turn.role == "assistant":
            _assistant(turn.content, out, tool_use_ids)
        else:
            _user(turn.content, out, tool_use_ids, turn.index)
    if req.cache_control is not None:  # automatic caching: a breakpoint on the last block
        out.breakpoints.append(Breakpoint(list(out.messages), req.cache_control.ttl))
    check_breakpoints(out.breakpoints)
    out.prefill = turns[-1].role == "assistant"
    return out


@dataclass(slots=True)
class _Turn:
    index: int  # its first message's
    role: Literal["user", "assistant"]
    content: str | list[w.Block]


def _turns(messages: list[w.InputMessage]) -> list[_Turn]:
    """The messages with each run of one role as one turn: the run's blocks in order (a
    lone message keeps its content as it came)."""
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        if not turns or turns[-1].role != message.role:
            turns.append(_Turn(i, message.role, message.content))
            continue
        turn = turns[-1]
        turn.content = [*_blocks(turn.content), *_blocks(message.content)]
    return turns


def _blocks(content: str | list[w.Block]) -> list[w.Block]:
    if isinstance(content, str):
        return [w.TextBlock(content)] if content else []
    return content


def _assistant(blocks: list[w.Block], out: Conversation, tool_use_ids: set[str]) -> None:
    parts: list[TextPart] = []
    calls: list[ToolCallItem] = []

    def turn() -> p.Message:
        return p.Message("assistant", list(parts) if parts else "", tool_calls=list(calls) or None)

    for block in blocks:
        if isinstance(block, w.TextBlock):
            parts.append(TextPart("text", block.text))
        elif isinstance(block, w.ToolUseBlock):
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(ToolCallItem(block.id, FunctionCall(block.name, arguments)))
            tool_use_ids.add(block.id)
        else:
            raise p.Error("tool_result blocks belong in user messages", "messages")
        if block.cache_control is not None:
            out.breakpoints.append(Breakpoint([*out.messages, turn()], block.cache_control.ttl))
    out.messages.append(turn())


def _user(blocks: list[w.Block], out: Conversation, tool_use_ids: set[str], index: int) -> None:
    parts: list[TextPart] = []
    for block in blocks:
        control: CacheControl | None
        if isinstance(block, w.TextBlock):
            parts.append(TextPart("text", block.text))
            control = block.cache_control
        elif isinstance(block, w.ToolResultBlock):
            if block.tool_use_id not in tool_use_ids:
                raise p.Error(
                    f"messages.{index}: tool_result {block.tool_use_id[:64]!r} has no tool_use "
                    "block before it",
                    "messages",
                )
            if parts:  # text before a result is its own user turn
                out.messages.append(p.Message("user", list(parts)))
                parts = []
            text = f"Error: {block.text}" if block.is_error else block.text
            out.messages.append(p.Message("tool", text, tool_call_id=block.tool_use_id))
            control = block.cache_control
        else:
            raise p.Error(f"messages.{index}: tool_use blocks belong in assistant messages")
        if control is not None:
            head = [p.Message("user", list(parts))] if parts else []
            out.breakpoints.append(Breakpoint([*out.messages, *head], control.ttl))
    if parts or not blocks:
        out.messages.append(p.Message("user", parts))


def check_unsupported(req: w.CountTokensRequest) -> None:
    """Refuse by name what would change the answer but is not implemented."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise p.Error("extended thinking is not supported by this server", "thinking")
    if req.mcp_servers:
        raise p.Error("'mcp_servers' is not supported by this server", "mcp_servers")
    if isinstance(req, w.MessagesRequest) and req.container is not None:
        raise p.Error("'container' is not supported by this server", "container")
    for tool in req.tools or ():
        if tool.type not in (None, "custom"):
            raise p.Error(f"server tool type {tool.type[:40]!r} is not supported", "tools")
    names = [t.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise p.Error("tool names must be unique", "tools")
    choice = req.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not names:
        raise p.Error(f"tool_choice {choice.type!r} needs 'tools'", "tool_choice")
    if choice is not None and choice.type == "tool":
        if choice.name is None:
            raise p.Error("tool_choice 'tool' needs 'name'", "tool_choice")
        if choice.name not in names:
            raise p.Error(f"tool_choice names {choice.name!r}, which is not in 'tools'")
    blocks: list[object] = list(req.system) if isinstance(req.system, list) else []
    for message in req.messages:
        if isinstance(message.content, list):
            blocks.extend(message.content)
            for block in message.content:
                if isinstance(block, w.ToolResultBlock) and isinstance(block.content, list):
                    blocks.extend(block.content)
    for block in blocks:
        if isinstance(block, w.UNSUPPORTED_BLOCKS):
            kind = type(block).__struct_config__.tag
            raise p.Error(f"{kind} content blocks are not supported by this server", "messages")
        if isinstance(block, w.TextBlock) and block.citations:
            raise p.Error("citations are not supported by this server", "messages")


def check_turns(messages: list[w.InputMessage]) -> None:
    """Anthropic's 400s on the messages themselves: empty content (but an optional final
    assistant message), empty or blank text blocks, a ``tool_result`` after another block of
    its message, a prefill that ends in whitespace."""
    last = len(messages) - 1
    for i, message in enumerate(messages):
        prefill = i == last and message.role == "assistant"
        if not message.content and not prefill:
            raise p.Error(
                f"messages.{i}: all messages must have non-empty content except for the "
                "optional final assistant message"
            )
        blocks = _blocks(message.content)
        for j, block in enumerate(blocks):
            where = f"messages.{i}" + (f".content.{j}" if isinstance(message.content, list) else "")
            if isinstance(block, w.TextBlock) and not block.text:
                raise p.Error(f"{where}: text content blocks must be non-empty")
            if isinstance(block, w.TextBlock) and not block.text.strip() and not prefill:
                raise p.Error(f"{where}: text content blocks must contain non-whitespace text")
            after_other = j > 0 and not isinstance(blocks[j - 1], w.ToolResultBlock)
            if isinstance(block, w.ToolResultBlock) and after_other and message.role == "user":
                raise p.Error(
                    f"{where}: tool_result blocks must come before any other content in a "
                    "user message"
                )
        end = blocks[-1] if blocks else None
        if prefill and isinstance(end, w.TextBlock) and end.text != end.text.rstrip():
            raise p.Error(
                f"messages.{i}: final assistant content cannot end with trailing whitespace"
            )


def check_breakpoints(breakpoints: list[Breakpoint]) -> None:
    """Anthropic's limits: at most 4, and no 1h breakpoint after a 5m one."""
    if len(breakpoints) > MAX_CACHE_BREAKPOINTS:
        raise p.Error(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(breakpoints)}."
        )
    seen_short = False
    for point in breakpoints:
        if point.ttl == "5m":
            seen_short = True
        elif seen_short:
            raise p.Error(
                "a cache_control with ttl '1h' must not come after one with ttl '5m' "
                "(in the order tools, system, messages)"
            )


def chat_request(req: w.MessagesRequest, chat: Conversation) -> p.ChatCompletionRequest:
    """The chat request the engine path serves for ``req``."""
    choice = req.tool_choice
    tool_choice: p.ToolChoice | None = None
    if choice is not None:
        if choice.type == "tool":
            assert choice.name is not None
            tool_choice = NamedToolChoice("function", ChosenFunction(choice.name))
        else:
            tool_choice = _TOOL_MODES[choice.type]
    disable_parallel = choice is not None and bool(choice.disable_parallel_tool_use)
    tools = [
        ToolDef("function", FunctionDef(t.name, t.description, t.input_schema))
        for t in req.tools or ()
    ]
    fmt = req.output_config.format if req.output_config is not None else None
    response_format = None
    if fmt is not None:
        response_format = ResponseFormat("json_schema", JSONSchemaFormat("output", fmt.schema))
    return p.ChatCompletionRequest(
        model=req.model,
        messages=chat.messages,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=list(req.stop_sequences) if req.stop_sequences else None,
        stream=bool(req.stream),
        user=req.metadata.user_id if req.metadata is not None else None,
        tools=tools or None,
        tool_choice=tool_choice,
        parallel_tool_calls=False if disable_parallel else None,
        add_generation_prompt=not chat.prefill,
        continue_final_message=chat.prefill,
        response_format=response_format,
        cache_salt=req.cache_salt,
    )


# (renderer, the rendered prompt, template kwargs) -> its hints: a server.generation.Retention
Retention = Callable[[PromptRenderer, RenderedPrompt, dict[str, Any]], list[RetentionHint]]


def retention(chat: Conversation) -> Retention:
    """The retention hints of ``chat``'s breakpoints, measured on the rendered prompt."""

    def hints(
        renderer: PromptRenderer, prompt: RenderedPrompt, template_kwargs: dict[str, Any]
    ) -> list[RetentionHint]:
        out: list[RetentionHint] = []
        for point in chat.breakpoints:
            cut = _PROBE if point.cut is None else point.cut
            head = renderer.render_chat(
                cut, None, False, template_kwargs, False, prompt.namespace
            ).token_ids
            out.append(RetentionHint(common_prefix(head, prompt.token_ids), point.ttl_s))
        return out

    return hints
