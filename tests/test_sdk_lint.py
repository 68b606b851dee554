"""Each lint rule: a prompt that must trigger it and a close one that must not."""

from __future__ import annotations

import pytest

from prefixcache.sdk import RULES, Prompt, Segment, lint

CLEAN_PROSE = [
    "You are a careful support assistant for Acme. Answer from the policy documents; if "
    "they do not cover the question, say so. Step 1: read the question. Step 2: answer in "
    "three sentences or fewer. Escalate billing disputes to billing@acme.example.",
    "Refund policy. Customers may return unused items within 30 days of delivery. Refunds "
    "go back to the original payment method within 5 business days. Opening hours are "
    "9:00 to 17:00 on weekdays. The policy was first published in 2019.",
    "Retry up to 3 times before giving up, and never call tools in parallel.",
    "Use the search tool for questions about orders. Report totals in euros with two "
    "decimals, e.g. 12.50.",
]


def _rules(prompt: Prompt) -> list[str]:
    return [f.rule for f in lint(prompt)]


def _one(content: str, stability: str = "static", role: str = "system") -> list[str]:
    return _rules(Prompt([Segment(role, content, "seg", stability)]))  # type: ignore[arg-type]


def test_rule_ids_are_stable() -> None:
    assert RULES == {
        "PC001": "clock-value",
        "PC002": "random-id",
        "PC003": "request-id",
        "PC004": "non-canonical-json",
        "PC005": "stable-after-dynamic",
        "PC006": "whitespace-drift",
        "PC007": "user-data-in-static",
        "PC008": "counter",
        "PC009": "shared-order",
        "PC010": "cache-miss",
    }


def test_clean_prompts_produce_no_finding() -> None:
    p = (
        Prompt.builder()
        .static(CLEAN_PROSE[0], tag="rules")
        .static(CLEAN_PROSE[2], tag="tool-rules")
        .static({"tools": ["search"], "version": 2}, tag="config")
        .shared(CLEAN_PROSE[1], tag="doc:a")
        .shared(CLEAN_PROSE[3], tag="doc:b")
        .session("Hi! Today is my birthday, can I return a gift?", tag="turn-1")
        .session("Happy birthday! Yes, within 30 days.", tag="turn-2", role="assistant")
        .dynamic("Today is 2026-11-29 and my order id is 7f3e9c1a-0000.", tag="question")
        .build()
    )
    assert lint(p) == []
    assert lint(p, previous=p) == []


@pytest.mark.parametrize(
    "text",
    [
        "Today is Monday, 3 March.",
        "Current date: 2026-11-29.",
        "Log start 2026-11-29T10:15:00Z.",
        "Generated at 10:15:42.",
        "meta ts=1764410142",
        "The meeting is at 14:30.",
        "As of November 29, 2026 the rules changed.",
    ],
)
def test_pc001_clock_value(text: str) -> None:
    assert "PC001" in _one(text)


def test_pc001_negative_and_scope() -> None:
    assert "PC001" not in _one("Answer in 2 to 3 sentences. Version 2.1 of the guide (2019).")
    assert "PC001" not in _one("Today is 2026-11-29.", stability="dynamic", role="user")
    # a bare date in a shared document is content, not a clock: only static flags it
    assert "PC001" not in _one("Policy effective 1 March 2024.", stability="shared", role="user")
    assert "PC001" in _one("Policy effective 1 March 2024.", stability="static")
    assert "PC001" in _one("Fetched 2026-11-29 10:15:00.", stability="shared", role="user")


