"""vLLM's structured-output request fields, read into one ``GrammarSpec``.

``structured_outputs`` (vLLM's current form: exactly one of ``json``, ``regex``, ``choice``,
``grammar`` or ``json_object``) and the ``guided_json`` / ``guided_regex`` / ``guided_choice``
/ ``guided_grammar`` fields it replaced, on chat and completions alike. llguidance is the one
grammar engine here, so the options that pick or tune vLLM's backends are accepted and do
nothing (``disable_fallback``, ``disable_any_whitespace``: JSON never has free whitespace
here, ``disable_additional_properties``: objects are closed unless their schema opens them);
those that would change the output and are not implemented (``structural_tag``,
``whitespace_pattern``) are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from prefixcache.engine.request import GrammarSpec

from .prompt_parts import Error

MAX_CHOICES = 1024  # guided_choice's strings
MAX_TEXT = 256 * 1024  # a regex's or a grammar's characters


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    json: Any = None  # a JSON schema: an object, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF (llama.cpp's), told apart by llguidance
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}  # fmt: skip


def structured_output_of(req: Any) -> tuple[GrammarSpec, str] | None:
    """The grammar vLLM's fields ask of ``req`` and the field that asked (for error messages),
    or None; Error for a malformed or ambiguous request."""
    asked: list[tuple[str, str, Any]] = []  # (field, kind, value)
    so = getattr(req, "structured_outputs", None)
    if so is not None and so != {}:
        try:
            params = msgspec.convert(so, StructuredOutputs)
        except msgspec.ValidationError as exc:
            raise Error(f"structured_outputs: {exc}", "structured_outputs") from None
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(params, name) is not None:
                raise Error(
                    f"'structured_outputs.{name}' is not supported by this server",
                    f"structured_outputs.{name}",
                )
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(params, kind) is not None:
                asked.append((f"structured_outputs.{kind}", kind, getattr(params, kind)))
        if params.json_object:
            asked.append(("structured_outputs.json_object", "json_object", True))
    for name, kind in _LEGACY.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((name, kind, value))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _, _ in asked)
        raise Error(f"only one structured-output constraint may be given, not {names}", asked[1][0])  # fmt: skip
    ((name, kind, value),) = asked
    return _spec(name, kind, value), name


def _spec(name: str, kind: str, value: Any) -> GrammarSpec:
    if kind == "json_object":
        return GrammarSpec("json")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise Error(f"'{name}' is not valid JSON", name) from None
        if not isinstance(value, dict):
            raise Error(f"'{name}' must be a JSON schema object", name)
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return GrammarSpec("json_schema", text)  # the client's key order: properties' order
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise Error(f"'{name}' must be a list of strings", name)
        if not value or not any(value) or len(value) > MAX_CHOICES:
            raise Error(f"'{name}' needs 1 to {MAX_CHOICES} strings, one not empty", name)
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise Error(f"'{name}' must be a non-empty string of at most {MAX_TEXT} characters", name)
    return GrammarSpec(kind, value)  # type: ignore[arg-type]  # regex or grammar
