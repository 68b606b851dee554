"""vLLM's ``return_token_ids``: the prompt's ids and each choice's generated ids in the reply
(what RL and agent frameworks read instead of tokenizing the text again), on chat and
completions; streamed, the prompt's once and each chunk's own ids, which add up to the whole
reply's."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerLoop, demo_engine, serve

from prefixcache.sidecar.server.app import SidecarSettings, create_app


@pytest.fixture(scope="module")
def url(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[str]:
    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    yield server.url
    server.stop()


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def tokenized(url: str, text: str) -> list[int]:
    root = url.removesuffix("/v1")
    return httpx.post(f"{root}/tokenize", json={"prompt": text}).json()["tokens"]


def test_chat_replies_carry_the_prompt_and_the_choice_ids(url: str) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 9,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = post(url, "/chat/completions", body)
    prompt = whole["prompt_token_ids"]
    assert len(prompt) == whole["usage"]["prompt_tokens"]
    render = post(url.removesuffix("/v1"), "/tokenize", {"messages": body["messages"]})
    assert prompt == render["tokens"]
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"]
    chunks = streamed(url, "/chat/completions", body)
    assert [c.get("prompt_token_ids") for c in chunks if "prompt_token_ids" in c] == [prompt]
    assert "prompt_token_ids" in chunks[0]  # the first chunk, as vLLM
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    plain = post(url, "/chat/completions", {**body, "return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completion_choices_carry_their_own_prompt(url: str) -> None:
    body = {
        "model": "demo",
        "prompt": ["Once upon", "The cache"],
        "n": 2,
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = post(url, "/completions", body)
    for choice in whole["choices"]:
        text = body["prompt"][choice["index"] // 2]
        assert choice["prompt_token_ids"][-len(tokenized(url, text)) :] == tokenized(url, text)
        assert len(choice["token_ids"]) == 6
    chunks = streamed(url, "/completions", {**body, "prompt": "Once upon", "n": 1})
    firsts = [ch["prompt_token_ids"] for c in chunks for ch in c["choices"] if "prompt_token_ids" in ch]  # fmt: skip
    assert firsts == [whole["choices"][0]["prompt_token_ids"]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert ids == whole["choices"][0]["token_ids"]


def test_include_stop_str_in_output_keeps_the_matched_stop(url: str) -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends after the stop string, streamed
    alike; without it, before."""
    body = {"model": "demo", "prompt": "Once upon", "max_tokens": 24, "temperature": 0}
    free = post(url, "/completions", body)["choices"][0]["text"]
    stop = free[3:5]  # two characters of what greedy decoding writes anyway
    cut = post(url, "/completions", {**body, "stop": [stop]})["choices"][0]
    kept = post(url, "/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})
    kept_choice = kept["choices"][0]
    assert cut["stop_reason"] == kept_choice["stop_reason"] == stop
    assert kept_choice["text"] == cut["text"] + stop == free[: free.index(stop) + len(stop)]
    chunks = streamed(url, "/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})  # fmt: skip
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == kept_choice["text"]


def test_allowed_token_ids_are_the_only_ones_sampled(url: str) -> None:
    """vLLM's ``allowed_token_ids``, greedy and sampled: every generated id is one of them
    (an end of sequence only if listed, so the reply runs to max_tokens)."""
    allowed = tokenized(url, " red green blue")
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        body = {"model": "demo", "prompt": "Colours:", "max_tokens": 8, "return_token_ids": True,
                "allowed_token_ids": allowed, **extra}  # fmt: skip
        choice = post(url, "/completions", body)["choices"][0]
        assert set(choice["token_ids"]) <= set(allowed) and len(choice["token_ids"]) == 8
        assert choice["finish_reason"] == "length"
    refused = httpx.post(f"{url}/completions", json={**body, "allowed_token_ids": [10**7]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_never_end_in_the_output(url: str) -> None:
    """vLLM's ``bad_words``: a word the greedy output wrote is never written once banned, and
    a two-token word's second token never follows its first."""
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    free = post(url, "/completions", body)["choices"][0]["token_ids"]
    root = url.removesuffix("/v1")
    text_of = {t: httpx.post(f"{root}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in free}  # fmt: skip
    single = [t for t in free if text_of[t].strip() and tokenized(url, text_of[t]) == [t]]
    assert single, "the greedy output has a token that is a word of its own"
    banned = post(url, "/completions", {**body, "bad_words": [text_of[single[0]]]})
    assert single[0] not in banned["choices"][0]["token_ids"]
    pair = next(
        (a, b)
        for a, b in itertools.pairwise(free)
        if tokenized(url, text_of[a] + text_of[b]) == [a, b]
    )  # a pair that reads back as itself: banning it bans its second token after its first
    word = text_of[pair[0]] + text_of[pair[1]]
    out = post(url, "/completions", {**body, "bad_words": [word]})["choices"][0]["token_ids"]
    assert pair not in itertools.pairwise(out)
    assert out != free  # the greedy output had the pair: it changed


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(url: str) -> None:
    """With ``include_stop_str_in_output`` a ``stop_token_ids`` token's text stays too, as
    vLLM keeps it; without, it is left out."""
    body = {"model": "demo", "prompt": "Once upon", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    free = post(url, "/completions", body)["choices"][0]
    stop_id = free["token_ids"][2]
    root = url.removesuffix("/v1")
    stop_text = httpx.post(f"{root}/detokenize", json={"tokens": [stop_id]}).json()["prompt"]
    cut = post(url, "/completions", {**body, "stop_token_ids": [stop_id]})["choices"][0]
    kept = post(url, "/completions", {**body, "stop_token_ids": [stop_id], "include_stop_str_in_output": True})["choices"][0]  # fmt: skip
    assert cut["stop_reason"] == kept["stop_reason"] == stop_id
    assert kept["text"] == cut["text"] + stop_text