@pytest.mark.parametrize(
    "text",
    [
        "Session 550e8400-e29b-41d4-a716-446655440000 started.",
        "nonce: 8c1f2a",
        "Key 01ARZ3NDEKTSV4RRFFQ69G5FAV here.",
        "blob 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    ],
)
def test_pc002_random_id(text: str) -> None:
    assert "PC002" in _one(text)


def test_pc002_negative() -> None:
    assert "PC002" not in _one("Use a random sample of the documents; the session ends politely.")
    assert "PC002" not in _one("Salt: 1 teaspoon. Nonce words are made up for one occasion.")
    assert "PC002" not in _one("nonce: 8c1f2a", stability="dynamic", role="user")


@pytest.mark.parametrize(
    "text",
    [
        "request_id=req-83hd72",
        "Trace ID: abc123def",
        "X-Request-ID: 5b2c9a",
        "traceparent 00-a",
        "correlation id 83hd72",
    ],
)
def test_pc003_request_id(text: str) -> None:
    assert "PC003" in _one(text)


def test_pc003_negative() -> None:
    assert "PC003" not in _one("Every request is answered politely; trace the cause of errors.")
    assert "PC003" not in _one("Ask for the request ID when a user reports a bug.")


def test_pc004_non_canonical_json() -> None:
    assert "PC004" in _one('{"b": 1, "a": 2}')
    assert "PC004" in _one('Config:\n```json\n{"b":1,"a":2}\n```\nUse it.')
    assert "PC004" not in _one('{"a":2,"b":1}')
    assert "PC004" not in _one('Config:\n```json\n{"a":2,"b":1}\n```\nUse it.')
    assert "PC004" not in _one("[citation needed] is not JSON")
    assert "PC004" not in Prompt([Segment("system", {"b": 1, "a": 2}, "cfg", "static")]).lint()


def test_pc005_stable_after_dynamic() -> None:
    p = Prompt([Segment("user", "Q", "q", "dynamic"), Segment("system", "S", "s", "static")])
    findings = lint(p)
    assert [(f.rule, f.tag) for f in findings] == [("PC005", "s")]
    ok = Prompt([Segment("system", "S", "s", "static"), Segment("user", "Q", "q", "dynamic")])
    assert lint(ok) == []


def test_pc006_whitespace_drift_within_and_between_renders() -> None:
    assert "PC006" in _one("line one\r\nline two")
    assert "PC006" in _one("line one   \nline two")
    assert "PC006" not in _one("line one\nline two\n")
    a = Prompt([Segment("system", "Be brief.\nBe kind.", "s", "static")])
    b = Prompt([Segment("system", "Be brief.\n\nBe  kind.", "s", "static")])
    c = Prompt([Segment("system", "Be brief.\nBe rude.", "s", "static")])
    assert [f.rule for f in lint(b, previous=a)] == ["PC006"]
    assert lint(c, previous=a) == []  # a real edit, not drift
    assert lint(a, previous=a) == []


@pytest.mark.parametrize(
    "text",
    [
        "The user's email is jane.doe@example.com.",
        "Call the customer at +1 415 555 0132.",
        "User ID: 4411",
        "You are talking to Maria, a premium member.",
        "Hi, my name is Tom.",
    ],
)
def test_pc007_user_data_in_static(text: str) -> None:
    assert "PC007" in _one(text)


def test_pc007_negative_and_scope() -> None:
    assert "PC007" not in _one("Send questions to support@acme.example; users may log in.")
    assert "PC007" not in _one("User ID: 4411", stability="session", role="user")


@pytest.mark.parametrize(
    "text",
    ["This is turn 5 of the chat.", "Attempt 2: be more careful.", "3 retries left", "2nd attempt"],
)
def test_pc008_counter(text: str) -> None:
    assert "PC008" in _one(text)


def test_pc008_negative_and_scope() -> None:
    assert "PC008" not in _one("Retry 3 times at most. Step 2: check the answer. Take turns.")
    assert "PC008" not in _one("This is turn 5 of the chat.", stability="dynamic", role="user")


def test_pc009_shared_order() -> None:
    def docs(*tags: str, order: str = "declared") -> Prompt:
        segs = [Segment("user", f"doc {t}", t, "shared") for t in tags]
        return Prompt(segs, shared_order=order)  # type: ignore[arg-type]

    assert [f.rule for f in lint(docs("doc:b", "doc:a"))] == ["PC009"]
    assert lint(docs("doc:a", "doc:b")) == []
    assert lint(docs("doc:b", "doc:a", order="tag")) == []


def test_finding_carries_tag_rule_message_and_fix() -> None:
    p = Prompt(
        [
            Segment("system", "You are helpful. Today is Friday, 27 November.", "sys", "static"),
            Segment("user", "hello", "q", "dynamic"),
        ]
    )
    (f,) = lint(p)
    assert (f.tag, f.rule, f.name) == ("sys", "PC001", "clock-value")
    assert "Today is Friday" in f.message and "dynamic" in f.fix
    assert str(f).startswith("PC001 clock-value [sys]")


def test_report_advice_on_the_segment_where_the_cache_stopped() -> None:
    from prefixcache.sdk.types import CacheReport, SegmentReport

    p = (
        Prompt.builder()
        .static("You are a careful assistant. " * 4, tag="rules")
        .shared("Shelf A holds atlases. " * 4, tag="doc")
        .dynamic("Where are the atlases?", tag="q")
        .build()
    )
    diverged = {"reason": "diverged", "segment": "doc"}
    report = CacheReport(
        segments=[
            SegmentReport("rules", 30, 30),
            SegmentReport("doc", 30, 3, diverged),
            SegmentReport("q", 8, 0, diverged),
        ]
    )
    [finding] = [f for f in p.lint(report=report) if f.rule == "PC010"]
    assert finding.tag == "doc" and finding.message.startswith("diverged")
    evicted = {"reason": "evicted", "segment": "rules", "evicted_by": "pressure"}
    report = CacheReport(segments=[SegmentReport("rules", 30, 0, evicted)])
    [finding] = [f for f in p.lint(report=report) if f.rule == "PC010"]
    assert finding.tag == "rules" and "by pressure" in finding.message and "pin" in finding.fix
    cold = {"reason": "cold", "segment": "rules"}
    assert not [
        f
        for f in p.lint(report=CacheReport(segments=[SegmentReport("rules", 30, 0, cold)]))
        if f.rule == "PC010"
    ]
    dynamic_only = CacheReport(
        segments=[SegmentReport("q", 8, 0, {"reason": "diverged", "segment": "q"})]
    )
    assert not [f for f in p.lint(report=dynamic_only) if f.rule == "PC010"]
