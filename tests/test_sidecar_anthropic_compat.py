"""The Messages API against Anthropic's documented behaviour, where an outside review found
gaps: consecutive turns of one role combined, the checks Anthropic answers with a 400, the
404 and 405 of other paths and methods in Anthropic's shape, ``Server-Timing``, a forced
tool call cut off by ``max_tokens`` alike streamed or not, and no cache writes reported on
an identical repeat."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import anthropic
import httpx
import pytest
import test_sidecar_anthropic as base
from conftest import Server
from prometheus_client import CollectorRegistry
from sidecar_fake_engine import FakeEngine
from starlette.applications import Starlette
from test_sidecar_anthropic import EPHEMERAL, LOOKUP, QUESTION

from prefixcache.sidecar.anthropic.partial_json import partial_object
from prefixcache.sidecar.http.base_app import build_app
from prefixcache.sidecar.server.app import Sidecar, SidecarSettings

pytest.importorskip("llguidance")

WEATHER = {
    "name": "weather",
    "description": "The weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["paris", "tokyo"]},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


client = base.client  # the module-scoped client fixture of the tests beside these


def post(server: Server, path: str = "/v1/messages", **body: Any) -> httpx.Response:
    body = {"model": "demo", **body}
    return httpx.post(f"{server.root}{path}", json=body, timeout=60)


def count(server: Server, messages: list[dict[str, Any]]) -> int:
    response = post(server, "/v1/messages/count_tokens", messages=messages)
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def text(*parts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": part} for part in parts]


def call(id_: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": id_, "name": "lookup", "input": {"key": "pinning"}}


def result(id_: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": id_, "content": "Pins hold blocks."}


@pytest.mark.parametrize(
    ("split", "combined"),
    [
        (
            [{"role": "user", "content": "First."}, {"role": "user", "content": text("Then.")}],
            [{"role": "user", "content": text("First.", "Then.")}],
        ),
        (
            [
                *QUESTION,
                {"role": "assistant", "content": "One."},
                {"role": "assistant", "content": text("Two.")},
                {"role": "user", "content": "And?"},
            ],
            [
                *QUESTION,
                {"role": "assistant", "content": text("One.", "Two.")},
                {"role": "user", "content": "And?"},
            ],
        ),
        (
            [
                *QUESTION,
                {"role": "assistant", "content": [call("toolu_1")]},
                {"role": "user", "content": [result("toolu_1")]},
                {"role": "user", "content": "Go on."},
            ],
            [
                *QUESTION,
                {"role": "assistant", "content": [call("toolu_1")]},
                {"role": "user", "content": [result("toolu_1"), *text("Go on.")]},
            ],
        ),
    ],
)
def test_consecutive_turns_of_one_role_are_one_turn(
    tools_sidecar: Server, split: list[dict[str, Any]], combined: list[dict[str, Any]]
) -> None:
    assert count(tools_sidecar, split) == count(tools_sidecar, combined)


def test_a_combined_final_assistant_turn_is_the_prefill(tools_sidecar: Server) -> None:
    split = [
        *QUESTION,
        {"role": "assistant", "content": "It"},
        {"role": "assistant", "content": ""},
    ]
    combined = [*QUESTION, {"role": "assistant", "content": "It"}]
    assert count(tools_sidecar, split) == count(tools_sidecar, combined)


def test_an_empty_final_assistant_message_is_no_prefill(tools_sidecar: Server) -> None:
    for empty in ("", []):
        messages = [*QUESTION, {"role": "assistant", "content": empty}]
        assert count(tools_sidecar, messages) == count(tools_sidecar, QUESTION)
        assert post(tools_sidecar, max_tokens=2, messages=messages).status_code == 200


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "user", "content": ""}], "non-empty content"),
        ([{"role": "user", "content": []}], "non-empty content"),
        (
            [*QUESTION, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}],
            "messages.1: all messages must have non-empty content",
        ),
        ([{"role": "user", "content": text("")}], "text content blocks must be non-empty"),
        ([{"role": "user", "content": text("a", "")}], "messages.0.content.1: text content"),
        ([{"role": "user", "content": " \n"}], "must contain non-whitespace text"),
        (
            [*QUESTION, {"role": "assistant", "content": "Sure, "}],
            "final assistant content cannot end with trailing whitespace",
        ),
        (
            [*QUESTION, {"role": "assistant", "content": text("Sure,", "\n")}],
            "final assistant content cannot end with trailing whitespace",
        ),
        (
            [
                *QUESTION,
                {"role": "assistant", "content": [call("toolu_1")]},
                {"role": "user", "content": [*text("here:"), result("toolu_1")]},
            ],
            "messages.2.content.1: tool_result blocks must come before any other content",
        ),
    ],
)
def test_what_anthropic_refuses_is_a_400(
    tools_sidecar: Server, messages: list[dict[str, Any]], words: str
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"messages": messages} | ({"max_tokens": 2} if path == "/v1/messages" else {})
        response = post(tools_sidecar, path, **body)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert words in error["error"]["message"]


@pytest.mark.parametrize(
    "messages",
    [
        [*QUESTION, {"role": "assistant", "content": "Sure,"}],  # no trailing whitespace
        [
            *QUESTION,
            {"role": "assistant", "content": [call("toolu_1"), call("toolu_2")]},  # no `tools`
            {"role": "user", "content": [result("toolu_1"), result("toolu_2"), *text("ok")]},
        ],
    ],
)
def test_what_anthropic_accepts_is_served(
    tools_sidecar: Server, messages: list[dict[str, Any]]
) -> None:
    assert post(tools_sidecar, max_tokens=2, messages=messages).status_code == 200


@contextlib.asynccontextmanager
async def messages_app() -> AsyncIterator[Starlette]:
    """An app over a fake engine whose only routes are the Messages routes, with the app's
    own exception handlers (the OpenAI-shaped 404 and 405 among them)."""
    sidecar = Sidecar(FakeEngine(), SidecarSettings(manage_engine=False))
    await sidecar.engine.start()
    yield build_app(sidecar.anthropic.routes(), CollectorRegistry(), sidecar.lifespan)


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("PUT", "/v1/messages/count_tokens", 405, "invalid_request_error"),
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
        ("GET", "/v1/messages/batches/msgbatch_1/results", 404, "not_found_error"),
    ],
)
async def test_other_paths_and_methods_answer_in_anthropics_shape(
    method: str, path: str, status: int, kind: str
) -> None:
    async with messages_app() as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
            response = await client.request(method, path, json={})
            ok = await client.post("/v1/messages", json={"max_tokens": 1, "messages": QUESTION})
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"]
    if status == 405:
        assert response.headers["allow"] == "POST"
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_non_streamed_messages_carry_server_timing(tools_sidecar: Server) -> None:
    response = post(tools_sidecar, max_tokens=2, messages=QUESTION)
    assert response.status_code == 200, response.text
    timing = response.headers["server-timing"]
    names = [part.split(";")[0] for part in timing.split(", ")]
    assert names == ["queue", "prefill", "decode", "engine"]


def streamed_and_whole(
    client: anthropic.Anthropic, **request: Any
) -> tuple[anthropic.types.Message, anthropic.types.Message, str]:
    """The message streamed (with its input_json_delta text) and not streamed."""
    with client.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    return streamed, client.messages.create(**request), base.input_json_text(events)


def uses(message: anthropic.types.Message) -> list[tuple[str, str, dict]]:
    return [(b.type, getattr(b, "name", ""), getattr(b, "input", {})) for b in message.content]


@pytest.mark.parametrize(
    ("tool", "choice"),
    [
        (WEATHER, {"type": "tool", "name": "weather"}),
        (LOOKUP, {"type": "any", "disable_parallel_tool_use": True}),
    ],
)
def test_a_forced_call_cut_by_max_tokens_is_a_tool_use_streamed_or_not(
    client: anthropic.Anthropic, tool: dict[str, Any], choice: dict[str, Any]
) -> None:
    request = dict(model="demo", messages=QUESTION, tools=[tool], tool_choice=choice)
    request["extra_body"] = {"temperature": 0}
    whole = client.messages.create(max_tokens=64, **request)
    assert whole.stop_reason == "tool_use"
    ((_, name, arguments),) = uses(whole)

    def cut_at(max_tokens: int) -> anthropic.types.Message:
        streamed, cut, partial = streamed_and_whole(client, max_tokens=max_tokens, **request)
        assert streamed.stop_reason == cut.stop_reason
        assert uses(streamed) == uses(cut)  # the same blocks, inputs as far as they came
        if cut.stop_reason == "max_tokens":
            for kind, called, value in uses(cut):
                assert kind == "tool_use" and called == name
                assert value.items() <= arguments.items()
            assert all(b.id.startswith("toolu_") for b in cut.content)
        if choice["type"] == "tool":
            assert [b.type for b in cut.content] == ["tool_use"]
            assert partial_object(partial) == cut.content[0].input
        return cut

    # From the last token back until max_tokens cuts the JSON (tokens may come after it).
    for max_tokens in range(whole.usage.output_tokens - 1, 0, -1):
        late = cut_at(max_tokens)
        if late.stop_reason == "max_tokens":
            break
        assert uses(late) == uses(whole)
    assert late.stop_reason == "max_tokens"
    assert next(iter(arguments)) in late.content[0].input  # its first argument came whole
    assert cut_at(3).stop_reason == "max_tokens"


def test_a_forced_call_cut_by_a_stop_sequence_says_so_streamed_or_not(
    client: anthropic.Anthropic,
) -> None:
    """Not ``tool_use`` with an empty input: the stop sequence that cut the call's JSON, and
    the input as far as it came."""
    request = dict(
        model="demo",
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "weather"},
        stop_sequences=['"unit"'],  # always written: the second required property
        max_tokens=64,
        extra_body={"temperature": 0},
    )
    streamed, whole, partial = streamed_and_whole(client, **request)
    for message in (streamed, whole):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == '"unit"'
        assert [b.type for b in message.content] == ["tool_use"]
        assert "unit" not in message.content[0].input
    assert uses(streamed) == uses(whole)
    assert partial_object(partial) == whole.content[0].input


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"city": "paris", "unit": "cel', {"city": "paris"}),
        ('{"city": "paris", "un', {"city": "paris"}),
        ('{"n": [1, 2.5, {"a": null', {"n": [1, 2.5, {"a": None}]}),
        ('{"n": 1.', {}),
        ('{"n": tr', {}),
        ('{"a": {"b": "x\\"y"}, "c": -3e2', {"a": {"b": 'x"y'}, "c": -300.0}),
        ("", {}),
        ("[1, 2", {}),  # not an object
    ],
)
def test_partial_arguments_read_as_far_as_they_came(text: str, value: dict[str, Any]) -> None:
    assert partial_object(text) == value


@pytest.mark.parametrize("pad", range(6))
def test_an_identical_repeat_writes_nothing_to_the_cache(
    client: anthropic.Anthropic, pad: int
) -> None:
    """Wherever the breakpoint falls (here in the prompt's last, partial block, for most pads),
    the repeat reads all that the first request wrote."""
    messages = [{"role": "user", "content": f"Q {uuid.uuid4().hex}: " + "more " * pad}]
    request = dict(model="demo", max_tokens=1, system="sys", messages=messages)
    first = client.messages.create(**request, cache_control=EPHEMERAL)
    repeat = client.messages.create(**request, cache_control=EPHEMERAL)
    prefix = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert repeat.usage.cache_creation_input_tokens == 0
    assert repeat.usage.cache_read_input_tokens == prefix > 0
    assert repeat.usage.input_tokens == first.usage.input_tokens
    counted = client.messages.count_tokens(model="demo", system="sys", messages=messages)
    assert prefix + first.usage.input_tokens == counted.input_tokens


def test_the_sdks_tool_runner_gets_a_thread_refusal_it_recovers_from(tools_sidecar: Server) -> None:
    """Anthropic's tool runner sends ``thread`` (a conversation the server holds) and then only
    the new messages. The server ignored ``thread``, so the second turn lost its history and
    tools (a 400 about ``tool_choice``, or an answer without the conversation). Now a ``thread``
    is refused with the code the SDK reads, and the runner sends the whole history itself."""
    sdk = anthropic.Anthropic(base_url=tools_sidecar.root, api_key="unused", max_retries=0)

    @anthropic.beta_tool
    def weather(city: Literal["paris", "tokyo"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather of a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return f"21 degrees {unit} in {city}"

    runner = sdk.beta.messages.tool_runner(
        model="demo",
        max_tokens=48,
        tools=[weather],
        tool_choice={"type": "tool", "name": "weather"},
        messages=QUESTION,
        max_iterations=2,
    )
    replies = list(runner)
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"]

    response = post(tools_sidecar, max_tokens=2, messages=QUESTION, thread={"type": "create"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["details"] == {"error_code": "thread_unsupported_request"}
    assert "'thread'" in error["message"]
    for off in (None, False):
        assert post(tools_sidecar, max_tokens=2, messages=QUESTION, thread=off).status_code == 200
