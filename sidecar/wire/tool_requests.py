"""Request types for tools and ``response_format`` (constrained output), and the check of a
json_schema format; the cross-field tool checks are protocol.py's ``check_tools``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .prompt_parts import Error, FunctionName

MAX_TOOLS = 128  # a request's tools (chat's, and warm / unpin's)


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(msgspec.Struct):
    name: FunctionName


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


def check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None or not isinstance(fmt.json_schema.schema, dict):
        raise Error(
            "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
            "response_format",
        )
