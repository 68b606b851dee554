"""The sidecar over the real engine on the demo model, through httpx and the openai client."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest
from conftest import Server, ServerLoop, demo_engine, serve, wait_for_idle_blocks

from prefixcache.sidecar.server.app import SidecarSettings, create_app

SYSTEM = (
    "You are the support assistant of a small bakery. Answer in one short sentence. "
    "Opening hours are seven to three, Tuesday to Sunday. We bake sourdough, rye and "
    "brioche every morning, and cakes to order with two days' notice. "
)


def system_prompt(name: str) -> str:
    """A long system prompt unique to one test, so no other test has cached it."""
    return f"[{name}] " + SYSTEM * 3


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def client(sidecar_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sidecar_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(sidecar_url: str) -> str:
    return httpx.get(f"{sidecar_url}/models").json()["data"][0]["id"]


def test_models_and_health(sidecar_server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert models.data[0].owned_by == "prefixcache"
    assert models.data[0].model_extra["max_model_len"] > 0  # vLLM's field
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(f"{sidecar_server.root}/health").json() == {"status": "ok"}


def test_second_request_with_the_same_system_prompt_is_cached(
    client: openai.OpenAI, model: str
) -> None:
    system = system_prompt("cached")
    usages = []
    for question in ("When do you open?", "Do you bake rye bread on Mondays?"):
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert response.object == "chat.completion"
        assert response.choices[0].message.role == "assistant"
        assert response.choices[0].finish_reason in ("stop", "length")
        usages.append((response.usage, response.model_extra["prefixcache"]))
    (cold, cold_report), (warm, warm_report) = usages
    # Only the template's opening tokens can be shared with other tests' prompts.
    assert cold.prompt_tokens_details.cached_tokens < 16
    assert cold_report["segments"] == []
    # The whole system message is a token prefix of the second prompt.
    assert warm.prompt_tokens_details.cached_tokens >= 100
    assert warm.prompt_tokens_details.cached_tokens < warm.prompt_tokens
    assert warm_report["cached_tokens"] == warm.prompt_tokens_details.cached_tokens
    assert warm_report["computed_tokens"] == warm.prompt_tokens - warm_report["cached_tokens"]
    assert warm.total_tokens == warm.prompt_tokens + warm.completion_tokens
    # OpenAI's cache_write_tokens (its SDK has the field; it was null): the KV computed now
    for usage in (cold, warm):
        details = usage.prompt_tokens_details
        assert details.cache_write_tokens == usage.prompt_tokens - details.cached_tokens


def test_non_streamed_responses_say_where_the_engine_spent_the_time(sidecar_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{sidecar_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    timing = {}
    for metric in response.headers["server-timing"].split(","):
        name, duration = metric.strip().split(";dur=")
        timing[name] = float(duration)
    assert list(timing) == ["queue", "prefill", "decode", "engine"]
    assert timing["prefill"] > 0 and timing["decode"] > 0
    parts = timing["queue"] + timing["prefill"] + timing["decode"]
    assert abs(parts - timing["engine"]) < 0.01


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    messages = [
        {"role": "system", "content": system_prompt("stream")},
        {"role": "user", "content": "What cakes do you make?"},
    ]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["prefixcache"]["prompt_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # second time round


def test_completions_stream_and_not(client: openai.OpenAI, sidecar_url: str, model: str) -> None:
    prompt = "The prefix cache keeps the key and value state of a prompt in"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens >= 1
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    # Token ids are accepted too, and the cache reports the hit on the same text.
    body = {"prompt": [0, 12, 40, 41, 42, 43, 44, 45, 46, 47] * 4, "max_tokens": 3}
    first = httpx.post(f"{sidecar_url}/completions", json=body, timeout=60).json()
    second = httpx.post(f"{sidecar_url}/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens"] == 40
    # At least the first request's two full blocks; never the last prompt token.
    assert 32 <= second["usage"]["prompt_tokens_details"]["cached_tokens"] <= 39


def test_segments_report_which_segment_broke_reuse(sidecar_url: str) -> None:
    def send(shared: str, question: str) -> dict:
        segments = [  # deliberately out of order: the server sorts by stability
            {"role": "user", "content": question, "tag": "question", "stability": "dynamic"},
            {"role": "system", "content": shared, "tag": "policy", "stability": "shared"},
            {
                "role": "system",
                "content": system_prompt("segments"),
                "tag": "rules",
                "stability": "static",
            },
        ]
        body = {"segments": segments, "max_tokens": 3, "temperature": 0}
        response = httpx.post(f"{sidecar_url}/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["prefixcache"]

    policy = "Refunds within seven days with a receipt."
    cold = send(policy, "Can I return a cake?")
    assert [s["tag"] for s in cold["segments"]] == ["rules", "policy", "question"]
    # Only the template's opening tokens can be shared with other tests' prompts.
    assert cold["segments"][0]["cached_tokens"] < 16, cold
    assert [s["cached_tokens"] for s in cold["segments"][1:]] == [0, 0]
    assert cold["prompt_tokens"] > sum(s["tokens"] for s in cold["segments"])  # + gen prompt

    warm = send(policy, "Do you sell bread?")
    rules, shared, question = warm["segments"]
    assert rules["cached_tokens"] == rules["tokens"] > 0
    assert shared["cached_tokens"] == shared["tokens"] > 0
    assert question["cached_tokens"] < question["tokens"]

    changed = send("Refunds within thirty days, no receipt needed.", "Do you sell bread?")
    rules, shared, question = changed["segments"]
    assert rules["cached_tokens"] == rules["tokens"]
    assert shared["cached_tokens"] < shared["tokens"]  # the policy broke reuse
    assert question["cached_tokens"] == 0


def test_greedy_outputs_equal_with_cache_on_and_off(
    sidecar_url: str, nocache_server: Server
) -> None:
    system = system_prompt("greedy")
    for question in ("Are you open on Monday?", "Are you open on Sunday?", "Is brioche daily?"):
        body = {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        cached = httpx.post(f"{sidecar_url}/chat/completions", json=body, timeout=60).json()
        plain = httpx.post(f"{nocache_server.url}/chat/completions", json=body, timeout=60).json()
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert (
            cached["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        )
        assert cached["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 8
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the check had hits


def test_stream_sends_prefixcache_on_the_finish_chunk_and_done(sidecar_url: str) -> None:
    body = {
        "segments": [
            {
                "role": "system",
                "content": system_prompt("sse"),
                "tag": "sys",
                "stability": "static",
            },
            {"role": "user", "content": "Hello?", "tag": "q", "stability": "dynamic"},
        ],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{sidecar_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == {"done": True}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    assert [s["tag"] for s in finish[0]["prefixcache"]["segments"]] == ["sys", "q"]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_cache_admin_warm_pin_unpin_evict(sidecar_server: Server) -> None:
    root = sidecar_server.root
    segments = [
        {
            "role": "system",
            "content": system_prompt("admin"),
            "tag": "rules",
            "stability": "static",
        },
        {"role": "user", "content": "Any gluten-free bread?", "tag": "q", "stability": "dynamic"},
    ]
    warm = httpx.post(f"{root}/v1/cache/warm", json={"segments": segments, "pin": True}).json()
    assert warm["tokens"] > 100 and warm["cached_tokens"] < 16
    assert warm["pinned_blocks"] == warm["tokens"] // 16  # every full block of the prefix
    assert httpx.get(f"{root}/v1/cache/stats").json()["blocks"]["pinned"] >= warm["pinned_blocks"]

    evicted = httpx.post(f"{root}/v1/cache/evict", json={}).json()["evicted_blocks"]
    assert evicted >= 0
    body = {"segments": segments, "max_tokens": 2}
    report = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60).json()["prefixcache"]
    # Pinned full blocks survive the eviction (a partial last block is never cached).
    assert report["segments"][0]["cached_tokens"] == warm["pinned_blocks"] * 16

    unpinned = httpx.post(f"{root}/v1/cache/unpin", json={"segments": segments}).json()
    assert unpinned["unpinned_blocks"] == warm["pinned_blocks"]
    httpx.post(f"{root}/v1/cache/evict", json={})
    report = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60).json()["prefixcache"]
    assert report["cached_tokens"] == 0  # unpinned blocks were evicted this time
    stats = httpx.get(f"{root}/v1/cache/stats").json()
    assert set(stats) == {
        "block_size",
        "kv_cache_dtype",
        "blocks",
        "tokens",
        "hit_rate",
        "tokenizer_pieces",
    }
    assert stats["kv_cache_dtype"] in ("float32", "bfloat16")  # what the pages hold
    assert set(stats["blocks"]) == {"total", "free", "cached_idle", "in_use", "pinned"}
    pieces = stats["tokenizer_pieces"]  # the same system prompt was tokenized once
    assert pieces["hits"] > 0 and pieces["entries"] > 0 and pieces["chars"] > 0


def test_a_warm_with_tools_is_the_prefix_the_tool_using_chat_hits(tools_sidecar: Server) -> None:
    """On a template that renders tools (Llama 3.1's way: in the first user turn), a pinned
    warm of an agent's first turn with its tools is what the next turn finds cached after an
    evict, to the last whole block; unpin of the same body lets the next evict drop it."""
    root = tools_sidecar.root
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a product up in the bakery's catalogue.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "day": {"enum": ["today", "tomorrow"]}},
                "required": ["name"],
            },
        },
    }
    first = [
        {"role": "system", "content": system_prompt("warm-tools")},
        {"role": "user", "content": "Which loaves are baked every morning?"},
    ]
    body = {"messages": first, "tools": [lookup]}
    warm = httpx.post(f"{root}/v1/cache/warm", json={**body, "pin": True}, timeout=120).json()
    block = httpx.get(f"{root}/v1/cache/stats").json()["block_size"]
    assert warm["pinned_blocks"] == warm["tokens"] // block > 0
    httpx.post(f"{root}/v1/cache/evict", json={})
    later = [
        *first,
        {"role": "assistant", "content": "Sourdough, rye and brioche."},
        {"role": "user", "content": "And cakes?"},
    ]

    def cached() -> int:
        # the client's tools in another key order: the same canonical tools, the same prefix
        tools = [json.loads(json.dumps(lookup, sort_keys=True))]
        chat = {"messages": later, "tools": tools, "max_tokens": 2}
        reply = httpx.post(f"{root}/v1/chat/completions", json=chat, timeout=120).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == warm["pinned_blocks"] * block  # the pinned blocks outlived the evict
    unpinned = httpx.post(f"{root}/v1/cache/unpin", json=body, timeout=60).json()
    assert unpinned["unpinned_blocks"] == warm["pinned_blocks"]
    httpx.post(f"{root}/v1/cache/evict", json={})
    # gone, but for a template header another test on this shared server may have pinned
    assert cached() < warm["pinned_blocks"] * block


def test_reset_prefix_cache_evicts_as_evict_does_in_vllms_shape(sidecar_server: Server) -> None:
    """vLLM's POST /reset_prefix_cache: 200 {"success": true}, and the next request is cold;
    pinned prefixes are kept, as /v1/cache/evict keeps them."""
    root = sidecar_server.root
    messages = [
        {"role": "system", "content": system_prompt("reset")},
        {"role": "user", "content": "Rye or spelt?"},
    ]

    def cached() -> int:
        body = {"messages": messages, "max_tokens": 2}
        reply = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() >= 64
    refused = {
        "?reset_running_requests=true": "reset_running_requests",  # vLLM preempts them
        "?reset_external=maybe": "reset_external",
        "?device=gpu": "device",  # an older vLLM's; the current one ignores it
    }
    for query, param in refused.items():
        reply = httpx.post(f"{root}/reset_prefix_cache{query}", timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert httpx.post(f"{root}/reset_prefix_cache", json={"x": 1}).status_code == 400
    assert cached() >= 64  # a refused reset dropped nothing
    reply = httpx.post(f"{root}/reset_prefix_cache", timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["success"] is True and out["in_use_blocks"] == 0
    assert out["evicted_blocks"] >= 4
    assert cached() == 0  # cold, as after /v1/cache/evict

    segments = [
        {
            "role": "system",
            "content": system_prompt("reset-pin"),
            "tag": "rules",
            "stability": "static",
        },
        {"role": "user", "content": "Rye?", "tag": "q", "stability": "dynamic"},
    ]
    warm = httpx.post(f"{root}/v1/cache/warm", json={"segments": segments, "pin": True}).json()
    assert warm["pinned_blocks"] > 0
    out = httpx.post(f"{root}/reset_prefix_cache?reset_external=true", timeout=60).json()
    assert out["success"] is True and out["pinned_blocks"] >= warm["pinned_blocks"]
    body = {"segments": segments, "max_tokens": 2}
    report = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60).json()["prefixcache"]
    assert report["segments"][0]["cached_tokens"] == warm["pinned_blocks"] * 16  # kept
    httpx.post(f"{root}/v1/cache/unpin", json={"segments": segments})
    httpx.post(f"{root}/v1/cache/evict", json={})


def test_reset_prefix_cache_leaves_running_requests_running(sidecar_server: Server) -> None:
    """A request running through the reset finishes as it would have; its blocks were held,
    so ``success`` is false (vLLM's answer while blocks are held) and they stay cached."""
    root = sidecar_server.root
    messages = [
        {"role": "system", "content": system_prompt("reset-running")},
        {"role": "user", "content": "Tell me everything."},
    ]
    body = {"messages": messages, "max_tokens": 300, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{root}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        reset = httpx.post(f"{root}/reset_prefix_cache", timeout=60)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert reset.status_code == 200, reset.text
    out = reset.json()
    assert out["in_use_blocks"] > 0 and out["success"] is False
    assert [e["choices"][0]["finish_reason"] for e in rest if e["choices"]][-1] == "length"
    assert rest[-1]["usage"]["completion_tokens"] == 300  # every token came
    wait_for_idle_blocks(root)
    again = {"messages": messages, "max_tokens": 1}
    hit = httpx.post(f"{root}/v1/chat/completions", json=again, timeout=60).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # held, so kept
    out = httpx.post(f"{root}/reset_prefix_cache", timeout=60).json()
    assert out == {**out, "success": True, "in_use_blocks": 0}  # idle now: a retry succeeds
    cold = httpx.post(f"{root}/v1/chat/completions", json=again, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_metrics_expose_http_and_engine_series(sidecar_server: Server) -> None:
    httpx.get(f"{sidecar_server.url}/models")
    httpx.get(f"{sidecar_server.root}/no/such/path")
    text = httpx.get(f"{sidecar_server.root}/metrics").text
    assert 'prefixcache:http_requests_total{method="GET",route="/v1/models",status="200"}' in text
    assert 'route="other",status="404"' in text
    assert "prefixcache:http_request_duration_seconds_bucket" in text
    engine_series = [
        line
        for line in text.splitlines()
        if line.startswith("prefixcache:") and not line.startswith("prefixcache:http_")
    ]
    assert engine_series, "the engine registry is missing from /metrics"


def test_no_block_in_use_when_idle(sidecar_server: Server) -> None:
    assert wait_for_idle_blocks(sidecar_server.root)["blocks"]["in_use"] == 0


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy


def test_openai_client_sends_segments_through_extra_body(client: openai.OpenAI) -> None:
    """The official client requires `messages`; segment users pass [] and `extra_body`."""
    segments = [
        {
            "role": "system",
            "content": system_prompt("extra-body"),
            "tag": "rules",
            "stability": "static",
        },
        {"role": "user", "content": "Is it open?", "tag": "q", "stability": "dynamic"},
    ]
    reports = []
    for _ in range(2):
        response = client.chat.completions.create(
            model="demo", messages=[], max_tokens=2, extra_body={"segments": segments}
        )
        reports.append(response.model_extra["prefixcache"])
    assert [s["tag"] for s in reports[1]["segments"]] == ["rules", "q"]
    rules = reports[1]["segments"][0]
    assert rules["cached_tokens"] == rules["tokens"] > 0
    assert response.usage.prompt_tokens_details.cached_tokens == reports[1]["cached_tokens"]


def test_metrics_have_no_created_series(sidecar_server: Server) -> None:
    """prometheus_client's *_created gauge per counter and histogram (17 series): off, as vLLM
    has them."""
    httpx.post(
        f"{sidecar_server.url}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    text = httpx.get(f"{sidecar_server.root}/metrics", timeout=30).text
    assert "_total" in text  # counters are there
    assert [line for line in text.splitlines() if "_created" in line] == []


@pytest.mark.parametrize("stream", [True, False])
def test_abort_all_ends_requests_in_flight_cleanly(
    server_loop: ServerLoop, demo_loaded: Any, stream: bool
) -> None:
    """What a stop does after its drain (serve_command.drain_on_exit): a stream ends with an
    error event and [DONE], a whole answer is a 503; the engine is left idle."""
    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    engine = server.app.state.sidecar.engine
    try:
        body = {"prompt": "once upon a time", "max_tokens": 1000, "ignore_eos": True}
        if stream:
            lines: list[str] = []
            with httpx.stream(
                "POST", f"{server.url}/completions", json={**body, "stream": True}, timeout=120
            ) as reply:
                for line in reply.iter_lines():
                    lines.append(line)
                    if len(lines) == 10:
                        server_loop.loop.call_soon_threadsafe(engine.abort_all, "shutting down")
            data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert data[-1] == "[DONE]", lines[-4:]
            assert "shutting down" in json.loads(data[-2])["error"]["message"]
        else:
            pending = threading.Timer(
                0.5,
                lambda: server_loop.loop.call_soon_threadsafe(engine.abort_all, "shutting down"),
            )
            pending.start()
            reply = httpx.post(f"{server.url}/completions", json=body, timeout=120)
            assert reply.status_code == 503 and "shutting down" in reply.text
        wait_for_idle_blocks(server.root)
        assert engine.num_running == 0
    finally:
        server.stop()
