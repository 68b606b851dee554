"""Bad input never reaches the engine: every item of the corpus gets a 4xx in OpenAI shape.

The corpus runs against the app over the fake engine (which records every request that
reaches it) and against the real server on the demo model (which must stay healthy with no
KV block in use afterwards).
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import Server, wait_for_idle_blocks

MARK = "SECRET-MARK-7f3a"  # must never come back in an error message
USER = {"role": "user", "content": f"hello {MARK}"}


def called(arguments: str) -> dict:
    """An assistant turn with one tool call whose arguments are ``arguments`` (text)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "42"}


def chat(**fields) -> bytes:
    return json.dumps({"messages": [USER], "max_tokens": 4, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"prompt": f"hi {MARK}", "max_tokens": 4, **fields}).encode()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# (name, method, path, body, expected status)
CORPUS: list[tuple[str, str, str, bytes | None, int]] = [
    (
        "malformed json",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x' + MARK.encode(),
        400,
    ),
    ("empty body", "POST", CHAT, b"", 400),
    ("not an object", "POST", CHAT, b"[1, 2, 3]", 400),
    ("messages not a list", "POST", CHAT, json.dumps({"messages": MARK}).encode(), 400),
    ("max_tokens as string", "POST", CHAT, chat(max_tokens="10"), 400),
    ("temperature as string", "POST", CHAT, chat(temperature="hot"), 400),
    ("stream as string", "POST", CHAT, chat(stream="yes"), 400),
    (
        "content as number",
        "POST",
        CHAT,
        json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
        400,
    ),
    (
        "unknown role",
        "POST",
        CHAT,
        json.dumps({"messages": [{"role": MARK, "content": "x"}]}).encode(),
        400,
    ),
    ("empty messages", "POST", CHAT, json.dumps({"messages": []}).encode(), 400),
    ("no messages or segments", "POST", CHAT, json.dumps({"max_tokens": 3}).encode(), 400),
    (
        "messages and segments",
        "POST",
        CHAT,
        chat(segments=[{"role": "user", "content": "x", "tag": "t"}]),
        400,
    ),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-1), 400),
    ("zero max_tokens", "POST", CHAT, chat(max_tokens=0), 400),
    ("huge max_tokens", "POST", CHAT, chat(max_tokens=10**9), 400),
    ("max_tokens beyond int64", "POST", CHAT, chat(max_tokens=10**30), 400),
    ("huge max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=10**6), 400),
    ("negative temperature", "POST", CHAT, chat(temperature=-0.5), 400),
    ("temperature too high", "POST", CHAT, chat(temperature=7), 400),
    ("negative top_p", "POST", CHAT, chat(top_p=-0.1), 400),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), 400),
    ("negative top_k", "POST", CHAT, chat(top_k=-3), 400),
    (
        "tools",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": MARK}}] * 2),
        400,
    ),
    (
        "json_schema without a schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
    ),
    (
        "tool_choice naming no tool",
        "POST",
        CHAT,
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
    ),
    ("logit_bias key not an id", "POST", COMPLETIONS, completion(logit_bias={"a": 1}), 400),
    ("logit_bias over 100", "POST", COMPLETIONS, completion(logit_bias={"1": 101}), 400),
    ("n=0", "POST", CHAT, chat(n=0), 400),
    ("n over 128", "POST", COMPLETIONS, completion(n=129), 400),
    ("top_logprobs too many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400),
    ("presence_penalty out of range", "POST", CHAT, chat(presence_penalty=2.5), 400),
    ("repetition_penalty zero", "POST", CHAT, chat(repetition_penalty=0), 400),
    ("seed below int64", "POST", CHAT, chat(seed=-(2**63) - 1), 400),
    ("too many stops", "POST", CHAT, chat(stop=[f"s{i}" for i in range(20)]), 400),
    ("empty stop string", "POST", CHAT, chat(stop=""), 400),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
    ),
    (
        "over-context prompt",
        "POST",
        CHAT,
        json.dumps({"messages": [{"role": "user", "content": "hello world " * 1200}]}).encode(),
        400,
    ),
    (
        "invalid utf-8",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}',
        400,
    ),
    (
        "lone surrogate",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
    ),
    ("salt with space", "POST", CHAT, chat(cache_salt="two words"), 400),
    ("empty salt", "POST", CHAT, chat(cache_salt=""), 400),
    ("salt too long", "POST", CHAT, chat(cache_salt="x" * 300), 400),
    ("salt non-ascii", "POST", CHAT, chat(cache_salt="sälz"), 400),
    ("salt as number", "POST", CHAT, chat(cache_salt=12), 400),
    (
        "duplicate tags",
        "POST",
        CHAT,
        json.dumps(
            {
                "segments": [
                    {"role": "system", "content": "a", "tag": "t"},
                    {"role": "user", "content": "b", "tag": "t"},
                ]
            }
        ).encode(),
        400,
    ),
    (
        "empty tag",
        "POST",
        CHAT,
        json.dumps({"segments": [{"role": "user", "content": "a", "tag": ""}]}).encode(),
        400,
    ),
    (
        "bad stability",
        "POST",
        CHAT,
        json.dumps(
            {"segments": [{"role": "user", "content": "a", "tag": "t", "stability": "forever"}]}
        ).encode(),
        400,
    ),
    ("unknown model", "POST", CHAT, chat(model="gpt-" + MARK), 404),
    ("empty token list", "POST", COMPLETIONS, completion(prompt=[]), 400),
    ("ints and strings mixed", "POST", COMPLETIONS, completion(prompt=[5, "b"]), 400),
    ("batch times n over 128", "POST", COMPLETIONS, completion(prompt=["a"] * 65, n=2), 400),
    ("negative token id", "POST", COMPLETIONS, completion(prompt=[1, -5]), 400),
    ("token id over vocab", "POST", COMPLETIONS, completion(prompt=[1, 10**8]), 400),
    ("completion suffix", "POST", COMPLETIONS, completion(suffix="tail"), 400),
    ("vLLM guided_json not an object", "POST", CHAT, chat(guided_json=[MARK]), 400),
    ("vLLM guided_choice empty", "POST", COMPLETIONS, completion(guided_choice=[]), 400),
    (
        "two vLLM constraints",
        "POST",
        CHAT,
        chat(guided_regex="a", structured_outputs={"choice": ["b"]}),
        400,
    ),
    ("vLLM structural_tag", "POST", CHAT, chat(structured_outputs={"structural_tag": MARK}), 400),
    ("vLLM regex that is none", "POST", COMPLETIONS, completion(guided_regex="(unclosed"), 400),
    ("vLLM beam search", "POST", COMPLETIONS, completion(use_beam_search=True), 400),
    ("min_p over 1", "POST", CHAT, chat(min_p=1.5), 400),
    ("min_tokens over max_tokens", "POST", COMPLETIONS, completion(min_tokens=5), 400),
    ("echo as a string", "POST", COMPLETIONS, completion(echo="yes"), 400),
    ("completion huge max_tokens", "POST", COMPLETIONS, completion(max_tokens=10**9), 400),
    ("unknown route", "POST", "/v1/embeddings", chat(), 404),
    ("wrong method", "GET", CHAT, None, 405),
    (
        "both continue_final_message and add_generation_prompt",
        "POST",
        CHAT,
        chat(continue_final_message=True),
        400,
    ),
    (
        "chat_template_kwargs sets a reserved name",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"messages": [MARK]}),
        400,
    ),
    ("chat_template_kwargs not an object", "POST", CHAT, chat(chat_template_kwargs=[MARK]), 400),
    (
        "continue_final_message with segments",
        "POST",
        CHAT,
        json.dumps(
            {
                "segments": [{"role": "assistant", "content": "a", "tag": "t"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            }
        ).encode(),
        400,
    ),
    ("stop_token_ids negative", "POST", CHAT, chat(stop_token_ids=[-1]), 400),
    ("stop_token_ids over the vocabulary", "POST", CHAT, chat(stop_token_ids=[10**9]), 400),
    (
        "warm: all dynamic",
        "POST",
        "/v1/cache/warm",
        json.dumps({"segments": [{"role": "user", "content": "a", "tag": "t"}]}).encode(),
        400,
    ),
    (
        "warm: bad salt",
        "POST",
        "/v1/cache/warm",
        json.dumps({"messages": [USER], "cache_salt": "a/b"}).encode(),
        400,
    ),
    *(
        (f"{where}: tool call arguments {arguments!r}", "POST", path, body(arguments), 400)
        for arguments in ("not json", '{"a": NaN}', "[1, 2]", '{"a": -Infinity}')
        for where, path, body in (
            ("chat", CHAT, lambda a: chat(messages=[USER, called(a)])),
            (
                "warm",
                "/v1/cache/warm",
                lambda a: json.dumps({"messages": [USER, called(a)]}).encode(),
            ),
            (
                "unpin",
                "/v1/cache/unpin",
                lambda a: json.dumps({"messages": [USER, called(a)]}).encode(),
            ),
        )
    ),
    ("evict: a misspelt field", "POST", "/v1/cache/evict", b'{"include_pined": true}', 400),
    # vLLM's reset takes its two booleans as query parameters, and no body
    ("reset: no boolean", "POST", f"/reset_prefix_cache?reset_external={MARK}", None, 400),
    ("reset: an unknown query parameter", "POST", f"/reset_prefix_cache?{MARK}=1", None, 400),
    ("reset: vLLM's old device", "POST", "/reset_prefix_cache?device=gpu", None, 400),
    (
        "reset: preempting running requests",
        "POST",
        "/reset_prefix_cache?reset_running_requests=true",
        None,
        400,
    ),
    ("reset: a body", "POST", "/reset_prefix_cache", b'{"include_pinned": true}', 400),
    ("reset: a body that is no object", "POST", "/reset_prefix_cache", b"[1]", 400),
    (
        "warm: a misspelt field",
        "POST",
        "/v1/cache/warm",
        json.dumps({"messages": [USER], "pinned": True}).encode(),
        400,
    ),
    # OpenAI's rule: a tool message answers a call of the assistant message before it
    *(
        (f"chat: {name}", "POST", CHAT, chat(messages=[USER, *turns]), 400)
        for name, turns in (
            ("a tool result with no call before it", [TOOL_RESULT]),
            (
                "a tool result for another call id",
                [called('{"a": 1}'), {**TOOL_RESULT, "tool_call_id": "call_zzz"}],
            ),
            ("a tool result after a user turn", [called('{"a": 1}'), USER, TOOL_RESULT]),
        )
    ),
    (
        "warm: a tool message without tool_call_id",
        "POST",
        "/v1/cache/warm",
        json.dumps({"messages": [USER, {"role": "tool", "content": "x"}]}).encode(),
        400,
    ),
]


def check_error_shape(response: httpx.Response, expected: int) -> None:
    assert response.status_code == expected, response.text
    assert MARK not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


# Bad where the tokenizer adds no start token (the demo model's): "" leaves no token. Where
# it adds one (the fake engine's, Gemma's), "" is that token (tests/test_gguf.py).
NO_START_TOKEN: list[tuple[str, str, str, bytes | None, int]] = [
    ("empty prompt", "POST", COMPLETIONS, completion(prompt=""), 400),
    ("an empty prompt in a batch", "POST", COMPLETIONS, completion(prompt=["a", ""]), 400),
]


def run_corpus(server: Server, max_body: int, extra: list | None = None) -> None:
    with httpx.Client(base_url=server.root, timeout=30) as client:
        for name, method, path, body, expected in CORPUS + (extra or []):
            headers = {"content-type": "application/json"}
            response = client.request(method, path, content=body, headers=headers)
            try:
                check_error_shape(response, expected)
            except AssertionError as exc:
                raise AssertionError(f"corpus item {name!r}: {exc}") from None
        # A body over the limit is refused with 413 without being read to the end.
        big = b'{"messages": [{"role": "user", "content": "' + b"x" * (10 * 1024**2) + b'"}]}'
        assert len(big) > max_body
        check_error_shape(client.post(CHAT, content=big), 413)
        assert client.get("/health").json() == {"status": "ok"}


def test_bad_inputs_never_reach_the_engine(fake_server: Server) -> None:
    engine = fake_server.app.state.sidecar.engine
    before = len(engine.received)  # the server is shared by the session's tests
    run_corpus(fake_server, max_body=65536)
    assert engine.received[before:] == []
    # Control: a valid request does reach it (so the assertion above can fail).
    ok = httpx.post(f"{fake_server.url}/chat/completions", content=chat(), timeout=10)
    assert ok.status_code == 200 and len(engine.received) == before + 1


@pytest.mark.timeout(120)
def test_bad_inputs_leave_the_real_server_healthy(sidecar_server: Server) -> None:
    run_corpus(sidecar_server, max_body=4 * 1024**2, extra=NO_START_TOKEN)
    stats = wait_for_idle_blocks(sidecar_server.root)
    assert stats["blocks"]["in_use"] == 0
    ok = httpx.post(f"{sidecar_server.url}/chat/completions", content=chat(), timeout=60)
    assert ok.status_code == 200, ok.text


def test_chunked_body_over_the_limit_is_refused_while_reading(fake_server: Server) -> None:
    """No Content-Length: the limit is enforced on the bytes as they arrive."""

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 4096  # 160 KiB in all, the fake server's limit is 64 KiB
        yield b'"}]}'

    response = httpx.post(f"{fake_server.url}/chat/completions", content=chunks(), timeout=10)
    check_error_shape(response, 413)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": MARK}}]}]},
            "messages[0].content[0].type",
            "image content parts are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[0].type",
            "audio content parts",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": MARK}]}]},
            "messages[1].content[0].type",
            "refusal content parts",
        ),
        ({"messages": [{"role": "function", "name": "f", "content": MARK}]}, "messages[0].role", "'function' role"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "custom tools"),
        ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.type", "allowed_tools"),
    ],
)  # fmt: skip
def test_openai_names_not_served_are_said_plainly(
    fake_server: Server, fields: dict, param: str, words: str
) -> None:
    """What OpenAI accepts and this server does not serve is named in the 400 (not a bare
    "Invalid value"), from the server's own words: nothing of the body comes back."""
    response = httpx.post(f"{fake_server.url}/chat/completions", content=chat(**fields), timeout=10)
    check_error_shape(response, 400)
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert MARK not in response.text
