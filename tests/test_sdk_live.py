"""The SDK against a real sidecar on loopback (``sidecar_url`` comes from tests/conftest.py).

Each test uses its own static text, so that one test's cached blocks never serve another's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from prefixcache.sdk import AsyncClient, Client, Prompt

RULES = (
    "You are a patient librarian who answers questions about the catalogue. Keep answers "
    "short, cite the shelf code of every book you mention, and say when you do not know. "
)


def _prompt(name: str, question: str = "Which shelf holds atlases?") -> Prompt:
    return (
        Prompt.builder()
        .static(f"[sdk-{name}] " + RULES * 4, tag="rules")
        .shared("Shelf A: atlases and maps. Shelf B: poetry. Shelf C: cookery. " * 3, tag="doc")
        .dynamic(question, tag="q")
        .build()
    )


def _run(fn: Callable[[AsyncClient], Awaitable[None]], url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url) as client:
            await fn(client)

    anyio.run(main)


def test_complete(sidecar_url: str) -> None:
    async def check(client: AsyncClient) -> None:
        out = await client.complete(_prompt("complete"), max_tokens=4, temperature=0.0)
        assert isinstance(out.text, str) and out.finish_reason in ("stop", "length")
        assert out.usage.completion_tokens and 1 <= out.usage.completion_tokens <= 4
        assert out.cache is not None
        assert [s.tag for s in out.cache.segments] == ["rules", "doc", "q"]
        assert out.cache.prompt_tokens == out.usage.prompt_tokens

    _run(check, sidecar_url)


def test_stream(sidecar_url: str) -> None:
    async def check(client: AsyncClient) -> None:
        stream = client.stream(_prompt("stream"), max_tokens=4, temperature=0.0)
        deltas = [d async for d in stream]
        assert stream.finish_reason in ("stop", "length")
        assert stream.text == "".join(d.text for d in deltas)
        assert stream.cache is not None and len(stream.cache.segments) == 3
        assert stream.usage is not None and stream.usage.prompt_tokens == stream.cache.prompt_tokens
        assert stream.ttft is not None and stream.ttft > 0

    _run(check, sidecar_url)


def test_warm_then_request_reports_cached_tokens(sidecar_url: str) -> None:
    async def check(client: AsyncClient) -> None:
        prompt = _prompt("warm")
        warmed = await client.warm(prompt)
        assert 0 <= warmed.cached_tokens < warmed.tokens  # only a template start can be cached
        out = await client.complete(prompt, max_tokens=2, temperature=0.0)
        # everything warmed is reused, give or take the block the dynamic tail starts in
        block = (await client.cache_stats()).block_size
        assert out.usage.cached_tokens >= warmed.tokens - block
        assert out.cache is not None and out.cache.segment("rules").cached_tokens > 0

    _run(check, sidecar_url)


def test_per_segment_report_on_second_request(sidecar_url: str) -> None:
    async def check(client: AsyncClient) -> None:
        first = await client.complete(_prompt("segments", "Where is poetry?"), max_tokens=2)
        second = await client.complete(_prompt("segments", "Where is cookery?"), max_tokens=2)
        assert first.cache is not None and second.cache is not None
        rules, doc = second.cache.segment("rules"), second.cache.segment("doc")
        assert rules.cached_tokens > 0 and doc.cached_tokens > 0
        assert rules.cached_tokens <= rules.tokens and doc.cached_tokens <= doc.tokens
        assert sum(s.cached_tokens for s in second.cache.segments) == second.cache.cached_tokens
        assert second.cache.cached_tokens == second.usage.cached_tokens
        assert second.cache.cached_tokens > first.cache.cached_tokens

    _run(check, sidecar_url)


def test_cache_stats_with_the_sync_client(sidecar_url: str) -> None:
    with Client(sidecar_url) as client:
        client.complete(_prompt("stats"), max_tokens=1)
        stats = client.cache_stats()
    assert stats.block_size > 0 and stats.blocks.total > 0
    assert stats.blocks.free + stats.blocks.cached_idle + stats.blocks.in_use <= stats.blocks.total
    assert stats.tokens.queries > 0 and 0.0 <= stats.hit_rate <= 1.0


def test_session_report_names_the_segment_that_broke_the_prefix(sidecar_url: str) -> None:
    def prompt(doc: str, question: str) -> Prompt:
        return (
            Prompt.builder()
            .static("[sdk-report] " + RULES * 4, tag="rules")
            .shared(f"Shelf {doc}: " + "atlases, maps and globes. " * 6, tag="doc")
            .dynamic(question, tag="q")
            .build()
        )

    async def check(client: AsyncClient) -> None:
        first = await client.complete(prompt("A", "Where are maps?"), max_tokens=1)
        second = await client.complete(prompt("A", "Where are globes?"), max_tokens=1)
        third = await client.complete(prompt("B", "Where are atlases?"), max_tokens=1)
        assert second.usage.cached_tokens > third.usage.cached_tokens > 0
        for out in (second, third):
            u = out.usage
            assert u.cached_tokens + u.uncached_tokens == u.prompt_tokens
            assert out.cache is not None and u.cache_write_tokens == out.cache.computed_tokens
        (family,) = client.cache_report().families
        assert family.label == "rules" and family.requests == 3
        assert family.cached_tokens == sum(o.usage.cached_tokens for o in (first, second, third))
        assert family.prompt_tokens == sum(
            o.usage.prompt_tokens or 0 for o in (first, second, third)
        )
        (miss,) = family.misses
        assert miss.request == 3 and miss.segment == "doc"
        assert miss.previous_cached_tokens == second.usage.cached_tokens

    _run(check, sidecar_url)


def test_ttl_marks_keep_the_stable_prefix_pinned(sidecar_url: str) -> None:
    """``ttl`` puts cache_control where each stable class ends, as the Anthropic rendering
    does; the sidecar turns the marks into TTL pins of the prefix up to there."""
    prompt = _prompt("ttl")
    marked = [s["tag"] for s in prompt.to_segments("5m") if "cache_control" in s]
    anthropic = prompt.to_anthropic(max_tokens=1, ttl="5m")
    assert marked == ["rules", "doc"]
    assert [b["cache_control"]["ttl"] for b in anthropic["system"]] == ["5m"]
    assert all("cache_control" not in s for s in prompt.to_segments())

    async def check(client: AsyncClient) -> None:
        before = (await client.cache_stats()).blocks.pinned
        await client.complete(prompt, max_tokens=1, temperature=0.0)
        assert (await client.cache_stats()).blocks.pinned == before  # no marks, no pins
        await client.complete(prompt, max_tokens=1, temperature=0.0, ttl="5m")
        deadline = anyio.current_time() + 30  # bounds a hang only: generous under load
        while anyio.current_time() < deadline:  # stats: the engine's snapshot after a step
            if (await client.cache_stats()).blocks.pinned > before:
                break
            await anyio.sleep(0.05)
        assert (await client.cache_stats()).blocks.pinned > before
        # two marks, two TTL pins (through "rules", through "doc"): each an ordinary pin
        # until it lapses, so unpinning both prefixes leaves nothing pinned
        assert await client.unpin(prompt) > 0
        assert await client.unpin(prompt.without("doc")) > 0
        assert (await client.cache_stats()).blocks.pinned == before

    _run(check, sidecar_url)


def test_warm_with_a_ttl_pins_until_unpinned(sidecar_url: str) -> None:
    prompt = _prompt("warm-ttl")

    async def check(client: AsyncClient) -> None:
        before = (await client.cache_stats()).blocks.pinned
        warmed = await client.warm(prompt, pin=True, ttl_s=300)
        assert warmed.pinned_blocks > 0
        assert (await client.cache_stats()).blocks.pinned == before + warmed.pinned_blocks
        assert await client.unpin(prompt) == warmed.pinned_blocks
        assert (await client.cache_stats()).blocks.pinned == before

    _run(check, sidecar_url)


def test_the_messages_wire_gives_the_hosted_accounting(sidecar_url: str) -> None:
    """``wire="messages"``: the Anthropic rendering to the sidecar's /v1/messages; usage as
    Anthropic reports it (writes at the breakpoints, then reads), plus the cache report."""

    async def main() -> None:
        async with AsyncClient(sidecar_url) as admin:
            before = (await admin.cache_stats()).blocks.pinned
        async with AsyncClient(sidecar_url, wire="messages") as client:
            first = await client.complete(_prompt("messages"), max_tokens=3, ttl="5m")
            assert first.usage.cache_write_tokens > 100
            assert first.usage.cached_tokens < 32  # only the template's head
            assert (
                first.cache is not None and first.cache.prompt_tokens == first.usage.prompt_tokens
            )
            prefix = first.usage.cache_write_tokens + first.usage.cached_tokens
            again = client.stream(_prompt("messages", "Where is poetry?"), max_tokens=3, ttl="5m")
            deltas = [d async for d in again]
            assert again.text == "".join(d.text for d in deltas)
            assert again.usage is not None and again.usage.cached_tokens == prefix
            assert again.usage.cache_write_tokens == 0  # the question sits after the last mark
            assert again.cache is not None and again.cache.cached_tokens >= prefix
        # The marks' TTL pins would outlive this test (an evict keeps them): drop them, so
        # later tests on this shared server start from what they left.
        async with AsyncClient(sidecar_url) as admin:
            await admin.unpin(_prompt("messages"))
            await admin.unpin(_prompt("messages").without("doc"))
            assert (await admin.cache_stats()).blocks.pinned == before

    anyio.run(main)
