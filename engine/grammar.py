"""A constrained request's grammar: its ``GrammarSpec`` compiled by llguidance (torch-free, so
the sidecar refuses a schema with a 400 before it starts a stream; the engine compiles the
same and checks it against the tokenizer).

Objects allow only the properties their schema names unless it says otherwise
(``additionalProperties`` defaults to false, as xgrammar's strict mode and OpenAI's strict
structured outputs do); ``json`` mode (any object) allows any. No free whitespace: a model
that likes spaces could otherwise never finish. llguidance is imported on first use.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from .request import GrammarSpec

REFUSED = "the JSON schema cannot be used for constrained output"
JSON_OPTIONS = {"whitespace_flexible": False}
# Keys whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not
    say (a copy; boolean schemas and schemas that already say are kept)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def compiled_grammar(spec: GrammarSpec) -> str:
    """``spec``'s llguidance grammar, checked as far as it goes without a tokenizer;
    ValueError naming the problem where llguidance refuses the schema."""
    return _compiled(spec.kind, spec.schema)


@functools.lru_cache(maxsize=256)  # agents send the same few schemas again and again
def _compiled(kind: str, schema_text: str) -> str:
    import llguidance as llg

    try:
        if kind == "json":  # OpenAI's json_object: any JSON object
            schema: Any = {"type": "object"}
        else:
            schema = closed_objects(json.loads(schema_text))
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        error = llg.LLMatcher.validate_grammar(grammar, None)
    except (RuntimeError, ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise ValueError(f"{REFUSED}: {error}")
    return grammar
