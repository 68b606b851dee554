"""vLLM's /tokenize, /detokenize and /tokenizer_info: the ids are the ones the generation
routes compute for the same prompt or conversation (tools and template kwargs included), in
vLLM's response shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import KEYS, Server
from sidecar_fake_engine import FakeEngine
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from prefixcache.engine.model.demo_model import BOS_TOKEN, CHAT_TEMPLATE, EOT_TOKEN
from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sidecar.server.app import create_app
from prefixcache.sidecar.server.settings import SidecarSettings

ASSETS = Path(__file__).resolve().parents[1] / "engine" / "model" / "demo_assets"
TEXT = "Tokenize me: prefix caching pays a long prompt's prefill once. Ünïcödé too."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a radix tree?"},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def post(server: Server, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.root}{path}", json=body, headers=headers, timeout=30)


def test_a_prompt_tokenizes_as_completions_count_it(sidecar_server: Server) -> None:
    out = post(sidecar_server, "/tokenize", {"prompt": TEXT}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["token_strs"] is None
    reference = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    assert out["tokens"] == reference.encode(TEXT, add_special_tokens=True).ids
    assert out["count"] == len(out["tokens"])
    models = httpx.get(f"{sidecar_server.url}/models", timeout=30).json()
    assert out["max_model_len"] == models["data"][0]["max_model_len"]
    completion = httpx.post(
        f"{sidecar_server.url}/completions", json={"prompt": TEXT, "max_tokens": 1}, timeout=30
    ).json()
    assert completion["usage"]["prompt_tokens"] == out["count"]
    plain = post(sidecar_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert plain.json()["tokens"] == reference.encode(TEXT, add_special_tokens=False).ids
    strs = post(sidecar_server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert strs["token_strs"] == [reference.id_to_token(i) for i in out["tokens"]]


def test_detokenize_inverts_tokenize(sidecar_server: Server) -> None:
    ids = post(sidecar_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    back = post(sidecar_server, "/detokenize", {"tokens": ids.json()["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": TEXT}
    bos = HFTokenizer.from_file(str(ASSETS / "tokenizer.json")).token_to_id("<|begin_of_text|>")
    tokens = [bos, *ids.json()["tokens"]]
    text = post(sidecar_server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == "<|begin_of_text|>" + TEXT  # special tokens are kept, as vLLM does


async def test_a_conversation_tokenizes_to_the_ids_chat_sends_the_engine() -> None:
    engine = FakeEngine(max_model_len=512)
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        for extra in (
            {},
            {"add_generation_prompt": False},
            {"chat_template_kwargs": {"x": 1}},
            {"add_special_tokens": True},  # vLLM's, on both routes: the tokenizer's on top
            {"documents": [{"title": "t", "text": "a trie"}]},
        ):
            body = {"messages": MESSAGES, **extra}
            chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
            assert chat.status_code == 200, chat.text
            sent = engine.received[-1].prompt_token_ids
            out = await client.post("/tokenize", json=body)
            assert out.status_code == 200, out.text
            assert out.json()["tokens"] == sent
            assert out.json()["count"] == len(sent)


def bos_tokenizer() -> tuple[Tokenizer, HFTokenizer]:
    """The demo tokenizer and chat template, with a post-processor that adds a BOS (as
    Llama 3's does; the demo's adds none), and that pipeline alone as the reference."""
    reference = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    bos = reference.token_to_id(BOS_TOKEN)
    reference.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0", special_tokens=[(BOS_TOKEN, bos)]
    )
    tokenizer = Tokenizer(
        HFTokenizer.from_str(reference.to_str()),
        chat_template=CHAT_TEMPLATE,  # it writes {{ bos_token }} first
        bos_token=BOS_TOKEN,
        eos_tokens=[EOT_TOKEN],
    )
    return tokenizer, reference


async def test_add_special_tokens_on_a_conversation_adds_the_tokenizers_on_top() -> None:
    """vLLM's: for a conversation the default is false (the template writes the special
    tokens) and true encodes the rendered text with the tokenizer's special tokens as well:
    here a second BOS after the template's own."""
    tokenizer, reference = bos_tokenizer()
    bos = tokenizer.bos_token_id
    engine = FakeEngine(max_model_len=512)
    engine.tokenizer = tokenizer  # type: ignore[assignment]
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    continued = {
        "messages": [*MESSAGES, {"role": "assistant", "content": "A trie that"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        for extra in ({}, {"add_generation_prompt": False}, {"tools": [WEATHER]}, continued):
            body = {"messages": MESSAGES, "tool_choice": "none", **extra}
            chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
            assert chat.status_code == 200, chat.text
            sent = engine.received[-1].prompt_token_ids
            assert sent[0] == bos and sent[1] != bos  # the template's BOS, once
            for unset in ({}, {"add_special_tokens": False}, {"add_special_tokens": None}):
                out = await client.post("/tokenize", json={**body, **unset})
                assert out.json()["tokens"] == sent, out.text  # false is the default
            out = await client.post(
                "/tokenize", json={**body, "add_special_tokens": True, "return_token_strs": True}
            )
            assert out.status_code == 200, out.text
            text = tokenizer.decode(sent, skip_special_tokens=False)  # what the template wrote
            assert out.json()["tokens"] == reference.encode(text, add_special_tokens=True).ids
            assert out.json()["tokens"] == [bos, *sent]
            assert out.json()["count"] == len(sent) + 1
            assert out.json()["token_strs"][:2] == [BOS_TOKEN, BOS_TOKEN]
            # and chat, given the same body, sends the engine those ids
            body = {**body, "add_special_tokens": True, "max_tokens": 1}
            chat = await client.post("/v1/chat/completions", json=body)
            assert chat.status_code == 200, chat.text
            assert engine.received[-1].prompt_token_ids == out.json()["tokens"]
        nulls = {"chat_template": None, "media_io_kwargs": None, "mm_processor_kwargs": {}}
        same = await client.post("/tokenize", json={"messages": MESSAGES, **nulls})
        plain = await client.post("/tokenize", json={"messages": MESSAGES})
        assert same.status_code == 200 and same.json() == plain.json(), same.text


def test_tools_are_rendered_into_the_tokenized_conversation(tools_sidecar: Server) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    with_tools = post(tools_sidecar, "/tokenize", body).json()
    without = post(tools_sidecar, "/tokenize", {"messages": MESSAGES}).json()
    assert with_tools["count"] > without["count"]
    chat = httpx.post(
        f"{tools_sidecar.url}/chat/completions", json={**body, "max_tokens": 1}, timeout=30
    ).json()
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        # vLLM's chat fields this server cannot honour: refused by name, never ignored
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
        (
            "/tokenize",
            {"messages": MESSAGES, "media_io_kwargs": {"image": {}}},
            400,
            "media_io_kwargs",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "mm_processor_kwargs": {"a": 1}},
            400,
            "mm_processor_kwargs",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            "/tokenize",  # segments are tokenized one by one: no one text to add them to
            {"messages": [], "segments": [{"role": "user", "content": "x", "tag": "q"}]}
            | {"add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
        ("/tokenize", {"prompt": "x", "model": "not-served"}, 404, None),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        ("/detokenize", {}, 400, None),
    ],
)
def test_bad_bodies_are_4xx(
    sidecar_server: Server, path: str, body: dict, status: int, param: str | None
) -> None:
    r = post(sidecar_server, path, body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_tokenizer_info_serves_a_remote_tokenizer(sidecar_server: Server) -> None:
    """vLLM's /tokenizer_info, read as lm-evaluation-harness's RemoteTokenizer reads it: the
    special tokens' text, whose ids /tokenize gives (add_special_tokens false), and the chat
    template it renders conversations with."""
    r = httpx.get(f"{sidecar_server.root}/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert (info["bos_token"], info["eos_token"]) == (BOS_TOKEN, EOT_TOKEN)
    assert info["chat_template"] == CHAT_TEMPLATE
    models = httpx.get(f"{sidecar_server.url}/models", timeout=30).json()
    assert info["model_max_length"] == models["data"][0]["max_model_len"]
    reference = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    eos = post(sidecar_server, "/tokenize", {"prompt": EOT_TOKEN, "add_special_tokens": False})
    assert eos.json()["tokens"] == [reference.token_to_id(EOT_TOKEN)]


def test_tokenize_needs_a_tenant_key_where_keys_are_set(tenant_server: Server) -> None:
    assert post(tenant_server, "/tokenize", {"prompt": TEXT}).status_code == 401
    assert post(tenant_server, "/detokenize", {"tokens": [5]}).status_code == 401
    assert httpx.get(f"{tenant_server.root}/tokenizer_info", timeout=30).status_code == 401
    ok = post(tenant_server, "/tokenize", {"prompt": TEXT}, KEYS["a"]["key"])
    assert ok.status_code == 200, ok.text


def test_an_empty_prompt_tokenizes_as_completions_take_it(fake_server: Server) -> None:
    """ "" is a prompt where the tokenizer adds a start token (/v1/completions serves it):
    /tokenize gave a 400 for it; an empty id list stays a 400 on both."""
    from sidecar_fake_engine import BOS

    out = post(fake_server, "/tokenize", {"prompt": ""})
    assert out.status_code == 200 and out.json()["tokens"] == [BOS], out.text
    done = httpx.post(
        f"{fake_server.url}/completions", json={"prompt": "", "max_tokens": 1}, timeout=30
    )
    assert done.status_code == 200 and done.json()["usage"]["prompt_tokens"] == 1
    assert post(fake_server, "/tokenize", {"prompt": []}).status_code == 400
