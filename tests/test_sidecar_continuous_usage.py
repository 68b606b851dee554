"""vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it on every stream): with
``include_usage`` every chunk carries the usage so far, its choice's prompt and the tokens it
has generated; the last usage chunk stays the request's. Alone it does nothing, as on vLLM
(``should_include_usage``: continuous only with include_usage)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from sidecar_fake_engine import FakeEngine

from prefixcache.sidecar.server.app import create_app
from prefixcache.sidecar.server.settings import SidecarSettings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 4
BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture
async def client() -> AsyncIterator[tuple[FakeEngine, httpx.AsyncClient]]:
    engine = FakeEngine(max_model_len=256)
    await engine.start()
    transport = httpx.ASGITransport(app=create_app(engine, SidecarSettings(manage_engine=False)))
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        yield engine, client


def body_for(route: str, **fields: object) -> dict:
    prompt = {"messages": [{"role": "user", "content": "hello there"}]}
    if route == COMPLETIONS:
        prompt = {"prompt": "hello there"}
    return {**prompt, "max_tokens": MAX_TOKENS, "stream": True, **fields}


async def chunks_of(client: httpx.AsyncClient, route: str, **fields: object) -> list[dict]:
    response = await client.post(route, json=body_for(route, **fields))
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_every_chunk_carries_the_usage_so_far(
    client: tuple[FakeEngine, httpx.AsyncClient], route: str
) -> None:
    engine, http = client
    chunks = await chunks_of(http, route, stream_options=BOTH)
    prompt = len(engine.received[-1].prompt_token_ids)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and choice_chunks
    usages = [c["usage"] for c in choice_chunks]
    assert all(u is not None for u in usages)  # every chunk, the role's too
    assert {u["prompt_tokens"] for u in usages} == {prompt}  # known before the first token
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    # one chunk a token, the count growing by one; chat's role chunk first, before any token
    assert counts == ([0] if route == CHAT else []) + list(range(1, MAX_TOKENS + 1))
    final = last["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usages[-1][key] == final[key]
    assert "prompt_tokens_details" not in usages[0]  # the cache's figures: on the last one
    assert final["prompt_tokens_details"]["cached_tokens"] >= 0


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_each_choice_counts_its_own_tokens(
    client: tuple[FakeEngine, httpx.AsyncClient], route: str
) -> None:
    """As vLLM: a choice's chunks count its own completion; the last chunk sums them, its
    prompt counted once."""
    engine, http = client
    chunks = await chunks_of(http, route, n=2, stream_options=BOTH)
    prompt = len(engine.received[-1].prompt_token_ids)
    *choice_chunks, last = chunks
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        assert chunk["usage"]["prompt_tokens"] == prompt
        counts[choice["index"]].append(chunk["usage"]["completion_tokens"])
    start = [0] if route == CHAT else []
    assert counts == {i: start + list(range(1, MAX_TOKENS + 1)) for i in (0, 1)}
    assert last["usage"]["prompt_tokens"] == prompt
    assert last["usage"]["completion_tokens"] == 2 * MAX_TOKENS


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("options", "usage_on_chunks"),
    [
        (None, "absent"),
        ({"continuous_usage_stats": True}, "absent"),  # alone: nothing (vLLM's)
        ({"include_usage": False, "continuous_usage_stats": True}, "absent"),
        ({"include_usage": True}, "null"),
        ({"include_usage": True, "continuous_usage_stats": False}, "null"),
    ],
)
async def test_without_both_flags_nothing_changes(
    client: tuple[FakeEngine, httpx.AsyncClient],
    route: str,
    options: dict | None,
    usage_on_chunks: str,
) -> None:
    _, http = client
    fields = {} if options is None else {"stream_options": options}
    chunks = await chunks_of(http, route, **fields)
    with_choices = [c for c in chunks if c["choices"]]
    if usage_on_chunks == "absent":
        assert all("usage" not in c for c in chunks)
        assert len(with_choices) == len(chunks)
    else:
        assert all(c["usage"] is None for c in with_choices)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
