"""Prompt construction, render order, canonical serialization, fingerprints and diff."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.sdk import Prompt, Segment, Tool, canonical_json, diff


def _prompt(question: str = "What is the refund window?", docs: tuple[str, ...] = ("a", "b")):
    b = Prompt.builder().static("You answer from the documents only.", tag="rules")
    for d in docs:
        b.shared(f"Document {d}: policy text {d}.", tag=f"doc:{d}")
    return b.dynamic(question, tag="question").build()


def test_render_order_is_static_shared_session_dynamic_keeping_declared_order() -> None:
    p = Prompt(
        [
            Segment("user", "q", "q", "dynamic"),
            Segment("user", "h1", "h1", "session"),
            Segment("user", "d2", "d2", "shared"),
            Segment("system", "s", "s", "static"),
            Segment("assistant", "h2", "h2", "session"),
            Segment("user", "d1", "d1", "shared"),
        ]
    )
    assert [s.tag for s in p.rendered()] == ["s", "d2", "d1", "h1", "h2", "q"]
    assert [s.tag for s in p.segments] == ["q", "h1", "d2", "s", "h2", "d1"]  # declared kept
    assert [m["content"] for m in p.to_messages()] == ["s", "d2", "d1", "h1", "h2", "q"]


def test_shared_order_by_tag_is_independent_of_retrieval_order() -> None:
    a = _prompt(docs=("b", "c", "a")).with_shared_order("tag")
    b = _prompt(docs=("c", "a", "b")).with_shared_order("tag")
    assert [s.tag for s in a.rendered()] == ["rules", "doc:a", "doc:b", "doc:c", "question"]
    assert a.to_segments() == b.to_segments()
    assert a.fingerprint() == b.fingerprint()
    unsorted = _prompt(docs=("b", "a"))
    assert [s.tag for s in unsorted.rendered()][1:3] == ["doc:b", "doc:a"]


def test_builder_and_constructor_build_equal_prompts() -> None:
    built = Prompt.builder().static("S", tag="s").session("H", tag="h").dynamic("Q", tag="q")
    plain = Prompt(
        [
            Segment("system", "S", "s", "static"),
            Segment("user", "H", "h", "session"),
            Segment("user", "Q", "q", "dynamic"),
        ]
    )
    assert built.build() == plain


def test_prompt_and_segment_are_immutable() -> None:
    p = _prompt()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.segments[0].content = "changed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.segments = ()  # type: ignore[misc]
    longer = p.append(Segment("user", "more", "more", "dynamic"))
    assert len(longer.segments) == len(p.segments) + 1 and "more" not in [s.tag for s in p.segments]


def test_tags_must_be_unique_and_valid() -> None:
    with pytest.raises(ValueError, match="unique"):
        Prompt([Segment("user", "a", "x"), Segment("user", "b", "x")])
    with pytest.raises(ValueError, match="tag"):
        Segment("user", "a", "")
    with pytest.raises(ValueError, match="role"):
        Segment("robot", "a", "t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stability"):
        Segment("user", "a", "t", "forever")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        Prompt([Segment("user", "a", "tools")], tools=[Tool("f", "d", {"type": "object"})])


def test_canonical_serialization_same_data_any_key_order_same_bytes() -> None:
    a = {"b": 1, "a": {"y": [1, 2.5], "x": None}, "c": "é"}
    b = {"c": "é", "a": {"x": None, "y": [1, 2.5]}, "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":{"x":null,"y":[1,2.5]},"b":1,"c":"é"}'
    assert Segment("user", a, "t").content == Segment("user", b, "t").content
    assert json.loads(canonical_json(a)) == a


def test_canonical_floats_and_refusals() -> None:
    assert canonical_json([0.1, -0.0, 1e100, 3.0, True, 2]) == "[0.1,0.0,1e+100,3.0,true,2]"
    assert canonical_json((1, 2)) == canonical_json([1, 2])
    with pytest.raises(ValueError):
        canonical_json(float("nan"))
    with pytest.raises(TypeError):
        canonical_json({1: "int key"})
    with pytest.raises(TypeError):
        canonical_json({"s": {1, 2}})


def test_tool_parameters_are_canonical() -> None:
    t1 = Tool("search", "find", {"type": "object", "properties": {"q": {"type": "string"}}})
    t2 = Tool("search", "find", {"properties": {"q": {"type": "string"}}, "type": "object"})
    assert t1 == t2
    assert list(t1.parameters) == ["properties", "type"]


def test_fingerprint_is_stable_and_ignores_dynamic_segments() -> None:
    a = _prompt("first question")
    b = _prompt("another question")
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint().hex == _prompt("first question").fingerprint().hex
    assert [d.tag for d in a.fingerprint().segments] == ["rules", "doc:a", "doc:b"]
    assert diff(a, b) is None


def test_fingerprint_digests_are_chained() -> None:
    base = _prompt()
    changed_first = Prompt(
        [Segment("system", "Other rules.", "rules", "static"), *base.segments[1:]]
    )
    fa, fb = base.fingerprint(), changed_first.fingerprint()
    # doc:a has identical content in both, but its digest covers everything before it
    assert all(x.digest != y.digest for x, y in zip(fa.segments, fb.segments, strict=True))


def test_diff_names_the_first_differing_segment() -> None:
    a = _prompt(docs=("a", "b", "c"))
    b = _prompt(docs=("a", "x", "c"))
    d = diff(a, b)
    assert d is not None and (d.index, d.tag_a, d.tag_b) == (2, "doc:b", "doc:x")
    shorter = _prompt(docs=("a",))
    d = diff(a, shorter)
    assert d is not None and (d.index, d.tag_a, d.tag_b) == (2, "doc:b", None)
    role_changed = Prompt([Segment("user", s.content, s.tag, s.stability) for s in a.segments])
    d = diff(a, role_changed)
    assert d is not None and d.index == 0


def test_tags_do_not_enter_the_digest_but_roles_and_content_do() -> None:
    a = Prompt([Segment("system", "S", "one", "static")])
    b = Prompt([Segment("system", "S", "two", "static")])
    c = Prompt([Segment("user", "S", "one", "static")])
    assert a.fingerprint().hex == b.fingerprint().hex
    assert a.fingerprint().hex != c.fingerprint().hex


def test_cache_key_defaults_to_static_and_shared_only() -> None:
    base = _prompt()
    turn1 = base.append(Segment("user", "hello", "t1", "session"))
    turn2 = turn1.append(Segment("assistant", "hi there", "t2", "session"))
    k = base.fingerprint().cache_key()
    assert k == turn1.fingerprint().cache_key() == turn2.fingerprint().cache_key()
    assert k.startswith("pc-") and len(k) <= 64
    assert turn1.fingerprint().cache_key("session") != turn2.fingerprint().cache_key("session")
    assert base.fingerprint().cache_key("static") != k


def test_sidecar_segments_request_shape() -> None:
    p = (
        Prompt.builder()
        .dynamic("Q", tag="q")
        .static("S", tag="s")
        .tool("lookup", "Look up an order.", {"type": "object"})
        .build()
    )
    segs = p.to_segments()
    assert [s["tag"] for s in segs] == ["tools", "s", "q"]
    assert all(set(s) == {"role", "content", "tag", "stability"} for s in segs)
    assert json.loads(segs[0]["content"])[0]["name"] == "lookup"


def test_importing_the_sdk_never_imports_torch_engine_or_sidecar() -> None:
    code = (
        "import sys, prefixcache.sdk\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
        "or m.startswith('prefixcache.engine') or m.startswith('prefixcache.sidecar')]\n"
        "print(bad)\n"
        "raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _reverse_keys(value: object) -> object:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


@settings(max_examples=150, deadline=None)
@given(_json)
def test_canonical_json_round_trips_and_ignores_key_order(value: object) -> None:
    text = canonical_json(value)
    assert canonical_json(_reverse_keys(value)) == text
    assert canonical_json(json.loads(text)) == text  # canonical form is a fixed point
