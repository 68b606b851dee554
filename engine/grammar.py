"""A constrained request's grammar: its ``GrammarSpec`` compiled by llguidance (torch-free, so
the sidecar refuses a schema with a 400 before it starts a stream; the engine compiles the
same and checks it against the tokenizer).

Objects allow only the properties their schema names unless it says otherwise
(``additionalProperties`` defaults to false, as xgrammar's strict mode and OpenAI's strict
structured outputs do); ``json`` mode (any object) allows any. No free whitespace: a model
that likes spaces could otherwise never finish. llguidance is imported on first use.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .request import GrammarSpec

REFUSED = {
    "json": "the JSON schema cannot be used for constrained output",
    "json_schema": "the JSON schema cannot be used for constrained output",
    "regex": "the regular expression cannot be used for constrained output",
    "choice": "the choices cannot be used for constrained output",
    "grammar": "the grammar cannot be used for constrained output",
}
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


class GrammarCache:
    """Compiled grammars, and refusals (their message), by (namespace, spec digest): bounded in
    bytes, oldest out; an entry over an eighth of the bound is not kept. Keyed by namespace
    (tenant and salt), so one tenant's schemas never make another's compile faster: no timing
    says what schemas someone else sent. Agents send the same few schemas again and again;
    a refused one repeated is refused at once. Thread-safe (the sidecar compiles on worker
    threads); two threads may compile the same spec at once, one result is kept."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[bool, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, spec: GrammarSpec, namespace: str = "") -> str | None:
        """The grammar if cached; ValueError if cached as refused; None if not cached."""
        key = (namespace, spec.digest)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        ok, text = entry
        if not ok:
            raise ValueError(text)
        return text

    def get_or_compile(
        self, spec: GrammarSpec, compile: Callable[[GrammarSpec], str], namespace: str = ""
    ) -> str:
        """The cached grammar, else ``compile(spec)``'s, kept; its ValueError kept and raised."""
        if (grammar := self.lookup(spec, namespace)) is not None:
            return grammar
        try:
            grammar = compile(spec)
        except ValueError as exc:
            self._keep((namespace, spec.digest), False, str(exc))
            raise
        self._keep((namespace, spec.digest), True, grammar)
        return grammar

    def _keep(self, key: tuple[str, str], ok: bool, text: str) -> None:
        size = _entry_bytes(key, text)
        if size > self.max_bytes // 8:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (ok, text)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                old_key, (_, old_text) = self._entries.popitem(last=False)
                self.nbytes -= _entry_bytes(old_key, old_text)


def _entry_bytes(key: tuple[str, str], text: str) -> int:
    return 200 + len(key[0]) + len(key[1]) + len(text)  # ~200: the dict slot, tuple, objects


def compiled_grammar(spec: GrammarSpec) -> str:
    """``spec``'s llguidance grammar, checked as far as it goes without a tokenizer;
    ValueError naming the problem where llguidance refuses the schema. Not cached: callers
    keep results in a ``GrammarCache``."""
    import llguidance as llg

    try:
        if spec.kind == "json":  # OpenAI's json_object: any JSON object
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # fmt: skip
        elif spec.kind == "json_schema":
            schema = closed_objects(json.loads(spec.text))
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif spec.kind == "choice":
            grammar = llg.grammar_from("choice", _choices(spec.text))
        else:  # regex; grammar: Lark or GBNF, which llguidance tells apart
            grammar = llg.grammar_from(spec.kind, spec.text)
        error = llg.LLMatcher.validate_grammar(grammar, None) or _no_value(grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise ValueError(f"{REFUSED[spec.kind]}: {error}")
    return grammar


def _choices(text: str) -> str:
    """A choice list's JSON, checked: one or more strings, at least one of them not empty."""
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("the choices must be a non-empty list of strings")
    if not any(choices):
        raise ValueError("the choices must hold a non-empty string")
    return text


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and a stop token, for ``_no_value``'s first step."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b""]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_byte_tokenizer: Any = None


def _no_value(grammar: str) -> str:
    """Why the grammar admits no output at all, or "" where it does: a schema whose ``$ref``s
    only loop (``a -> b -> a``) compiles, and then allows nothing but the stop token, so the
    request would answer an empty string that is no JSON."""
    import llguidance as llg

    global _byte_tokenizer
    if _byte_tokenizer is None:
        _byte_tokenizer = llg.LLTokenizer(
            llg.TokenizerWrapper(_ByteVocabulary()), n_vocab=257, eos_token=[256]
        )
    matcher = llg.LLMatcher(_byte_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return matcher.get_error()
    allowed = matcher.compute_bitmask()  # 257 bits, little-endian words: bytes, then stop
    if not any(allowed[:32]):
        return "the schema allows no JSON value (its $refs only refer to each other)"
    return ""
