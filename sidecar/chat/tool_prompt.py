"""The request side of tools and structured output: the canonical tools the template sees,
whether the template renders tools at all, which tool-call format it writes, and the grammar
a request's output must follow.

Tools are canonicalised before rendering (keys sorted at every level, floats in one form), so
the same tools always render to the same text and tokens and hit the cache, whatever order a
client wrote their keys in. Templates print them with their own ``tojson``, as transformers'.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from prefixcache.engine.api import TokenizerAPI
from prefixcache.engine.request import GrammarSpec
from prefixcache.sdk.canonical import canonical_json

from ..wire import protocol as p
from .generic_tools import GenericParser, GenericTools, SchemaDefs, envelope_schema
from .tool_calls import (
    PROBE_CALL_MESSAGES,
    PROBE_TOOL,
    FirstCallOnly,
    ForcedParser,
    ToolCallParser,
    parser_for_rendering,
    parser_named,
)

_PROBE_MESSAGES = [{"role": "user", "content": "probe question"}]


def canonical_tools(tools: list[p.ToolDef]) -> list[dict[str, Any]]:
    return [json.loads(canonical_json(msgspec.to_builtins(tool))) for tool in tools]


def grammar_for(req: p.ChatCompletionRequest, generic: bool = False) -> GrammarSpec | None:
    """What the output must be: vLLM's structured_outputs (or guided_*), a response_format, or
    a forced tool call's JSON; ``generic``
    (tools on a template that does not render them): the generic format's envelope, under
    tool_choice auto its response a string or the response_format's JSON, else calls only.
    ValueError for tools whose schemas cannot share one grammar."""
    vllm = p.structured_output_of(req)  # vLLM's fields: alone (check_chat refuses others)
    if vllm is not None:
        return vllm[0]
    fmt = req.response_format
    mode = req.tool_mode
    if generic and req.tools and mode != "none":
        response: dict[str, Any] | None = None  # auto: calls or an answer; else calls only
        if mode == "auto":
            response = {"type": "string"}
            if fmt is not None and fmt.type == "json_object":
                response = {"type": "object"}
            elif fmt is not None and fmt.type == "json_schema":
                assert fmt.json_schema is not None and fmt.json_schema.schema is not None
                response = fmt.json_schema.schema
        named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        tools = [(t.function.name, _parameters(t)) for t in req.tools if named in (None, t.function.name)]  # fmt: skip
        single = req.parallel_tool_calls is False or named is not None
        schema = envelope_schema(tools, single, response)
        return GrammarSpec("json_schema", schema_text(schema))
    if (formatted := format_grammar(fmt)) is not None:
        return formatted
    if mode == "named":
        assert isinstance(req.tool_choice, p.NamedToolChoice)
        (tool,) = [t for t in req.tools or () if t.function.name == req.tool_choice.function.name]
        return GrammarSpec("json_schema", schema_text(_parameters(tool)))
    if mode == "required":  # a list of one or more calls of the given tools (vLLM's form)
        defs = SchemaDefs()  # each tool's $defs at the root, where its references point
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": defs.lift(
                        _parameters(t), f"#/items/anyOf/{i}/properties/parameters"
                    ),
                },
                "required": ["name", "parameters"],
            }
            for i, t in enumerate(req.tools or ())
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", schema_text(defs.into(schema)))
    return None


def format_grammar(fmt: p.ResponseFormat | None) -> GrammarSpec | None:
    """A ``response_format``'s grammar (None for text or none)."""
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec("json")
    if fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None and fmt.json_schema.schema is not None
        return GrammarSpec("json_schema", schema_text(fmt.json_schema.schema))
    return None


def schema_text(schema: Any) -> str:
    """A schema as compact JSON in the client's key order: its properties are generated in
    that order (OpenAI's Structured Outputs contract: "reasoning" before "answer" stays so),
    so, unlike the tools the template renders, it is not canonicalised."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _parameters(tool: p.ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


class ToolTemplate:
    """What the model's chat template does with tools, probed once by rendering."""

    def __init__(self, tokenizer: TokenizerAPI, parser_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.parser_name = parser_name  # --tool-call-parser; None: from the template
        self._supports: bool | None = None
        self._parser: ToolCallParser | None = None

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders ``tools`` (a template that ignores them cannot)."""
        if self._supports is None:
            try:
                without = self.tokenizer.apply_chat_template(_PROBE_MESSAGES, True)
                with_tools = self.tokenizer.apply_chat_template(
                    _PROBE_MESSAGES, True, tools=[PROBE_TOOL]
                )
                self._supports = with_tools != without
            except Exception:  # a template that fails on tools does not support them
                self._supports = False
        return self._supports

    def generic_tools(self, req: p.ChatCompletionRequest) -> GenericTools | None:
        """``req``'s tools in the generic format (generic_tools.py) where the template does not
        render them; else None."""
        if not req.tools or req.tool_mode == "none" or self.supports_tools:
            return None
        return GenericTools(canonical_tools(req.tools))

    def parser(self, req: p.ChatCompletionRequest) -> ToolCallParser | None:
        """How this request's output becomes tool calls (or, in the generic format, content),
        or None (no tools, or "none" on a template that renders them)."""
        mode = req.tool_mode
        if mode == "none" or not req.tools:
            return None
        if not self.supports_tools:  # the generic format, whatever the choice
            fmt = req.response_format
            named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
            return GenericParser(fmt is not None and fmt.type != "text", named)
        if mode == "named":
            assert isinstance(req.tool_choice, p.NamedToolChoice)
            return ForcedParser(req.tool_choice.function.name)
        if mode == "required":
            return ForcedParser(None)
        if req.parallel_tool_calls is False:
            return FirstCallOnly(self.model_parser)
        return self.model_parser

    @property
    def model_parser(self) -> ToolCallParser:
        if self._parser is None:
            if self.parser_name is not None:
                self._parser = parser_named(self.parser_name)
            else:
                self._parser = parser_for_rendering(self._probe_call())
        return self._parser

    def _probe_call(self) -> str:
        """The template's rendering of an assistant tool call ("" if it cannot)."""
        try:
            return self.tokenizer.apply_chat_template(
                PROBE_CALL_MESSAGES, False, tools=[PROBE_TOOL]
            )
        except Exception:
            return ""
