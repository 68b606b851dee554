"""OpenAI compatibility details: template errors, unsupported options, nulls, logprob bytes,
context-length edges and the response shape; warm and unpin of a chat body's stable part
rendered as chat renders it (tools, documents, add_special_tokens). In-process over the fake
engine (fast)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_fake_engine import FakeEngine
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from prefixcache.engine.request import TokenLogprob
from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sidecar.server.app import SidecarSettings, create_app
from prefixcache.sidecar.server.logprob_format import TokenOffsets, completion_logprobs
from prefixcache.sidecar.server.responses import chat_logprobs

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "model" / "demo_assets"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello"}]
ALTERNATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def demo_tokenizer(template: str) -> Tokenizer:
    return Tokenizer(
        HFTokenizer.from_file(str(ASSETS / "tokenizer.json")),
        chat_template=template,
        bos_token="<|begin_of_text|>",
        eos_tokens=["<|eot_id|>"],
    )


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


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


async def post_with_template(template: str, body: dict) -> tuple[httpx.Response, FakeEngine]:
    engine = FakeEngine()
    engine.tokenizer = demo_tokenizer(template)  # type: ignore[assignment]
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        return await client.post(CHAT, json=body), engine


async def test_template_errors_are_400_with_the_templates_message() -> None:
    two_users = [*USER, {"role": "user", "content": "again"}]
    response, engine = await post_with_template(ALTERNATE, {"messages": two_users})
    error = error_of(response, 400)
    assert "Conversation roles must alternate" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert engine.received == []
    response, _ = await post_with_template("{{ messages[0].nothing.deeper }}", {"messages": USER})
    error = error_of(response, 400)
    assert error["code"] == "chat_template_error" and "no attribute 'nothing'" in error["message"]


async def test_templates_using_generation_and_loop_controls_render() -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% break %}{% endfor %}"
    )
    two = [*USER, {"role": "assistant", "content": "ignored"}]
    response, engine = await post_with_template(template, {"messages": two, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert engine.tokenizer.decode(engine.received[0].prompt_token_ids) == "hello"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("reasoning_effort", "low"),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {"search_context_size": "low"}),  # were accepted, unsearched
        ("moderation", {"input": {"policy": "default"}}),
    ],
)
async def test_unsupported_options_are_refused_by_name(
    engine: FakeEngine, client: httpx.AsyncClient, field: str, value: object
) -> None:
    error = error_of(await client.post(CHAT, json={"messages": USER, field: value}), 400)
    assert error["param"] == field and "not supported" in error["message"]
    assert engine.received == []


async def test_harmless_values_of_those_options_are_accepted(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    harmless = {
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "modalities": ["text"],
        "tools": None,
        "reasoning_effort": "none",  # no reasoning: what is served (the Agents SDK sends it)
        "store": True,  # unknown fields stay ignored
        "metadata": {"k": "v"},
    }
    response = await client.post(CHAT, json={"messages": USER, "max_tokens": 1, **harmless})
    assert response.status_code == 200, response.text
    biased = await client.post(COMPLETIONS, json={"prompt": "x", "logit_bias": {"1": 5}})
    assert biased.status_code == 200, biased.text
    assert engine.received[-1].sampling.logit_bias == {1: 5.0}
    for bad in ({"x1": 5}, {"1": 101}, {"-1": 2}, {str(10**6): 1}):
        logit = await client.post(COMPLETIONS, json={"prompt": "x", "logit_bias": bad})
        assert error_of(logit, 400)["param"] == "logit_bias"


NULLABLE_CHAT = [
    "temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty", "logprobs",
    "repetition_penalty",
    "top_logprobs", "stream", "stream_options", "stop", "seed", "max_tokens",
    "max_completion_tokens", "user", "ignore_eos", "tools", "tool_choice", "response_format",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "stop_token_ids",
]  # fmt: skip
NULLABLE_COMPLETION = ["echo", "logprobs", "suffix", "best_of", "stream", "temperature", "n"]


async def test_explicit_nulls_mean_the_defaults(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    body = {"messages": USER, **dict.fromkeys(NULLABLE_CHAT)}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    sampling = engine.received[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    assert sampling.logprobs is None and sampling.stop == [] and not sampling.ignore_eos
    body = {"prompt": "hi", "max_tokens": None, **dict.fromkeys(NULLABLE_COMPLETION)}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert engine.received[-1].sampling.max_tokens == 16  # OpenAI's completions default
    streamed = {"messages": USER, "max_tokens": 1, "stream": True}
    response = await client.post(CHAT, json={**streamed, "stream_options": {"include_usage": None}})
    assert response.status_code == 200 and "[DONE]" in response.text


@pytest.mark.parametrize("use_generation_config", [True, False])
async def test_unset_sampling_fields_take_the_models_generation_config(
    use_generation_config: bool,
) -> None:
    """As vLLM: a field the request leaves unset comes from generation_config.json."""
    engine = FakeEngine()
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's
    await engine.start()
    settings = SidecarSettings(manage_engine=False, use_generation_config=use_generation_config)
    transport = httpx.ASGITransport(app=create_app(engine, settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post(CHAT, json={"messages": USER})).status_code == 200
        unset = engine.received[-1].sampling
        body = {"messages": USER, "temperature": 0, "top_p": None, "top_k": 5}
        assert (await client.post(CHAT, json=body)).status_code == 200
        explicit = engine.received[-1].sampling
    if use_generation_config:
        assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.95, 20)
        assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.0, 0.95, 5)
    else:
        assert (unset.temperature, unset.top_p, unset.top_k) == (1.0, 1.0, 0)
    assert unset.repetition_penalty == 1.0  # set by neither


async def test_penalties_reach_the_engine(engine: FakeEngine, client: httpx.AsyncClient) -> None:
    body = {"messages": USER, "presence_penalty": 0.5, "frequency_penalty": -0.25}
    response = await client.post(CHAT, json={**body, "repetition_penalty": 1.1})
    assert response.status_code == 200, response.text
    sampling = engine.received[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)
    assert sampling.repetition_penalty == 1.1


async def test_vllm_stop_token_ids_reach_the_engine(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "hi"})):
        response = await client.post(path, json={**body, "stop_token_ids": [7, 9]})
        assert response.status_code == 200, response.text
        assert engine.received[-1].sampling.stop_token_ids == [7, 9]


async def test_openai_ranges_top_p_zero_and_a_negative_seed(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    """OpenAI allows top_p 0 (the most likely token alone) and any int64 seed."""
    body = {"messages": USER, "max_tokens": 1, "top_p": 0, "seed": -1}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    sampling = engine.received[-1].sampling
    assert (sampling.top_p, sampling.seed) == (0.0, 2**63 - 1)


@pytest.mark.parametrize("top_k", [-1, 0])
async def test_top_k_minus_one_and_zero_are_off(
    engine: FakeEngine, client: httpx.AsyncClient, top_k: int
) -> None:
    response = await client.post(CHAT, json={"messages": USER, "max_tokens": 1, "top_k": top_k})
    assert response.status_code == 200, response.text
    assert engine.received[-1].sampling.top_k == 0
    bad = await client.post(CHAT, json={"messages": USER, "top_k": -2})
    assert error_of(bad, 400)["param"] == "top_k"


def test_logprob_bytes_are_the_tokens_raw_bytes() -> None:
    text = "日本 and café 🙂"
    byte_level = demo_tokenizer("")
    sentencepiece = sentencepiece_tokenizer()
    for tok in (byte_level, sentencepiece):
        ids = tok.encode(text)
        assert any(not complete_utf8(tok.token_bytes(i)) for i in ids)  # the case under test
        entries = [TokenLogprob(i, -1.0, [(i, -1.0)]) for i in ids]
        content = chat_logprobs(entries, tok.decode, tok.token_bytes)["content"]
        joined = b"".join(bytes(item["bytes"]) for item in content)
        assert joined.decode() == tok.decode(ids)
        assert [t["bytes"] for item in content for t in item["top_logprobs"]] == [
            item["bytes"] for item in content
        ]


def complete_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def sentencepiece_tokenizer() -> Tokenizer:
    """Metaspace BPE with byte fallback: characters outside the vocabulary become <0xNN>."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ("\u2581", "a", "n", "d", "c", "f", "\u2581a", "\u2581an", "\u2581and", "é"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581a", "n"), ("\u2581an", "d")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return Tokenizer(tok)


