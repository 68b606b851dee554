"""OpenAI and Anthropic request shapes, checked by mock servers that enforce the documented
fields (hosted APIs cannot be reached from tests)."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import httpx
import pytest

from prefixcache.sdk import AsyncClient, Prompt, Segment

OPENAI_TOP_LEVEL = {
    "model", "messages", "tools", "tool_choice", "prompt_cache_key", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
    "stream_options", "n", "user", "parallel_tool_calls", "response_format",
}  # fmt: skip
ANTHROPIC_TOP_LEVEL = {
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature",
    "top_p", "top_k", "stop_sequences", "stream", "metadata",
}  # fmt: skip


def _prompt() -> Prompt:
    return (
        Prompt.builder()
        .tool(
            "get_order",
            "Fetch an order by id.",
            {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
        )
        .static("You are Acme's support assistant.", tag="rules")
        .static("Answer in English.", tag="lang")
        .shared("Refund policy: 30 days.", tag="doc:refunds")
        .shared("Shipping policy: 5 days.", tag="doc:shipping")
        .session("Where is my order?", tag="t1")
        .session("Which order id?", tag="t2", role="assistant")
        .session("It is A-17.", tag="t3")
        .dynamic("Also, can I return it?", tag="q")
        .build()
    )


def _check_openai(body: dict[str, Any]) -> None:
    assert set(body) <= OPENAI_TOP_LEVEL, set(body) - OPENAI_TOP_LEVEL
    assert isinstance(body["model"], str)
    for m in body["messages"]:
        assert set(m) <= {"role", "content", "name"}
        assert m["role"] in {"system", "developer", "user", "assistant"}
        assert isinstance(m["content"], str) and m["content"]
    for t in body.get("tools", []):
        assert t["type"] == "function" and set(t["function"]) <= {
            "name",
            "description",
            "parameters",
        }
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", t["function"]["name"])
    key = body.get("prompt_cache_key")
    assert key is None or (isinstance(key, str) and 0 < len(key) <= 64)


def _openai_handler(seen: list[dict[str, Any]]):
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        _check_openai(body)
        seen.append(body)
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "system_fingerprint": "fp_x",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "Yes.", "refusal": None},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": 1200,
                    "completion_tokens": 2,
                    "total_tokens": 1202,
                    "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
                    "completion_tokens_details": {"reasoning_tokens": 0},
                },
            },
        )

    return handle


def _check_anthropic(body: dict[str, Any]) -> None:
    assert set(body) <= ANTHROPIC_TOP_LEVEL, set(body) - ANTHROPIC_TOP_LEVEL
    assert isinstance(body["model"], str) and isinstance(body["max_tokens"], int)
    blocks: list[dict[str, Any]] = []
    for t in body.get("tools", []):
        assert set(t) <= {"name", "description", "input_schema", "cache_control"}
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", t["name"])
        assert t["input_schema"]["type"] == "object"
        blocks.append(t)
    for b in body.get("system", []):
        assert b["type"] == "text" and b["text"]
        blocks.append(b)
    assert body["messages"], "messages must not be empty"
    for m in body["messages"]:
        assert set(m) == {"role", "content"} and m["role"] in {"user", "assistant"}
        for b in m["content"]:
            assert set(b) <= {"type", "text", "cache_control"}
            assert b["type"] == "text" and b["text"]
            blocks.append(b)
    marked = [b["cache_control"] for b in blocks if "cache_control" in b]
    assert len(marked) <= 4
    assert all(c["type"] == "ephemeral" and set(c) <= {"type", "ttl"} for c in marked)


def _anthropic_handler(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/v1/messages"
    assert request.headers["anthropic-version"] and request.headers["x-api-key"]
    body = json.loads(request.content)
    _check_anthropic(body)
    return httpx.Response(
        200,
        json={
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [{"type": "text", "text": "Yes."}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 0},
        },
    )


def test_openai_request_shape_and_prompt_cache_key() -> None:
    p = _prompt()
    body = p.to_openai(model="gpt-4o-mini", max_tokens=16)
    _check_openai(body)
    assert [m["content"] for m in body["messages"]][:2] == [
        "You are Acme's support assistant.",
        "Answer in English.",
    ]
    assert body["messages"][-1]["content"] == "Also, can I return it?"
    assert body["prompt_cache_key"] == p.fingerprint().cache_key("shared")
    assert body["tools"][0]["function"]["parameters"]["required"] == ["id"]
    assert "prompt_cache_key" not in p.to_openai(model="m", cache_key_through=None)
    seen: list[dict[str, Any]] = []
    with httpx.Client(transport=httpx.MockTransport(_openai_handler(seen))) as http:
        r = http.post("https://api.openai.com/v1/chat/completions", json=body)
    assert r.status_code == 200 and seen == [body]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_client_against_foreign_openai_server_parses_without_cache_report(backend: str) -> None:
    seen: list[dict[str, Any]] = []

    async def main() -> None:
        async with AsyncClient(
            "https://api.openai.com/v1",
            "sk-test",
            model="gpt-4o-mini",
            send_segments=False,
            transport=httpx.MockTransport(_openai_handler(seen)),
        ) as client:
            out = await client.complete(_prompt(), max_tokens=8)
        assert out.text == "Yes." and out.finish_reason == "stop"
        assert out.usage.cached_tokens == 1024 and out.usage.prompt_tokens == 1200
        assert out.cache is None

    anyio.run(main, backend=backend)
    assert "segments" not in seen[0] and seen[0]["prompt_cache_key"].startswith("pc-")
    assert seen[0]["max_tokens"] == 8 and seen[0]["stream"] is False


def test_anthropic_request_shape_and_breakpoints() -> None:
    body = _prompt().to_anthropic(model="claude-sonnet-4-5", max_tokens=64)
    _check_anthropic(body)
    assert [b["text"] for b in body["system"]] == [
        "You are Acme's support assistant.",
        "Answer in English.",
    ]
    assert body["tools"][0]["name"] == "get_order" and "cache_control" not in body["tools"][0]
    # breakpoints: end of static (last system block), end of shared, end of session
    assert "cache_control" not in body["system"][0]
    assert body["system"][1]["cache_control"] == {"type": "ephemeral"}
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user"]
    first, _, last = body["messages"]
    assert [("cache_control" in b) for b in first["content"]] == [False, True, False]
    assert [b["text"] for b in last["content"]] == ["It is A-17.", "Also, can I return it?"]
    assert "cache_control" in last["content"][0] and "cache_control" not in last["content"][1]
    with httpx.Client(transport=httpx.MockTransport(_anthropic_handler)) as http:
        r = http.post(
            "https://api.anthropic.com/v1/messages",
            json=body,
            headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
        )
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Yes."


def test_anthropic_tools_only_static_gets_breakpoint_on_last_tool() -> None:
    p = Prompt(
        [Segment("user", "Q", "q", "dynamic")],
        tools=[],
    )
    body = p.to_anthropic(model="m", max_tokens=8)
    _check_anthropic(body)
    assert "cache_control" not in json.dumps(body)  # nothing stable, no breakpoint
    p = Prompt.builder().tool("a", "A", {"type": "object"}).tool("b", "B", {"type": "object"})
    body = p.dynamic("Q", tag="q").build().to_anthropic(model="m", max_tokens=8, ttl="1h")
    _check_anthropic(body)
    assert "cache_control" not in body["tools"][0]
    assert body["tools"][1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_anthropic_late_system_segment_becomes_user_block_in_place() -> None:
    p = Prompt(
        [
            Segment("system", "Rules.", "rules", "static"),
            Segment("user", "History.", "h", "session"),
            Segment("system", "Reply in French this time.", "hint", "dynamic"),
        ]
    )
    body = p.to_anthropic(model="m", max_tokens=8)
    _check_anthropic(body)
    assert [b["text"] for b in body["system"]] == ["Rules."]
    assert [b["text"] for b in body["messages"][0]["content"]] == [
        "History.",
        "Reply in French this time.",
    ]
    with pytest.raises(ValueError, match="user or assistant"):
        Prompt([Segment("system", "only", "s", "static")]).to_anthropic(model="m", max_tokens=8)


def test_anthropic_never_more_than_four_breakpoints_nor_on_dynamic() -> None:
    segs = [Segment("system", f"s{i}", f"s{i}", "static") for i in range(3)]
    segs += [Segment("user", f"d{i}", f"d{i}", "shared") for i in range(3)]
    segs += [Segment("user", f"h{i}", f"h{i}", "session") for i in range(3)]
    segs += [Segment("user", f"q{i}", f"q{i}", "dynamic") for i in range(3)]
    body = Prompt(segs).to_anthropic(model="m", max_tokens=8)
    _check_anthropic(body)
    blocks = body["system"] + [b for m in body["messages"] for b in m["content"]]
    marked = [b["text"] for b in blocks if "cache_control" in b]
    assert marked == ["s2", "d2", "h2"]
