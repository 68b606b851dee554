"""vLLM's extra request fields on /v1/chat/completions and /v1/completions: honoured
(add_special_tokens, documents, echo on chat, skip_special_tokens, truncate_prompt_tokens
where it cuts nothing), refused by name where ignoring them would change the tokens or the
reply, and ignored where that changes nothing. In-process over the fake engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sidecar_fake_engine import BOS, FakeEngine, FakeTokenizer

from prefixcache.sidecar.server.app import SidecarSettings, create_app
from prefixcache.sidecar.wire.protocol import (
    UNSERVED_CHAT,
    UNSERVED_COMPLETION,
    UNSERVED_SAMPLING,
)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "What is a radix tree?"}]
PREFILLED = [*USER, {"role": "assistant", "content": "A trie whose"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
ASKING = {  # a value of each unserved field that asks for something
    "use_beam_search": True,
    "logprob_token_ids": [5],
    "watermarking": True,
    "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 0,
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "chat_template": "{{ messages[0]['content'] }}",
    "media_io_kwargs": {"image": {"x": 1}},
    "mm_processor_kwargs": {"num_crops": 4},
    "return_prompt_text": True,
    "prompt_embeds": "AAAA",
}
# vLLM fields ignored here because ignoring them changes nothing the client gets
HARMLESS = {
    "request_id": "client-chosen-id",
    "session_id": "s-1",
    "spaces_between_special_tokens": False,
    "vllm_xargs": {"k": "v"},
    "stream_interval": 4,
    "include_reasoning": False,
    "length_penalty": 1.5,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "routed_experts_prompt_start": 2,
    "return_tokens_as_token_ids": True,  # harmless without logprobs
    "truncation_side": "left",
}


class DocumentsTokenizer(FakeTokenizer):
    """The fake template, with vLLM's ``documents`` written before the conversation."""

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        docs = "".join(f"<doc {d['title']}>{d['text']}</doc>\n" for d in extra.get("documents", []))
        return docs + super().apply_chat_template(messages, add_generation_prompt)


@pytest.fixture
async def engine() -> FakeEngine:
    engine = FakeEngine(max_model_len=256)
    await engine.start()
    return engine


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        yield client


def routes_of(field: str) -> list[str]:
    if field in UNSERVED_SAMPLING:
        return [CHAT, COMPLETIONS]
    return [CHAT] if field in UNSERVED_CHAT else [COMPLETIONS]