async def test_context_length_errors_say_it_in_the_words_clients_match(
    client: httpx.AsyncClient,
) -> None:
    """OpenAI's and vLLM's first sentence (LiteLLM raises ContextWindowExceededError on it, and
    its routers fall back to a longer-context model); Anthropic's "prompt is too long"."""
    long = [{"role": "user", "content": "x" * 400}]  # one token per byte: past 256
    error = error_of(await client.post(CHAT, json={"messages": long}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"].startswith("This model's maximum context length is 256 tokens.")
    body = {"prompt": "hello", "max_tokens": 1000}
    error = error_of(await client.post(COMPLETIONS, json=body), 400)
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("This model's maximum context length is 256 tokens.")
    assert "in the prompt, 1000 in the completion" in error["message"]
    r = await client.post("/v1/messages", json={"messages": long, "max_tokens": 8})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("prompt is too long: ")


async def test_a_warm_prefix_must_be_shorter_than_the_context(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    tok = engine.tokenizer
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False)
    exact = "x" * (engine.max_model_len - len(tok.encode(empty)))  # one token per byte
    body = {"messages": [{"role": "user", "content": exact}]}
    error = error_of(await client.post("/v1/cache/warm", json=body), 400)
    assert error["code"] == "context_length_exceeded"
    shorter = {"messages": [{"role": "user", "content": exact[:-1]}]}
    assert (await client.post("/v1/cache/warm", json=shorter)).status_code == 200


async def test_engine_value_errors_are_400_on_every_route(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    async def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("prompt does not fit")

    engine.warm = refuse  # type: ignore[method-assign]
    engine.unpin = refuse  # type: ignore[method-assign]
    for route in ("/v1/cache/warm", "/v1/cache/unpin"):
        error = error_of(await client.post(route, json={"messages": USER}), 400)
        assert "prompt does not fit" in error["message"]


# Tools and documents ahead of the conversation, where tool and RAG templates put them.
TOOLS_AND_DOCUMENTS = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<tools>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{{ '</tools>' }}{% endif %}"
    "{% for d in documents or [] %}{{ '<doc>' + d['title'] + ': ' + d['text'] + '</doc>' }}"
    "{% endfor %}"
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '</' + m['role'] + '>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You answer from the documents and the tools. " * 4}
QUESTION = {"role": "user", "content": "Weather in Paris?"}
SEGMENTS = [
    {**SYSTEM, "tag": "rules", "stability": "static"},
    {**QUESTION, "tag": "q", "stability": "dynamic"},
]
DOCUMENTS = [{"title": "Paris", "text": "It rains in Paris in November."}]


def reversed_keys(value: object) -> object:
    """The same data with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(v) for v in value]
    return value


def bos_tokenizer(template: str) -> Tokenizer:
    """The demo tokenizer with a post-processor that adds a BOS (as Llama 3's), on a
    template that writes one too."""
    tok = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return Tokenizer(tok, chat_template=template, bos_token=bos, eos_tokens=["<|eot_id|>"])


@pytest.fixture
async def rag() -> AsyncIterator[tuple[FakeEngine, httpx.AsyncClient]]:
    """The fake engine on a template that renders tools and documents."""
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = bos_tokenizer(TOOLS_AND_DOCUMENTS)  # type: ignore[assignment]
    await engine.start()
    transport = httpx.ASGITransport(app=create_app(engine, SidecarSettings(manage_engine=False)))
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        yield engine, client


async def unpinned(client: httpx.AsyncClient, body: dict) -> int:
    response = await client.post("/v1/cache/unpin", json=body)
    assert response.status_code == 200, response.text
    return response.json()["unpinned_blocks"]


@pytest.mark.parametrize(
    ("prompt", "fields"),
    [
        ({"messages": [SYSTEM]}, {"tools": [WEATHER]}),
        ({"segments": SEGMENTS}, {"tools": [WEATHER]}),
        ({"messages": [SYSTEM]}, {"documents": DOCUMENTS}),
        ({"segments": SEGMENTS}, {"documents": DOCUMENTS}),
        ({"messages": [SYSTEM]}, {"add_special_tokens": True}),
        (
            {"messages": [SYSTEM]},
            {"tools": [WEATHER], "documents": DOCUMENTS, "add_special_tokens": True},
        ),
    ],
    ids=["tools", "tools-segments", "documents", "documents-segments", "special-tokens", "all"],
)
async def test_warm_caches_the_prefix_chat_renders_with_the_same_fields(
    rag: tuple[FakeEngine, httpx.AsyncClient], prompt: dict, fields: dict
) -> None:
    """A warm (and pin) of a conversation's stable part with its tools, documents or
    add_special_tokens is the prefix the chat request then finds cached, to the last whole
    block; unpin of the same body unpins what warm pinned. Warmed without the field, the
    chat request finds nothing (the check can fail)."""
    engine, client = rag
    if "segments" in prompt:
        chat: dict = {"segments": SEGMENTS}  # warm drops the dynamic question
    else:
        chat = {"messages": [*prompt["messages"], QUESTION]}
    chat |= {**reversed_keys(fields), "max_tokens": 1}  # the tools' keys in another order

    async def warm_then_chat(warm_fields: dict, salt: str) -> tuple[dict, int]:
        body = {**prompt, **warm_fields, "pin": True, "cache_salt": salt}
        warm = await client.post("/v1/cache/warm", json=body)
        assert warm.status_code == 200, warm.text
        reply = await client.post(CHAT, json={**chat, "cache_salt": salt})
        assert reply.status_code == 200, reply.text
        return warm.json(), reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    warm, cached = await warm_then_chat(fields, "with")
    block = engine.block_size
    assert cached == warm["tokens"] // block * block > 0
    assert warm["pinned_blocks"] == warm["tokens"] // block
    _, cached_without = await warm_then_chat({}, "without")
    assert cached_without == 0  # the field changes the prompt from its first block on
    assert await unpinned(client, {**prompt, "cache_salt": "with"}) == 0  # not that prefix
    assert (
        await unpinned(client, {**prompt, **fields, "cache_salt": "with"})
        == (warm["pinned_blocks"])
    )
    assert await unpinned(client, {**prompt, "cache_salt": "without"}) > 0
    assert engine.pinned == set()


async def test_warm_with_continue_final_message_caches_chats_whole_prompt(
    rag: tuple[FakeEngine, httpx.AsyncClient],
) -> None:
    """A prefilled assistant turn being continued: the chat prompt ends inside it (no
    generation prompt), and warm of the same body caches exactly that prompt."""
    engine, client = rag
    body = {
        "messages": [SYSTEM, QUESTION, {"role": "assistant", "content": "In Paris it"}],
        "continue_final_message": True,
        "tools": [WEATHER],
    }
    warm = (await client.post("/v1/cache/warm", json=body)).json()
    reply = await client.post(CHAT, json={**body, "add_generation_prompt": False})
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == warm["tokens"]
    expected = (warm["tokens"] - 1) // engine.block_size * engine.block_size  # the last is fed
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected


async def test_warm_refuses_the_prompt_fields_as_chat_does(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    """What cannot be part of a stable prefix is refused by name; chat's other fields stay
    unknown fields (400). (Tools on this template, which renders none: test_generic_tools.py.)"""
    system = {"messages": [SYSTEM]}
    plain = (await client.post("/v1/cache/warm", json=system)).json()
    refused = [
        ({"segments": SEGMENTS, "add_special_tokens": True}, "add_special_tokens"),
        ({"segments": SEGMENTS, "continue_final_message": True}, "segments"),
        ({**system, "tool_choice": "required"}, "tool_choice"),
        ({**system, "tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
        ({**system, "chat_template_kwargs": {"documents": DOCUMENTS}}, "chat_template_kwargs"),
        ({**system, "add_generation_prompt": True}, "add_generation_prompt"),
    ]
    for body, param in refused:
        for path in ("/v1/cache/warm", "/v1/cache/unpin"):
            assert error_of(await client.post(path, json=body), 400)["param"] == param, body
    for name, value in (
        ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
        ("max_tokens", 1),
        ("echo", True),
    ):
        error = error_of(await client.post("/v1/cache/warm", json={**system, name: value}), 400)
        assert f"unknown field `{name}`" in error["message"]
    explicit = {**system, "add_generation_prompt": False, "add_special_tokens": None}
    assert (await client.post("/v1/cache/warm", json=explicit)).json()["tokens"] == plain["tokens"]


async def test_response_shape(engine: FakeEngine, client: httpx.AsyncClient) -> None:
    chat = (await client.post(CHAT, json={"messages": USER, "max_tokens": 2})).json()
    completion = (await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})).json()
    fingerprint = chat["system_fingerprint"]
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint)
    assert completion["system_fingerprint"] == fingerprint
    message = chat["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None

    def chunks(response: httpx.Response) -> list[dict]:
        frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        return [json.loads(f) for f in frames[:-1]]

    body = {"messages": USER, "max_tokens": 2, "stream": True}
    plain = chunks(await client.post(CHAT, json=body))
    assert all("usage" not in c and c["system_fingerprint"] == fingerprint for c in plain)
    with_usage = chunks(
        await client.post(CHAT, json={**body, "stream_options": {"include_usage": True}})
    )
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["total_tokens"] > 0
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    text = chunks(await client.post(COMPLETIONS, json=body))
    assert all(c["system_fingerprint"] == fingerprint for c in text)

    error = error_of(await client.post(CHAT, json={"messages": USER, "model": "gpt-4o"}), 404)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )


async def test_model_aliases_are_accepted_and_others_are_not(engine: FakeEngine) -> None:
    """vLLM-style clients send the --model path; `prefixcache serve` accepts it as an alias,
    and the reply names the model as the request did."""
    settings = SidecarSettings(manage_engine=False, model_aliases=("/models/my-model",))
    app = create_app(engine, settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        for name in (engine.model_name, "/models/my-model"):
            body = {"messages": USER, "model": name, "max_tokens": 1}
            response = await c.post(CHAT, json=body)
            assert response.status_code == 200, name
            assert response.json()["model"] == name  # the name used, as vLLM answers
        other = await c.post(CHAT, json={"messages": USER, "model": "/models/other"})
        assert other.status_code == 404
        # listed too, in vLLM's order (the served names, here the --model value, then the
        # model's own), each card rooted at the model's own; one retrieved by an alias is
        # that alias's card; a request naming none is answered in the first's name
        cards = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m["root"]) for m in cards] == [
            ("/models/my-model", engine.model_name),
            (engine.model_name, engine.model_name),
        ]
        unnamed = await c.post(CHAT, json={"messages": USER, "max_tokens": 1})
        assert unnamed.json()["model"] == "/models/my-model"
        card = (await c.get("/v1/models//models/my-model")).json()
        assert card["id"] == "/models/my-model"


def test_serve_accepts_the_model_argument_and_extra_names() -> None:
    from prefixcache.sidecar.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--model", "/m/x", "--served-model-name", "a", "--served-model-name", "b"]
    )
    assert (args.model, args.served_model_name) == ("/m/x", ["a", "b"])


async def test_priority_reaches_the_engine_and_is_range_checked(
    engine: FakeEngine, client: httpx.AsyncClient
) -> None:
    response = await client.post(CHAT, json={"messages": USER, "max_tokens": 1, "priority": -5})
    assert response.status_code == 200
    assert engine.received[-1].priority == -5
    assert (await client.post(CHAT, json={"messages": USER, "priority": None})).status_code == 200
    assert engine.received[-1].priority == 0
    error_of(await client.post(CHAT, json={"messages": USER, "priority": 10**6}), 400)


@given(text=st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=["Cs"])))
@settings(max_examples=60, deadline=None)
def test_text_offsets_are_where_each_token_starts(text: str) -> None:
    """Completions' ``text_offset``: each token starts where the text before it ends, a token
    inside a character split across several at that character's start (never past it)."""
    for tok in (BYTE_LEVEL, SENTENCEPIECE):
        ids = tok.encode(text)
        entries = [TokenLogprob(i, -1.0, []) for i in ids]
        offsets = completion_logprobs(entries, tok.decode, TokenOffsets(tok.decode, 7))[
            "text_offset"
        ]
        stream = TokenOffsets(tok.decode, 7)  # fed in pieces, as a stream's outputs come
        pieces = [entries[i : i + 2] for i in range(0, len(entries), 2)]
        streamed = [completion_logprobs(p, tok.decode, stream)["text_offset"] for p in pieces]
        assert [o for part in streamed for o in part] == offsets
        # the oracle: the characters the bytes before token i make whole (less a leading
        # space a SentencePiece decoder drops)
        raw = [tok.token_bytes(i) for i in ids]
        shift = len(b"".join(raw).decode()) - len(tok.decode(ids))
        whole = [len(b"".join(raw[:i]).decode(errors="ignore")) for i in range(len(ids))]
        assert offsets == [7 + max(0, n - shift) for n in whole]


BYTE_LEVEL = demo_tokenizer("")
SENTENCEPIECE = sentencepiece_tokenizer()


async def test_every_response_names_its_request(client: httpx.AsyncClient) -> None:
    """x-request-id (OpenAI's client reads it as request_id) and request-id (Anthropic's), one
    id; a caller's own x-request-id is echoed; a 405 says what is allowed."""
    fresh = await client.post(CHAT, json={"messages": USER, "max_tokens": 1})
    rid = fresh.headers["x-request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{32}", rid) and fresh.headers["request-id"] == rid
    again = await client.post(CHAT, json={"messages": USER, "max_tokens": 1})
    assert again.headers["x-request-id"] != rid
    echoed = await client.get("/v1/models", headers={"x-request-id": "trace-42"})
    assert echoed.headers["x-request-id"] == echoed.headers["request-id"] == "trace-42"
    wrong = await client.get(CHAT)
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert wrong.headers["x-request-id"].startswith("req_")
