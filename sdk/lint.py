"""Find cache-breakers: values that change per request inside segments meant to stay the same.

Each rule has a stable id (``PC001`` ...) and a name; docs/prompt-layout.md lists them. A rule
reports at most one finding per segment, carrying the character spans (into the segment's
content) of every value it matched, so an editor can underline them. Patterns
(``lint_patterns.py``) are tuned to stay quiet on ordinary prose: weak signals (a bare date, a
time of day, an e-mail address) count only in ``static`` segments, where per-request values
hurt most; strong ones (a "today is ..." phrase, a full timestamp, a UUID) count in every
stable segment. Dynamic segments are never flagged for content.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

from . import lint_patterns as pat
from .lint_patterns import Detector, Span
from .segment import PromptParts, Segment

RULES: dict[str, str] = {
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


class SegmentOutcome(Protocol):
    """What lint reads of one segment of a response's cache report (types.SegmentReport)."""

    tag: str
    tokens: int
    cached_tokens: int
    miss: str | dict[str, Any] | None


class ReportLike(Protocol):
    """A response's cache report (types.CacheReport: ``out.cache``)."""

    @property
    def segments(self) -> Sequence[SegmentOutcome]: ...


@dataclass(frozen=True, slots=True)
class Finding:
    """``spans``: ``(start, end)`` character offsets into the segment's content, one per
    value found, in order; rules about the whole segment cover all of it."""

    tag: str
    rule: str  # stable id, e.g. "PC001"
    message: str
    fix: str
    spans: tuple[Span, ...] = ()

    @property
    def name(self) -> str:
        return RULES[self.rule]

    @property
    def span(self) -> Span | None:
        """The first span (the value the message quotes)."""
        return self.spans[0] if self.spans else None

    def __str__(self) -> str:
        return f"{self.rule} {self.name} [{self.tag}]: {self.message} Fix: {self.fix}"


def lint(
    prompt: PromptParts, previous: PromptParts | None = None, report: ReportLike | None = None
) -> list[Finding]:
    """All findings for ``prompt``, in declared segment order then rule order; ``report`` (a
    response's ``out.cache``) adds advice on why a stable segment missed (PC010)."""
    findings: list[Finding] = []
    for seg in prompt.segments:
        if seg.is_stable:
            for check in _CONTENT_CHECKS:
                finding = check(seg)
                if finding is not None:
                    findings.append(finding)
    findings.extend(_stable_after_dynamic(prompt))
    if previous is not None:
        findings.extend(_drift_between(prompt, previous))
    findings.extend(_shared_order(prompt))
    if report is not None:
        findings.extend(_cache_miss(prompt, report))
    order = {s.tag: i for i, s in enumerate(prompt.segments)}
    findings.sort(key=lambda f: (order.get(f.tag, -1), f.rule))
    return findings


# --- content rules (one segment at a time) ---------------------------------------------------


def _clock_value(seg: Segment) -> Finding | None:
    detectors: Sequence[Detector] = (*pat.CLOCK_PHRASES, *pat.CLOCK_STRONG)
    if seg.stability == "static":
        detectors = (*detectors, *pat.CLOCK_WEAK)
    elif seg.stability == "session":  # history is written once; only "now" phrases recur
        detectors = (*pat.CLOCK_PHRASES, *pat.CLOCK_EPOCH)
    return _finding(
        seg,
        "PC001",
        pat.find(detectors, seg.content),
        "clock value {value!r} in a {stability} segment changes its bytes every request.",
        "Move the date/time into a dynamic segment at the end (e.g. tag 'now'), "
        "or round it to a value that stays fixed (the day, not the second) and mark it so.",
    )


def _random_id(seg: Segment) -> Finding | None:
    request_ids = pat.find(pat.REQUEST_IDS, seg.content)  # reported once, as PC003
    spans = [
        (start, end)
        for start, end in pat.find(pat.RANDOM_IDS, seg.content)
        if not any(start < e and s < end for s, e in request_ids)
    ]
    return _finding(
        seg,
        "PC002",
        spans,
        "random-looking id {value!r} in a {stability} segment; a fresh value per request "
        "breaks the cached prefix from here on.",
        "Drop the id from the prompt or move it into a dynamic segment (or request metadata).",
    )