def body_for(route: str, **fields: Any) -> dict[str, Any]:
    prompt = {"messages": USER} if route == CHAT else {"prompt": "What is a radix tree?"}
    return {**prompt, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("route", "field"),
    [(route, field) for field in ASKING for route in routes_of(field)],
)
async def test_fields_that_would_change_the_reply_are_refused_by_name(
    engine: FakeEngine, client: httpx.AsyncClient, route: str, field: str
) -> None:
    response = await client.post(route, json=body_for(route, **{field: ASKING[field]}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "not supported" in error["message"]
    assert engine.received == []


def test_every_unserved_field_is_tested() -> None:
    assert set(ASKING) == {*UNSERVED_SAMPLING, *UNSERVED_CHAT, *UNSERVED_COMPLETION}


async def test_values_that_ask_nothing_and_harmless_fields_pass(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    inert = [None, False, [], {}]
    for route in (CHAT, COMPLETIONS):
        tables = [UNSERVED_SAMPLING, UNSERVED_CHAT if route == CHAT else UNSERVED_COMPLETION]
        for value in inert:
            fields = {name: value for table in tables for name in table}
            response = await client.post(route, json=body_for(route, **fields, **HARMLESS))
            assert response.status_code == 200, (route, value, response.text)
        extra = {"thinking_token_budget": -1}  # vLLM's "unlimited"
        if route == COMPLETIONS:
            extra["response_format"] = {"type": "text"}
        response = await client.post(route, json=body_for(route, **extra))
        assert response.status_code == 200, response.text
    chat_id = (await client.post(CHAT, json=body_for(CHAT, **HARMLESS))).json()["id"]
    assert chat_id.startswith("chatcmpl-") and "client-chosen-id" not in chat_id


@pytest.mark.parametrize(
    ("route", "logprobs"),
    [(CHAT, {"logprobs": True}), (COMPLETIONS, {"logprobs": 0}), (CHAT, {"prompt_logprobs": 0})],
)
async def test_tokens_as_token_ids_are_refused_only_with_logprobs(
    client: httpx.AsyncClient, route: str, logprobs: dict[str, Any]
) -> None:
    body = body_for(route, return_tokens_as_token_ids=True, **logprobs)
    response = await client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "return_tokens_as_token_ids"


async def test_skip_special_tokens_reaches_the_engine(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    for route in (CHAT, COMPLETIONS):
        for asked, sent in ((None, True), (True, True), (False, False)):
            fields = {} if asked is None else {"skip_special_tokens": asked}
            response = await client.post(route, json=body_for(route, **fields))
            assert response.status_code == 200, response.text
            assert engine.received[-1].sampling.skip_special_tokens is sent, (route, asked)
        # vLLM's spaces_between_special_tokens: false drops spaces between kept special
        # tokens, which this server does not: refused where it would matter
        both = body_for(route, skip_special_tokens=False, spaces_between_special_tokens=False)
        refused = await client.post(route, json=both)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "spaces_between_special_tokens"


async def test_truncate_prompt_tokens_is_honoured_where_it_cuts_nothing(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    for route in (CHAT, COMPLETIONS):
        plain = await client.post(route, json=body_for(route))
        length = len(engine.received[-1].prompt_token_ids)
        for k in (length, length + 5, -1):
            response = await client.post(route, json=body_for(route, truncate_prompt_tokens=k))
            assert response.status_code == 200, response.text
            assert engine.received[-1].prompt_token_ids == engine.received[0].prompt_token_ids
        assert plain.status_code == 200
        sent = len(engine.received)
        cut = await client.post(route, json=body_for(route, truncate_prompt_tokens=length - 1))
        assert cut.status_code == 400, cut.text
        error = cut.json()["error"]
        assert error["param"] == "truncate_prompt_tokens" and f"{length} tokens" in error["message"]
        assert len(engine.received) == sent
        engine.received.clear()


async def test_completions_add_special_tokens_false_leaves_out_the_bos(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    text = "What is a radix tree?"
    ids = {}
    for asked in (None, True, False):
        fields = {} if asked is None else {"add_special_tokens": asked}
        response = await client.post(COMPLETIONS, json=body_for(COMPLETIONS, **fields))
        assert response.status_code == 200, response.text
        ids[asked] = engine.received[-1].prompt_token_ids
        tokenized = await client.post("/tokenize", json={"prompt": text, **fields})
        assert tokenized.json()["tokens"] == ids[asked]  # /tokenize agrees, field for field
    assert ids[None] == ids[True] == [BOS, *ids[False]]
    assert BOS not in ids[False]


async def test_chat_add_special_tokens_encodes_with_them_and_moves_the_retention(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    marked = [
        {"role": "system", "content": [{"type": "text", "text": "Be terse. " * 4}]},
        *USER,
    ]
    marked[0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    sent = {}
    for asked in (False, True):
        body = {"messages": marked, "max_tokens": 1, "add_special_tokens": asked}
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        sent[asked] = engine.received[-1]
    assert sent[True].prompt_token_ids == [BOS, *sent[False].prompt_token_ids]
    (plain,), (special,) = sent[False].retain, sent[True].retain
    assert special.end == plain.end + 1 and special.ttl_s == plain.ttl_s
    segments = [{"role": "user", "content": "x", "tag": "q"}]
    refused = await client.post(CHAT, json={"segments": segments, "add_special_tokens": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_special_tokens"


async def test_documents_reach_the_template_as_vllm_passes_them() -> None:
    engine = FakeEngine(max_model_len=512)
    engine.tokenizer = DocumentsTokenizer()
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    documents = [{"title": "tries", "text": "A trie keys by prefix."}]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sidecar"
    ) as client:
        body = {"messages": USER, "documents": documents}
        response = await client.post(CHAT, json={**body, "max_tokens": 1})
        assert response.status_code == 200, response.text
        prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
        assert prompt.startswith("<doc tries>A trie keys by prefix.</doc>\n<user>")
        tokenized = await client.post("/tokenize", json=body)
        assert tokenized.json()["tokens"] == engine.received[-1].prompt_token_ids
        bad = await client.post(CHAT, json={"messages": USER, "documents": [{"title": 1}]})
        assert bad.status_code == 400, bad.text


def streamed_content(text: str) -> tuple[str, list[dict]]:
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"]
        for line in text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    ]
    return "".join(d.get("content") or "" for d in deltas), deltas


async def test_chat_echo_puts_the_last_message_before_the_content(
    client: httpx.AsyncClient,
) -> None:
    """vLLM's: with the reply's role on the last message (a continued assistant turn), each
    choice's content starts with that message's text; streamed, as one delta after the role."""
    body = {"messages": PREFILLED, "max_tokens": 4, **CONTINUE}
    plain = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"]
    echoed = await client.post(CHAT, json={**body, "echo": True, "n": 2})
    assert echoed.status_code == 200, echoed.text
    contents = [c["message"]["content"] for c in echoed.json()["choices"]]
    assert contents == ["A trie whose" + plain] * 2
    streamed = await client.post(CHAT, json={**body, "echo": True, "stream": True})
    content, deltas = streamed_content(streamed.text)
    assert content == "A trie whose" + plain
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "A trie whose"}
    # after a generation prompt the reply is the assistant's: a user's last message is not
    # echoed (vLLM's rule), nor is anything without echo
    asked = {"messages": USER, "max_tokens": 4, "echo": True}
    fresh = (await client.post(CHAT, json=asked)).json()["choices"][0]["message"]["content"]
    unasked = {"messages": USER, "max_tokens": 4}
    assert (
        fresh == (await client.post(CHAT, json=unasked)).json()["choices"][0]["message"]["content"]
    )
    segments = [{"role": "user", "content": "x", "tag": "q"}]
    refused = await client.post(CHAT, json={"segments": segments, "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


async def test_a_request_chat_template_points_at_the_servers_flag(
    client: httpx.AsyncClient,
) -> None:
    for path in (CHAT, "/tokenize"):
        body = {"messages": USER, "chat_template": "{{ 'x' }}"}
        error = (await client.post(path, json=body)).json()["error"]
        assert error["param"] == "chat_template" and "--chat-template" in error["message"]
