"""Canonical serialization: the same data always becomes the same bytes.

Objects get their keys sorted, separators are fixed (``,`` and ``:``, no spaces), floats use
Python's shortest round-trip repr (``-0.0`` becomes ``0.0``; NaN and infinities are refused),
tuples are lists, and text stays UTF-8 (no ``\\uXXXX`` escapes for non-ASCII).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

_encode_str = json.JSONEncoder(ensure_ascii=False).encode


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value`` (dicts, lists, str, int, float, bool, None)."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)


def to_text(content: Any) -> str:
    """Segment content as text: strings pass through, anything else is canonical JSON."""
    return content if isinstance(content, str) else canonical_json(content)


def is_canonical_json(text: str) -> bool:
    """Whether ``text`` parses as JSON and is already in canonical form."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return canonical_json(value) == text


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_encode_str(value))
    elif isinstance(value, int):
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(_float(value))
    elif isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"object keys must be str, got {type(key).__name__}")
            items.append((key, item))
        items.sort(key=lambda kv: kv[0])
        out.append("{")
        for i, (key, item) in enumerate(items):
            if i:
                out.append(",")
            out.append(_encode_str(key))
            out.append(":")
            _write(item, out)
        out.append("}")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(value, msgspec.Struct):
        _write(msgspec.to_builtins(value), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _write(dataclasses.asdict(value), out)
    else:
        raise TypeError(f"cannot serialize {type(value).__name__} canonically")


def _float(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError(f"{x!r} has no JSON form")
    if x == 0.0:
        return "0.0"  # -0.0 and 0.0 render the same
    return repr(x)
