"""client.cache_report(): per-family statistics over a scripted run of hits and misses."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from prefixcache.sdk import AsyncClient, Price, Prompt, Segment, Usage
from prefixcache.sdk.session_report import SessionLedger
from prefixcache.sdk.types import PromptTokensDetails

SEGMENT_TOKENS = 20  # the fake server counts 20 tokens per segment


def _prompt(doc: str, question: str, rules: str = "Answer from the document.") -> Prompt:
    return (
        Prompt.builder()
        .static(rules, tag="rules")
        .shared(f"Document {doc}.", tag=f"doc:{doc}")
        .dynamic(question, tag="q")
        .build()
    )


def _server(script: list[tuple[int, dict[str, Any]]]) -> httpx.MockTransport:
    """Answers request i with script[i]: (cached tokens, {tag: miss reason})."""
    calls = iter(script)

    def handle(request: httpx.Request) -> httpx.Response:
        cached, misses = next(calls)
        segments = json.loads(request.content)["segments"]
        prompt_tokens = SEGMENT_TOKENS * len(segments)
        report_segments = []
        for i, seg in enumerate(segments):
            start = i * SEGMENT_TOKENS
            hit = max(0, min(SEGMENT_TOKENS, cached - start))
            entry: dict[str, Any] = {"tag": seg["tag"], "tokens": SEGMENT_TOKENS}
            entry["cached_tokens"] = hit
            if seg["tag"] in misses:
                entry["miss"] = misses[seg["tag"]]
            report_segments.append(entry)
        body = {
            "id": "c",
            "model": "demo",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 1,
                "total_tokens": prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            "prefixcache": {
                "cached_tokens": cached,
                "prompt_tokens": prompt_tokens,
                "computed_tokens": prompt_tokens - cached,
                "segments": report_segments,
            },
        }
        return httpx.Response(200, json=body)

    return httpx.MockTransport(handle)


SCRIPT: list[tuple[Prompt, int, dict[str, Any]]] = [
    (_prompt("a", "q1"), 0, {}),  # cold
    (_prompt("a", "q2"), 40, {}),  # rules + doc:a from the cache
    (_prompt("b", "q3"), 20, {"doc:b": "new content"}),  # another document: miss at doc:b
    (_prompt("b", "q4"), 40, {}),
    (_prompt("b", "q5"), 0, {"rules": {"reason": "evicted", "blocks": 2}}),  # server dropped it
    (_prompt("a", "q6", rules="Another bot."), 0, {}),  # a second family
    (_prompt("a", "q7", rules="Another bot."), 40, {}),
]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_scripted_hits_and_misses(loop: str) -> None:
    transport = _server([(cached, misses) for _, cached, misses in SCRIPT])

    async def main() -> None:
        async with AsyncClient("http://sidecar.test/v1", transport=transport) as client:
            for prompt, _, _ in SCRIPT[:3]:
                await client.complete(prompt)
            for prompt, _, _ in SCRIPT[3:]:  # streams count the same
                async for _ in client.stream(prompt):
                    pass
            report = client.cache_report(prices=Price(input=3.0, cached_input=0.3))

        assert report.requests == 7 and len(report.families) == 2
        first, second = report.families
        assert (
            first.label == "rules"
            and first.family == _prompt("x", "y").fingerprint().through("static")[:12]
        )
        assert (first.requests, first.prompt_tokens, first.cached_tokens) == (5, 300, 100)
        assert first.cache_write_tokens == 200 and first.uncached_tokens == 200
        assert first.hit_rate == pytest.approx(100 / 300)
        assert first.savings == pytest.approx(100 * 2.7 / 1e6)
        (doc_miss, evicted) = first.misses
        assert (doc_miss.request, doc_miss.cached_tokens, doc_miss.previous_cached_tokens) == (
            3,
            20,
            40,
        )
        assert doc_miss.segment == "doc:b" and doc_miss.reason == "new content"
        assert doc_miss.diff is not None and doc_miss.diff.tag_a == "doc:a"
        assert (evicted.request, evicted.segment, evicted.diff, evicted.reason) == (
            5,
            None,
            None,
            "evicted",
        )
        assert (second.requests, second.cached_tokens, second.misses) == (2, 40, ())
        assert report.hit_rate == pytest.approx(140 / 420)
        assert report.savings == pytest.approx(140 * 2.7 / 1e6)

        table = str(report)
        lines = table.splitlines()
        assert lines[0].split()[:2] == ["family", "requests"] and len(lines) == 4
        assert "#5 same stable part (evicted)" in lines[1]
        assert lines[3].startswith("total") and "33.3%" in lines[3] and "2 misses" in lines[3]
        # a family by its label, its digest or the digest's start the table shows
        assert report.family(first.family) is first
        assert report.family(lines[1].split()[1]) is first
        assert report.family(lines[2].split()[1]) is second
        assert second.label == "rules"  # two families, one label: the label alone is ambiguous
        with pytest.raises(KeyError, match="names 2 families"):
            report.family("rules")
        with pytest.raises(KeyError, match="there are: rules"):
            report.family("tools")

    anyio.run(main, backend=loop)


def _usage(prompt: int, cached: int, written: int = 0) -> Usage:
    return Usage(prompt, 1, prompt + 1, PromptTokensDetails(cached), written)


def test_a_growing_conversation_is_not_a_miss_but_a_new_one_is() -> None:
    ledger = SessionLedger()
    rules = Segment("system", "Be kind.", "rules", "static")
    u1 = Segment("user", "hi", "u1", "session")
    turn1 = Prompt([rules, u1, Segment("user", "q", "q", "dynamic")])
    turn2 = Prompt([rules, u1, Segment("assistant", "hello", "a1", "session")])
    other = Prompt([rules, Segment("user", "hey", "u1", "session")])
    ledger.record(turn1, _usage(40, 0), None, "m")
    ledger.record(turn2, _usage(60, 30), None, "m")
    ledger.record(turn2.append(), _usage(60, 50), None, "m")  # more cached: fine
    ledger.record(other, _usage(40, 20), None, "m")  # a new conversation caches less
    (family,) = ledger.report().families
    (miss,) = family.misses
    assert miss.request == 4 and miss.segment == "u1" and miss.reason is None


def test_families_by_static_or_by_shared() -> None:
    by_static, by_shared = SessionLedger("static"), SessionLedger("shared")
    for ledger in (by_static, by_shared):
        ledger.record(_prompt("a", "q"), _usage(60, 0), None, "m")
        ledger.record(_prompt("b", "q"), _usage(60, 0), None, "m")
    assert [f.requests for f in by_static.report().families] == [2]
    assert [f.label for f in by_shared.report().families] == ["rules+doc:a", "rules+doc:b"]
    with pytest.raises(ValueError):
        SessionLedger("dynamic")


def test_prices_by_model_and_the_write_premium() -> None:
    ledger = SessionLedger()
    ledger.record(_prompt("a", "q"), _usage(2000, 0, written=2000), None, "claude")
    ledger.record(_prompt("a", "q"), _usage(2000, 2000), None, "claude")
    ledger.record(_prompt("a", "q"), _usage(2000, 1000), None, "gpt")
    claude = Price(input=3.0, cached_input=0.3, cache_write=3.75)
    gpt = Price(input=2.5, cached_input=1.25)
    (family,) = ledger.report({"claude": claude, "gpt": gpt}).families
    expected = (2000 * 2.7 - 2000 * 0.75) / 1e6 + 1000 * 1.25 / 1e6
    assert family.savings == pytest.approx(expected)
    assert ledger.report({"claude": claude}).families[0].savings is None  # no price for gpt
    assert ledger.report({"*": gpt}).families[0].savings == pytest.approx(3000 * 1.25 / 1e6)
    assert ledger.report().savings is None and "-" in ledger.report().table()


def test_requests_without_usage_are_not_counted() -> None:
    ledger = SessionLedger()
    ledger.record(_prompt("a", "q"), _usage(10, 0), None, "m")
    assert ledger.report().requests == 1

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}]})

    async def main() -> None:
        transport = httpx.MockTransport(handle)
        async with AsyncClient("http://x.test/v1", transport=transport) as client:
            await client.complete(_prompt("a", "q"))
            assert client.cache_report().requests == 0

    anyio.run(main)


def test_document_store_tokens_are_summed_and_shown_apart_from_hits() -> None:
    from prefixcache.sdk.types import CacheReport

    ledger = SessionLedger()
    ledger.record(_prompt("a", "q"), _usage(100, 0), CacheReport(prompt_tokens=100), "m")
    assert "reused" not in ledger.report().table()  # today's table without documents
    placed = CacheReport(cached_tokens=20, prompt_tokens=100, reused_tokens=64)
    ledger.record(_prompt("a", "q"), _usage(100, 20), placed, "m")
    ledger.record(_prompt("a", "q"), _usage(100, 20), None, "m")  # another server: no report
    report = ledger.report()
    assert report.reused_tokens == report.families[0].reused_tokens == 64
    assert report.hit_rate == pytest.approx(40 / 300)  # exact prefix hits only
    head, _, total = report.table().splitlines()
    assert "reused" in head.split() and "64" in total.split()
