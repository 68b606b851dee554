"""Documents reused anywhere through the sidecar and the SDK: the wire field, the report."""

from __future__ import annotations

import httpx
import msgspec

from prefixcache.sdk import Prompt
from prefixcache.sdk.render_sidecar import render_segments
from prefixcache.sdk.types import CacheReport

DOCS = {
    f"doc:{name}": " ".join(f"{name} fact {i} is {i * 7 % 13} units." for i in range(12))
    for name in ("alpha", "beta", "gamma")
}


def send(url: str, order: list[str], reuse: object = "anywhere") -> httpx.Response:
    segments = [
        {
            "role": "system",
            "content": "Answer from the documents.",
            "tag": "rules",
            "stability": "static",
        }
    ]
    for tag in order:
        seg = {"role": "user", "content": DOCS[tag], "tag": tag, "stability": "shared"}
        if reuse is not None:
            seg["reuse"] = reuse
        segments.append(seg)
    segments.append(
        {"role": "user", "content": "What is alpha fact 3?", "tag": "q", "stability": "dynamic"}
    )
    body = {"segments": segments, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=120)


def test_documents_are_reused_in_another_order(sidecar_url: str) -> None:
    first = send(sidecar_url, ["doc:alpha", "doc:beta", "doc:gamma"])
    assert first.status_code == 200, first.text
    second = send(sidecar_url, ["doc:gamma", "doc:alpha", "doc:beta"])
    assert second.status_code == 200, second.text
    raw = second.json()["prefixcache"]
    served = {s["tag"]: s for s in raw["segments"]}
    assert served["rules"]["served"] in ("cached", "computed")
    for tag in DOCS:
        seg = served[tag]
        assert seg["served"] == "reused_anywhere", seg
        exact = seg["cached_tokens"] + seg["recomputed_tokens"]  # a hit may end inside it
        assert seg["reused_tokens"] + exact == seg["tokens"]
        assert exact >= 16  # the default repair
    assert raw["reused_tokens"] == sum(served[t]["reused_tokens"] for t in DOCS)
    assert raw["computed_tokens"] <= raw["prompt_tokens"] - raw["reused_tokens"]
    report = msgspec.convert(raw, CacheReport)  # what the SDK decodes
    assert report.segment("doc:beta").served == "reused_anywhere"
    assert report.reused_tokens == raw["reused_tokens"]


def test_unflagged_documents_report_computed(sidecar_url: str) -> None:
    plain = send(sidecar_url, ["doc:beta", "doc:gamma", "doc:alpha"], reuse=None)
    assert plain.status_code == 200, plain.text
    raw = plain.json()["prefixcache"]
    assert "reused_tokens" not in raw
    assert all(s["served"] in ("cached", "computed") for s in raw["segments"])


def test_an_unknown_reuse_value_is_a_400(sidecar_url: str) -> None:
    response = send(sidecar_url, ["doc:alpha"], reuse="sometimes")
    assert response.status_code == 400, response.text


def test_sdk_document_renders_the_flag() -> None:
    prompt = (
        Prompt.builder()
        .static("Answer from the documents.", tag="rules")
        .document(DOCS["doc:beta"], tag="doc:beta")
        .document(DOCS["doc:alpha"], tag="doc:alpha")
        .dynamic("What is alpha fact 3?", tag="q")
        .build()
    )
    segments = render_segments(prompt)
    assert [s.get("reuse") for s in segments] == [None, "anywhere", "anywhere", None]
    assert not [f for f in prompt.lint() if f.rule == "PC009"]  # any order is fine for them