def _request_id(seg: Segment) -> Finding | None:
    return _finding(
        seg,
        "PC003",
        pat.find(pat.REQUEST_IDS, seg.content),
        "request/trace id {value!r} in a {stability} segment.",
        "Send request and trace ids as HTTP headers or metadata, never in the prompt text.",
    )


def _non_canonical_json(seg: Segment) -> Finding | None:
    problems = pat.json_problems(seg.content)
    if not problems:
        return None
    return Finding(
        seg.tag,
        "PC004",
        f"JSON text that is not in canonical form: {problems[0][1]}; key order, spacing or "
        "number format can change between renders.",
        "Pass the data itself as the segment content (Segment(role, data, tag, ...)) "
        "so it is serialized canonically: sorted keys, fixed separators, UTF-8 text.",
        tuple(span for span, _ in problems),
    )


def _whitespace(seg: Segment) -> Finding | None:
    crs = [(i, i + 1) for i, c in enumerate(seg.content) if c == "\r"]
    if crs:
        what, spans = "carriage returns (CRLF or CR line endings)", crs
    else:
        spans = [m.span() for m in _TRAILING_WS.finditer(seg.content)]
        if not spans:
            return None
        what = "trailing spaces or tabs at line ends"
    return Finding(
        seg.tag,
        "PC006",
        f"{what}; editors, templates and OSes rewrite these, so two renders of the same text "
        "can differ.",
        "Normalize the text once when building the segment: '\\n' line endings, no trailing "
        "whitespace.",
        tuple(spans),
    )


def _user_data(seg: Segment) -> Finding | None:
    if seg.stability != "static":
        return None
    return _finding(
        seg,
        "PC007",
        pat.find(pat.USER_DATA, seg.content),
        "per-user data {value!r} in a static segment; static material should be the same for "
        "every user.",
        "Move user details into a session or dynamic segment (tenant-wide material: shared).",
    )


def _counter(seg: Segment) -> Finding | None:
    if seg.stability not in ("static", "shared"):
        return None
    return _finding(
        seg,
        "PC008",
        pat.find(pat.COUNTERS, seg.content),
        "counter {value!r} in a {stability} segment changes as the conversation advances.",
        "Keep counters out of stable segments: put them in the dynamic tail, or leave them "
        "implicit in the appended history.",
    )


_TRAILING_WS = re.compile(r"[ \t]+(?=\n|$)")

_CONTENT_CHECKS: tuple[Callable[[Segment], Finding | None], ...] = (
    _clock_value,
    _random_id,
    _request_id,
    _non_canonical_json,
    _whitespace,
    _user_data,
    _counter,
)


def _finding(seg: Segment, rule: str, spans: list[Span], message: str, fix: str) -> Finding | None:
    if not spans:
        return None
    start, end = spans[0]
    value = seg.content[start:end]
    return Finding(
        seg.tag, rule, message.format(value=value, stability=seg.stability), fix, tuple(spans)
    )


# --- rules over the whole prompt --------------------------------------------------------------


def _stable_after_dynamic(prompt: PromptParts) -> Iterable[Finding]:
    first_dynamic: str | None = None
    for seg in prompt.segments:
        if not seg.is_stable:
            first_dynamic = first_dynamic or seg.tag
        elif first_dynamic is not None:
            yield Finding(
                seg.tag,
                "PC005",
                f"{seg.stability} segment declared after dynamic segment {first_dynamic!r}. "
                "Rendering moves it ahead, but any other code that sends the declared order "
                "(plain messages, logs, a second client) puts per-request text before it.",
                "Declare stable segments before dynamic ones.",
                _whole(seg),
            )


