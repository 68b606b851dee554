"""KV tiers, TTL pins and retention hints through the HTTP API (real engine, demo model).

The server has a host tier; ``/v1/cache/evict {"keep_tier": true}`` pushes the pool's idle
blocks into it, and the next request reloads them: same tokens, cached_tokens the total, the
``prefixcache`` extension and the metrics by tier. ``cache_control`` marks on segments and on
message content parts become TTL pins in the request's namespace, capped by --max-pin-ttl.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from conftest import Server, demo_engine, serve
from sidecar_fake_engine import FakeEngine

from prefixcache.sidecar import SidecarSettings, create_app

DOC = "The bakery opens at seven. We bake sourdough, rye and brioche every morning. " * 6


@pytest.fixture(scope="module")
def tier_server(server_loop: Any, demo_loaded: Any) -> Any:
    engine = demo_engine(demo_loaded, kv_offload="host:0.1", max_pin_ttl_s=600.0)
    server = serve(server_loop, create_app(engine, SidecarSettings()))
    yield server, engine, server_loop
    server.stop()


def on_engine(loop: Any, engine: Any, fn: Any) -> Any:
    """Run ``fn(LLMEngine)`` on the engine thread (the server's loop drives the call)."""
    return asyncio.run_coroutine_threadsafe(engine.run_on_engine(fn), loop.loop).result(timeout=60)


def chat(root: str, body: dict) -> dict:
    body = {"max_tokens": 4, "temperature": 0, **body}
    response = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_over_spilled_blocks_reloads_them(tier_server: Any) -> None:
    server = tier_server[0]
    root: str = server.root
    messages = [{"role": "system", "content": "[reload] " + DOC}, {"role": "user", "content": "Hi"}]
    cold = chat(root, {"messages": messages})
    evicted = httpx.post(f"{root}/v1/cache/evict", json={"keep_tier": True}).json()[
        "evicted_blocks"
    ]
    assert evicted > 0
    warm = chat(root, {"messages": messages})
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 8
    tiers = warm["prefixcache"]["cached_tokens_by_tier"]
    assert tiers["host"] == cached and tiers["pool"] == 0
    metrics = httpx.get(f"{root}/metrics").text
    assert 'prefixcache:prefix_cache_hits_total{tier="host"}' in metrics
    assert 'prefixcache:kv_tier_bytes{state="used"}' in metrics
    # a plain evict forgets the tier too: the next request is cold
    httpx.post(f"{root}/v1/cache/evict", json={})
    again = chat(root, {"messages": messages})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_reset_prefix_cache_empties_the_tier_unless_reset_external_is_false(
    tier_server: Any,
) -> None:
    """vLLM's reset: by default (and with reset_external=true) the tier is emptied too, as
    /v1/cache/evict empties it; reset_external=false keeps the tier, as vLLM keeps its
    connector's, so the pool's blocks spill into it and the next request reloads them."""
    root = tier_server[0].root
    messages = [{"role": "system", "content": "[reset] " + DOC}, {"role": "user", "content": "Hi"}]
    chat(root, {"messages": messages})
    out = httpx.post(f"{root}/reset_prefix_cache?reset_external=false", timeout=60).json()
    assert out["success"] is True and out["evicted_blocks"] > 0
    tiers = chat(root, {"messages": messages})["prefixcache"]["cached_tokens_by_tier"]
    assert tiers["host"] >= 16 * 8 and tiers["pool"] == 0
    for query in ("", "?reset_external=true"):
        httpx.post(f"{root}/v1/cache/evict", json={"keep_tier": True})  # all of it in the tier
        out = httpx.post(f"{root}/reset_prefix_cache{query}", timeout=60).json()
        assert out["success"] is True
        assert httpx.get(f"{root}/v1/cache/stats").json()["tier"]["used"] == 0
        again = chat(root, {"messages": messages})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_warm_with_a_ttl_pins_until_the_deadline(tier_server: Any) -> None:
    server, engine, loop = tier_server
    root = server.root
    segments = [{"role": "system", "content": "[ttl] " + DOC, "tag": "doc", "stability": "static"}]
    reply = httpx.post(
        f"{root}/v1/cache/warm", json={"segments": segments, "pin": True, "ttl_s": 120}
    ).json()
    assert reply["pinned_blocks"] > 0 and reply["ttl_s"] == 120
    pins = on_engine(loop, engine, lambda e: [p.ttl_s for p in e.block_manager._ttl.values()])
    assert 120 in pins
    refused = httpx.post(f"{root}/v1/cache/warm", json={"segments": segments, "ttl_s": 120})
    assert refused.status_code == 400
    for bad in (0, -1, "soon"):
        body = {"segments": segments, "pin": True, "ttl_s": bad}
        assert httpx.post(f"{root}/v1/cache/warm", json=body).status_code == 400
    httpx.post(f"{root}/v1/cache/evict", json={"include_pinned": True})


def test_cache_control_on_a_segment_and_a_content_part_pins_the_prefix(tier_server: Any) -> None:
    server, engine, loop = tier_server
    root = server.root
    segments = [
        {
            "role": "system",
            "content": "[hint-seg] " + DOC,
            "tag": "doc",
            "stability": "static",
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        },
        {"role": "user", "content": "When do you open?", "tag": "q"},
    ]
    chat(root, {"segments": segments})
    parts = [
        {"type": "text", "text": "[hint-msg] " + DOC, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " And one more thing."},
    ]
    chat(
        root, {"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "?"}]}
    )

    def ttl_pins(e: Any) -> list[tuple[float, int]]:
        return sorted((p.ttl_s, p.depth) for p in e.block_manager._ttl.values())

    pins = on_engine(loop, engine, ttl_pins)
    assert [ttl for ttl, _ in pins] == [300.0, 600.0]  # 5m; 1h capped at --max-pin-ttl 600
    assert all(depth >= 8 for _, depth in pins)
    httpx.post(f"{root}/v1/cache/evict", json={"include_pinned": True})


def test_cache_control_marks_reach_the_engine_as_retention_hints(fake_server: Server) -> None:
    engine: FakeEngine = fake_server.app.state.sidecar.engine
    mark = {"type": "ephemeral", "ttl": "5m"}
    segments = [
        {"role": "system", "content": "rules " * 10, "tag": "a", "stability": "static"},
        {"role": "user", "content": "q", "tag": "b", "cache_control": mark},
    ]
    chat(fake_server.root, {"model": "fake", "segments": segments})
    request = engine.received[-1]
    assert request.retain is not None and len(request.retain) == 1
    assert request.retain[0].ttl_s == 300.0
    assert request.retain[0].end == request.segments[1].end
    too_many = [
        {"role": "user", "content": f"s{i}", "tag": f"t{i}", "cache_control": mark}
        for i in range(5)
    ]
    body = {"model": "fake", "segments": too_many, "max_tokens": 2}
    response = httpx.post(f"{fake_server.root}/v1/chat/completions", json=body)
    assert response.status_code == 400 and "breakpoints" in response.json()["error"]["message"]
    bad = [{"role": "user", "content": "x", "tag": "t", "cache_control": {"type": "forever"}}]
    body = {"model": "fake", "segments": bad, "max_tokens": 2}
    assert httpx.post(f"{fake_server.root}/v1/chat/completions", json=body).status_code == 400


def test_openais_prompt_cache_breakpoints_are_retention_hints(fake_server: Server) -> None:
    """OpenAI's ``prompt_cache_breakpoint`` on a chat text part (its SDK sends it) was a 400
    (an unknown field); now it is the same hint as ``cache_control``, with OpenAI's lifetimes,
    and a conversation's older breakpoints are not refused: the latest four are written."""
    engine: FakeEngine = fake_server.app.state.sidecar.engine

    def part(text: str, ttl: str | None = None) -> dict[str, Any]:
        mark = {"mode": "explicit"} | ({"ttl": ttl} if ttl else {})
        return {"type": "text", "text": text, "prompt_cache_breakpoint": mark}

    system = {"role": "system", "content": [part("rules " * 10), part("more rules", "12h")]}
    chat(
        fake_server.root, {"model": "fake", "messages": [system, {"role": "user", "content": "q"}]}
    )
    retain = engine.received[-1].retain
    assert retain is not None and [h.ttl_s for h in retain] == [1800.0, 12 * 3600.0]
    assert 0 < retain[0].end < retain[1].end
    turns = [{"role": "user", "content": [part(f"turn {i} " * 3)]} for i in range(6)]
    chat(fake_server.root, {"model": "fake", "messages": turns})
    retain = engine.received[-1].retain
    assert retain is not None and len(retain) == 4
    ends = [h.end for h in retain]
    assert ends == sorted(ends) and ends[0] > 0  # the four latest: the first two dropped
    # the same on /v1/responses' input parts (accepted and ignored before)
    item = part("rules " * 10, "12h") | {"type": "input_text"}
    body = {"model": "fake", "input": [{"role": "user", "content": [item]}]}
    response = httpx.post(f"{fake_server.root}/v1/responses", json=body | {"max_output_tokens": 2})
    assert response.status_code == 200, response.text
    retain = engine.received[-1].retain
    assert retain is not None and [h.ttl_s for h in retain] == [12 * 3600.0]
    bad = {
        "role": "user",
        "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {}}],
    }
    body = {"model": "fake", "messages": [bad], "max_tokens": 2}
    assert httpx.post(f"{fake_server.root}/v1/chat/completions", json=body).status_code == 400
