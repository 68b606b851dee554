"""vLLM's structured outputs (``structured_outputs`` and the ``guided_*`` fields): read into
one grammar, refused by name where malformed or combined, and honoured end to end on the demo
model (random weights: whatever it prefers, the grammar decides the shape) on chat and
completions, streamed alike."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import ServerLoop, demo_engine, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.grammar import compiled_grammar
from prefixcache.engine.request import GrammarSpec
from prefixcache.sidecar.server.app import SidecarSettings, create_app
from prefixcache.sidecar.wire.protocol import CompletionRequest, Error, structured_output_of

pytest.importorskip("llguidance")


def spec_of(**fields: Any) -> tuple[GrammarSpec, str] | None:
    return structured_output_of(CompletionRequest(prompt="x", **fields))


def test_each_form_reads_into_its_grammar() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert spec_of(structured_outputs={"json": schema}) == (
        GrammarSpec("json_schema", '{"type":"object","properties":{"b":{},"a":{}}}'),
        "structured_outputs.json",
    )  # the client's key order: the order properties are generated in
    assert spec_of(guided_json=json.dumps(schema))[0] == spec_of(structured_outputs={"json": schema})[0]  # fmt: skip
    assert spec_of(structured_outputs={"json_object": True}) == (GrammarSpec("json"), "structured_outputs.json_object")  # fmt: skip
    assert spec_of(guided_choice=["yes", "no"]) == (GrammarSpec("choice", '["yes", "no"]'), "guided_choice")  # fmt: skip
    assert spec_of(structured_outputs={"regex": "a+"})[0] == GrammarSpec("regex", "a+")
    assert spec_of(guided_grammar='root ::= "a"')[0] == GrammarSpec("grammar", 'root ::= "a"')
    # vLLM's backend options: accepted, nothing to tune here
    tuned = {"choice": ["a"], "disable_fallback": True, "disable_any_whitespace": False}
    assert spec_of(structured_outputs=tuned)[0] == GrammarSpec("choice", '["a"]')
    assert spec_of() is None and spec_of(structured_outputs={}) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["", ""]}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
    ],
)
def test_malformed_or_ambiguous_requests_are_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(Error) as caught:
        spec_of(**fields)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("regex", "(a"), "regular expression"),
        (GrammarSpec("grammar", "root ::= missing"), "grammar"),
        (GrammarSpec("choice", '["a", 1]'), "choices"),
    ],
)
def test_what_llguidance_refuses_names_its_kind(spec: GrammarSpec, words: str) -> None:
    with pytest.raises(ValueError, match=f"the {words} cannot be used"):
        compiled_grammar(spec)


@pytest.fixture(scope="module")
def client(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[openai.OpenAI]:
    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def chat(client: openai.OpenAI, extra: dict, stream: bool = False, **kw: Any) -> tuple[str, str]:
    body: dict[str, Any] = dict(
        model="demo",
        messages=[{"role": "user", "content": "Classify: it was fine."}],
        temperature=0,
        max_tokens=32,
        extra_body=extra,
        **kw,
    )
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


WORDS = st.text(alphabet="abcxyz ,.!", min_size=1, max_size=6)


@settings(max_examples=12, deadline=None)
@given(choices=st.lists(WORDS, min_size=1, max_size=4, unique=True), stream=st.booleans())
def test_a_choice_is_one_of_the_choices(
    client: openai.OpenAI, choices: list[str], stream: bool
) -> None:
    text, reason = chat(client, {"structured_outputs": {"choice": choices}}, stream)
    assert text in choices and reason == "stop"


def test_regex_and_grammar_hold_chat_and_completions_streamed_alike(
    client: openai.OpenAI,
) -> None:
    pattern = r"[0-9]{3}-[a-c]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        text, reason = chat(client, extra)
        assert re.fullmatch(pattern, text) and reason == "stop"
        assert chat(client, extra, stream=True) == (text, reason)
    gbnf = 'root ::= ("yes" | "no") " " [0-9]'
    text, _ = chat(client, {"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"(yes|no) [0-9]", text)
    lark = 'start: "id=" /[a-f]{4}/'
    text, _ = chat(client, {"guided_grammar": lark})
    assert re.fullmatch("id=[a-f]{4}", text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.completions.create(
        model="demo", prompt="n =", max_tokens=24, temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )  # fmt: skip
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text)["n"], int)
    streamed = client.completions.create(
        model="demo", prompt="Code:", max_tokens=16, temperature=0, stream=True,
        extra_body={"guided_regex": pattern},
    )  # fmt: skip
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in streamed if c.choices))


def test_combined_or_refused_constraints_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"guided_choice": ["a"]}, {"response_format": {"type": "json_object"}}, "guided_choice"),
        ({"structured_outputs": {"regex": "(a"}}, {}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= nothing_here"}, {}, "guided_grammar"),
    ]
    for extra, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, extra, **kw)
        assert caught.value.body["param"] == param  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools"):
        chat(client, {"guided_choice": ["a"]}, tools=[tool])
    text, _ = chat(client, {"guided_choice": ["a", "b"]}, tools=[tool], tool_choice="none")
    assert text in ("a", "b")


def test_completions_take_a_response_format_too(client: openai.OpenAI) -> None:
    """vLLM's completions take json_object and json_schema formats; with structured_outputs
    too it is a 400, as on chat."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    out = client.completions.create(
        model="demo", prompt="Answer:", max_tokens=16, temperature=0,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text)["ok"], bool)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="demo", prompt="x", max_tokens=4,
            extra_body={"response_format": fmt, "guided_regex": "a"},
        )  # fmt: skip
    assert caught.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_logprobs_under_a_grammar_are_numbers(client: openai.OpenAI) -> None:
    """A grammar rules tokens out (-inf): they show vLLM's floor -9999.0, never null (no
    JSON number), in chat's and completions' logprobs."""
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Pick."}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    entries = reply.choices[0].logprobs.content
    values = [e.logprob for e in entries] + [t.logprob for e in entries for t in e.top_logprobs]
    assert all(isinstance(v, float) and v >= -9999.0 for v in values)
    assert any(v == -9999.0 for v in values)  # past the first token, the choice is forced
    out = client.completions.create(
        model="demo", prompt="Pick:", max_tokens=4, temperature=0, logprobs=3,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert all(isinstance(v, float) for v in lp.token_logprobs)
    assert all(isinstance(v, float) for top in lp.top_logprobs for v in top.values())