def _drift_between(prompt: PromptParts, previous: PromptParts) -> Iterable[Finding]:
    before = {s.tag: s for s in previous.segments}
    for seg in prompt.segments:
        old = before.get(seg.tag)
        if old is None or not seg.is_stable or old.content == seg.content:
            continue
        if old.content.split() == seg.content.split():
            yield Finding(
                seg.tag,
                "PC006",
                "content differs from the previous render only in whitespace or line endings; "
                "the cached prefix ends here.",
                "Build this segment from one normalized source (same line endings, no trailing "
                "or doubled spaces) every time.",
                _whole(seg),
            )


def _shared_order(prompt: PromptParts) -> Iterable[Finding]:
    if prompt.shared_order != "declared":
        return
    # documents reused anywhere may come in any order: the server places each one wherever
    shared = [s for s in prompt.segments if s.stability == "shared" and s.reuse is None]
    for before, seg in pairwise(shared):
        prev, tag = before.tag, seg.tag
        if tag < prev:
            yield Finding(
                tag,
                "PC009",
                f"shared segments are in declared order ({tag!r} after {prev!r}), e.g. by "
                "retrieval score; the same documents in another order miss the cache after "
                "the first difference.",
                "Use shared_order='tag' (builder: .order_shared_by_tag()) and tag documents by "
                "a stable id.",
                _whole(seg),
            )
            return


_MISS_ADVICE: dict[str, tuple[str, str]] = {
    "diverged": (
        "the server's cached prefix goes on with other tokens from here: this segment's bytes "
        "differ from an earlier request's{after}.",
        "Keep it byte-identical across requests (diff(previous, prompt) shows where it changed); move "
        "what changes into a dynamic segment at the end.",
    ),
    "evicted": (
        "it was cached, then evicted{by}{after}.",
        "Pin it (client.warm(prompt, pin=True)), or give the server more KV memory.",
    ),
    "namespace": (
        "the same tokens are cached under another cache_salt of your tenant{after}; different "
        "salts never share blocks.",
        "Send the same cache_salt with every request that shares this prefix.",
    ),
    "partial_block": (
        "less than one KV block of new tokens follows the cached prefix{after}; only full "
        "blocks are cached.",
        "Nothing to fix for a short tail; a stable part shorter than a block is cached once "
        "more stable text follows it.",
    ),
    "window": (
        "the server caches what follows, but the sliding-window layers' KV before it was "
        "evicted{after} (a hybrid model).",
        "Pin it (client.warm(prompt, pin=True)), or give the server's sliding layers more "
        "KV memory (--swa-pool-ratio).",
    ),
    "below_min": (
        "the prompt is shorter than one KV block; nothing is cached below a block.",
        "Expected for short prompts; put shared text first so longer prompts reuse it.",
    ),
}


def _cache_miss(prompt: PromptParts, report: ReportLike) -> Iterable[Finding]:
    """One finding per request: on the stable segment where the server's cached prefix
    stopped, for the reasons a prompt can fix ("cold", a first request, is not one)."""
    stable = {s.tag: s for s in prompt.segments if s.is_stable}
    for outcome in report.segments:
        miss = outcome.miss
        reason = miss.get("reason") if isinstance(miss, dict) else miss
        advice = _MISS_ADVICE.get(str(reason))
        if advice is None or outcome.cached_tokens >= outcome.tokens:
            continue
        detail = miss if isinstance(miss, dict) else {}
        where = detail.get("segment")
        seg = stable.get(where) if isinstance(where, str) else None
        seg = seg or stable.get(outcome.tag)
        if seg is None:
            continue  # a dynamic segment: new every request by design
        by = f" by {detail['evicted_by']}" if detail.get("evicted_by") else ""
        after = "" if seg.tag == where or where is None else f" (at segment {where!r})"
        message, fix = advice
        yield Finding(
            seg.tag, "PC010", f"{reason}: " + message.format(by=by, after=after), fix, _whole(seg)
        )
        return


def _whole(seg: Segment) -> tuple[Span, ...]:
    return ((0, len(seg.content)),)
