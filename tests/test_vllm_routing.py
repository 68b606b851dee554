"""Precise routing over real vLLM replicas (``make test-vllm`` only; skipped otherwise).

PREFIXCACHE_VLLM_UPSTREAMS: ``URL,events=ZMQ,replay=ZMQ`` specs joined by ``;`` (what
tests/vllm_replicas.py starts); PREFIXCACHE_VLLM_TOKENIZER: the model folder they serve.
Multi-turn conversations must keep landing on their replica, as ``precise`` decisions read
from vLLM's own KV events, and vLLM must report the history as cached.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Server, ServerLoop, serve

from prefixcache.sidecar.cli.route_command import parse_upstream
from prefixcache.sidecar.router.app import UpstreamSettings, create_upstream_app

SPECS = os.environ.get("PREFIXCACHE_VLLM_UPSTREAMS")
pytestmark = pytest.mark.skipif(not SPECS, reason="make test-vllm sets PREFIXCACHE_VLLM_UPSTREAMS")


@pytest.fixture(scope="module")
def router(server_loop: ServerLoop) -> Iterator[Server]:
    from prefixcache.engine.text.tokenizer import Tokenizer

    assert SPECS
    parsed = [parse_upstream(spec) for spec in SPECS.split(";")]
    settings = UpstreamSettings(
        tuple(url for url, _ in parsed),
        events={url: source for url, source in parsed if source is not None},
        tokenizer=Tokenizer.from_folder(os.environ["PREFIXCACHE_VLLM_TOKENIZER"]),
    )
    server = serve(server_loop, create_upstream_app(settings), health=False)
    yield server
    server.stop()


def decisions(router: Server) -> dict[tuple[str, str], float]:
    counter = router.app.state.upstream.metrics.decisions
    return {
        (s.labels["upstream"], s.labels["reason"]): s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def test_conversations_stick_to_their_vllm_replica(router: Server) -> None:
    words = ["ferry", "harbour", "timetable", "platform", "ticket", "coastal", "island", "bridge"]
    conversations: list[list[dict[str, Any]]] = [
        [
            {
                "role": "system",
                "content": f"Agent {i}. " + " ".join(words[(i + k) % 8] for k in range(120)),
            }
        ]
        for i in range(4)
    ]
    homes: dict[int, str] = {}
    for turn in range(3):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Turn {turn} for {i}?"})
            before = decisions(router)
            body = {"model": "demo", "messages": messages, "max_tokens": 4, "temperature": 0}
            reply = httpx.post(f"{router.url}/chat/completions", json=body, timeout=300).json()
            after = decisions(router)
            ((upstream, reason),) = [k for k, v in after.items() if v != before.get(k, 0)]
            if turn == 0:
                homes[i] = upstream
            else:
                assert (upstream, reason) == (homes[i], "precise"), (i, turn)
                details = reply["usage"].get("prompt_tokens_details") or {}
                assert details.get("cached_tokens", 0) >= 16
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )
        time.sleep(1.0)  # vLLM publishes after its step; let the events arrive
    assert len(set(homes.values())) == 2
