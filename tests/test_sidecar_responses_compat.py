"""The Responses API against OpenAI's reference, where an outside review found gaps: item
statuses of an incomplete response, the ``tool_choice`` echo, errors naming Responses fields,
orphan ``function_call_output`` items, in-stream failures of invalid requests, the
``Server-Timing`` header, and a forced call cut off by ``max_output_tokens``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import test_sidecar_responses as base
from conftest import Server
from test_sidecar_responses import LOOKUP

pytest.importorskip("llguidance")

NAMED = {"type": "function", "name": "lookup"}


client = base.client  # the module-scoped client fixture of the tests beside these


def post(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/responses", json={"model": "demo", **body}, timeout=60)


def test_an_incomplete_response_marks_its_message_incomplete(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model="demo", input="Tell me a story.", max_output_tokens=3, temperature=0
    )
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete"
    assert [(item.type, item.status) for item in whole.output] == [("message", "incomplete")]
    events = list(client.responses.create(stream=True, **ask))
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


def test_a_completed_response_keeps_its_message_completed(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "name": "ok", "schema": schema}
    ask: dict[str, Any] = dict(
        model="demo", input="JSON.", max_output_tokens=64, text={"format": fmt}, temperature=0
    )
    whole = client.responses.create(**ask)
    assert whole.status == "completed" and whole.output[0].status == "completed"
    streamed = list(client.responses.create(stream=True, **ask))[-1].response
    assert streamed.status == "completed" and streamed.output[0].status == "completed"


def test_tool_choice_is_echoed_or_defaults_to_auto(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="demo", input="Hi", max_output_tokens=1)
    assert plain.tool_choice == "auto"
    none = client.responses.create(
        model="demo", input="Hi", max_output_tokens=1, tool_choice="none"
    )
    assert none.tool_choice == "none"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens="),
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "nope"},
                ]
            },
            "input[1].arguments",
            "JSON text of an object",
        ),
        ({"input": "x" * 20000}, "input", "context length"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": []}}},
            "text.format.schema",
            "",
        ),
    ],
)
def test_errors_name_the_responses_fields(
    tools_sidecar: Server, body: dict, param: str, words: str
) -> None:
    response = post(tools_sidecar, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "max_tokens" not in error["message"] and "messages" not in error["message"]


def test_an_orphan_function_call_output_is_refused(tools_sidecar: Server) -> None:
    orphan = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}
    response = post(tools_sidecar, input=[orphan], max_output_tokens=2)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    assert error["message"] == "No tool call found for function call output with call_id call_nope."
    call = {"type": "function_call", "call_id": "call_nope", "name": "lookup", "arguments": "{}"}
    answered = post(tools_sidecar, input=[call, orphan], max_output_tokens=2)
    assert answered.status_code == 200, answered.text


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}}


def test_an_unusable_schema_fails_as_the_clients_error(
    client: openai.OpenAI, tools_sidecar: Server
) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}
    whole = post(tools_sidecar, input="hi", max_output_tokens=4, text={"format": fmt})
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["type"] == "invalid_request_error"
    assert whole.json()["error"]["param"] == "text.format"
    with pytest.raises(openai.BadRequestError) as refused:  # streamed: before the stream
        client.responses.create(
            model="demo", input="hi", max_output_tokens=4, stream=True, text={"format": fmt}
        )
    assert refused.value.body["param"] == "text.format"  # type: ignore[index]
    assert "schema" in refused.value.body["message"]  # type: ignore[index]


def test_non_streamed_responses_carry_server_timing(tools_sidecar: Server) -> None:
    response = post(tools_sidecar, input="hi", max_output_tokens=2)
    assert response.status_code == 200, response.text
    timing = response.headers["server-timing"]
    assert [part.split(";")[0] for part in timing.split(", ")] == [
        "queue",
        "prefill",
        "decode",
        "engine",
    ]


def shapes(output: list[Any]) -> list[tuple[str, str, str, str]]:
    return [(item.type, item.status, item.name, item.arguments) for item in output]


# Cut points of the demo model's forced output: in the list's first name (no call yet), in
# the arguments, after a whole call (before the list's "]" or the end of turn).
@pytest.mark.parametrize(
    ("choice", "limit"),
    [("required", 2), ("required", 15), ("required", 19), (NAMED, 1), (NAMED, 3), (NAMED, 6)],
)
def test_a_forced_call_cut_off_is_a_function_call_streamed_or_not(
    client: openai.OpenAI, choice: Any, limit: int
) -> None:
    ask: dict[str, Any] = dict(
        model="demo",
        input="Look it up.",
        tools=[LOOKUP],
        tool_choice=choice,
        max_output_tokens=limit,
        temperature=0,
    )
    whole = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))  # .stream() wants "completed"
    streamed = events[-1].response
    assert whole.status == streamed.status == "incomplete"
    assert shapes(whole.output) == shapes(streamed.output)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert shapes(done) == shapes(streamed.output)
    assert len(whole.output) == (0 if limit == 2 else 1), whole.output
    for item in whole.output:
        assert item.type == "function_call" and item.call_id.startswith("call_")
        assert item.name == "lookup" and not item.arguments.lstrip().startswith("[")
        assert '"name"' not in item.arguments and '"parameters"' not in item.arguments
        assert item.status == ("completed" if _parses(item.arguments) else "incomplete")


def test_a_named_call_cut_off_keeps_its_arguments_as_generated(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model="demo", input="Look it up.", tools=[LOOKUP], tool_choice=NAMED, temperature=0
    )
    full = client.responses.create(max_output_tokens=64, **ask)
    assert full.status == "completed" and full.output[0].status == "completed"
    cut = client.responses.create(max_output_tokens=4, **ask)
    (call,) = cut.output
    assert call.status == "incomplete" and call.arguments
    assert json.loads(full.output[0].arguments) and not _parses(call.arguments)
    compact = full.output[0].arguments.replace(" ", "")
    assert compact.startswith(call.arguments.replace(" ", ""))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_the_response_reports_the_sampling_it_ran_with(client: openai.OpenAI) -> None:
    """OpenAI reports the temperature and top_p it used, not null where the request left
    them out: here the demo model's (no generation_config.json: OpenAI's 1.0 and 1.0)."""
    unset = client.responses.create(model="demo", input="Hi", max_output_tokens=2)
    assert (unset.temperature, unset.top_p) == (1.0, 1.0)
    given = client.responses.create(
        model="demo", input="Hi", max_output_tokens=2, temperature=0.25, top_p=0.5
    )
    assert (given.temperature, given.top_p) == (0.25, 0.5)
