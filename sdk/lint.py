"""Find cache-breakers: values that change per request inside segments meant to stay the same.

Each rule has a stable id (``PC001`` ...) and a name; docs/prompt-layout.md lists them. Rules
report at most one finding per segment. Patterns are tuned to stay quiet on ordinary prose:
weak signals (a bare date, a time of day) count only in ``static`` segments, where per-request
values hurt most; strong ones (a "today is ..." phrase, a full timestamp, a UUID) count in
every stable segment. Dynamic segments are never flagged for content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import pairwise

from .canonical import canonical_json
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
}


@dataclass(frozen=True, slots=True)
class Finding:
    tag: str
    rule: str  # stable id, e.g. "PC001"
    message: str
    fix: str

    @property
    def name(self) -> str:
        return RULES[self.rule]

    def __str__(self) -> str:
        return f"{self.rule} {self.name} [{self.tag}]: {self.message} Fix: {self.fix}"


def lint(prompt: PromptParts, previous: PromptParts | None = None) -> list[Finding]:
    """All findings for ``prompt``, in declared segment order then rule order."""
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
    order = {s.tag: i for i, s in enumerate(prompt.segments)}
    findings.sort(key=lambda f: (order.get(f.tag, -1), f.rule))
    return findings


# --- patterns --------------------------------------------------------------------------------

_I = re.IGNORECASE
_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_WEEKDAY = r"(?:mon|tues|wednes|thurs|fri|satur|sun)day"

_CLOCK_PHRASE = re.compile(
    rf"\b(?:today(?:'s date)? is,?\s+(?:{_WEEKDAY}|{_MONTH}|\d)"
    r"|current (?:date|time|timestamp|datetime)\b"
    rf"|the (?:date|time) is\s+(?:now\s+)?(?:{_WEEKDAY}|{_MONTH}|\d)"
    r"|(?:date|time) now\s*[:=]"
    r"|as of (?:now|today|right now)\b)",
    _I,
)
_DATETIME = re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}")
_TIME_SECONDS = re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b")
_EPOCH = re.compile(r"\b(?:ts|timestamp|time|epoch|now)\s*[:=]\s*\d{9,13}\b", _I)
_DATE = re.compile(
    rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
    rf"|\b{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b|\b\d{{1,2}} {_MONTH}\.? \d{{4}}\b",
    _I,
)
_TIME_OF_DAY = re.compile(r"\b\d{1,2}:\d{2}\s*(?:[ap]\.?m\.?|utc|gmt|z)\b|\bat \d{1,2}:\d{2}\b", _I)

_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", _I)
_ULID = re.compile(
    r"\b(?=[0-9A-HJKMNP-TV-Z]*\d)(?=[0-9A-HJKMNP-TV-Z]*[A-Z])[0-9A-HJKMNP-TV-Z]{26}\b"
)
_LONG_HEX = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{32,}\b", _I)
_NONCE = re.compile(
    r"\b(?:nonce|salt|random[ _-]?(?:id|seed|token|value)|session[ _-]?(?:id|token)"
    r"|cache[ _-]?buster)"
    r"\s*[:=]\s*(?=[\w+/=-]*\d)[\w+/=-]{6,}",  # a value with a digit: not "salt: a pinch"
    _I,
)
_REQUEST_ID = re.compile(
    r"\b(?:x-)?(?:request|req|trace|span|correlation|transaction|invocation)[ _-]?id\b"
    r"(?:\s*[:=#]\s*[\w-]{3,}|\s+(?=[\w-]*\d)[\w-]{4,})|\btraceparent\b",
    _I,
)
_ROLE_MAILBOX = (
    r"(?:support|help|info|sales|admin|contact|noreply|no-reply|team|security|privacy|billing"
    r"|hello|feedback|press|legal|abuse|webmaster|postmaster)"
)
_EMAIL = re.compile(rf"\b(?!{_ROLE_MAILBOX}@)[\w.+-]+@[\w-]+\.[\w.-]+\b", _I)
_PHONE = re.compile(
    r"\+\d{1,3}[\s.-]?\(?\d{1,4}\)?(?:[\s.-]?\d{2,4}){2,4}\b|\(\d{3}\)\s?\d{3}-\d{4}\b"
)
_USER_FIELD = re.compile(  # keywords in any case; a name must start with a capital
    r"\b(?i:user|customer|client|member|account|patient|subscriber)[ _-]?"
    r"(?i:id|name|email|number|no\.?|phone|address)\s*[:=]"
    r"|\b(?i:my name is)\b|\b(?i:the user(?:'s name)? is (?:named |called )?)[A-Z]"
    r"|\b(?i:you are (?:talking|speaking|chatting) (?:to|with) )[A-Z]"
)
_COUNTER = re.compile(
    r"\b(?:turn|attempt|retry|iteration|round|request|message)\s*(?:#|no\.?|number)?\s*\d+\b"
    r"(?!\s*(?:times|x)\b)"
    r"|\b\d+(?:st|nd|rd|th) (?:attempt|try|turn|retry|iteration)\b"
    r"|\b(?:attempts?|retries|tries|turns?|requests?)\s+(?:left|remaining|so far|used)"
    r"\s*[:=]?\s*\d+"
    r"|\b\d+\s+(?:attempts?|retries|tries|turns?|requests?)\s+(?:left|remaining|so far)\b",
    _I,
)
_TRAILING_WS = re.compile(r"[ \t]+\n")
_FENCED_JSON = re.compile(r"```json\s*\n(.*?)\n\s*```", re.DOTALL)


# --- content rules (one segment at a time) ---------------------------------------------------


def _clock_value(seg: Segment) -> Finding | None:
    patterns = [_CLOCK_PHRASE, _DATETIME, _TIME_SECONDS, _EPOCH]
    if seg.stability == "static":
        patterns += [_DATE, _TIME_OF_DAY]
    elif seg.stability == "session":
        patterns = [_CLOCK_PHRASE, _EPOCH]
    m = _search(patterns, seg.content)
    if m is None:
        return None
    return Finding(
        seg.tag,
        "PC001",
        f"clock value {m!r} in a {seg.stability} segment changes its bytes every request.",
        "Move the date/time into a dynamic segment at the end (e.g. tag 'now'), "
        "or round it to a value that stays fixed (the day, not the second) and mark it so.",
    )


def _random_id(seg: Segment) -> Finding | None:
    m = _search([_UUID, _NONCE, _ULID, _LONG_HEX], seg.content)
    if m is None:
        return None
    return Finding(
        seg.tag,
        "PC002",
        f"random-looking id {m!r} in a {seg.stability} segment; a fresh value per request "
        "breaks the cached prefix from here on.",
        "Drop the id from the prompt or move it into a dynamic segment (or request metadata).",
    )


def _request_id(seg: Segment) -> Finding | None:
    m = _search([_REQUEST_ID], seg.content)
    if m is None:
        return None
    return Finding(
        seg.tag,
        "PC003",
        f"request/trace id {m!r} in a {seg.stability} segment.",
        "Send request and trace ids as HTTP headers or metadata, never in the prompt text.",
    )


def _non_canonical_json(seg: Segment) -> Finding | None:
    text = seg.content.strip()
    candidates = [text] if text[:1] in "{[" else []
    candidates += _FENCED_JSON.findall(seg.content)
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(value, (dict, list)):
            continue
        if canonical_json(value) != candidate.strip():
            return Finding(
                seg.tag,
                "PC004",
                "JSON text that is not in canonical form (key order, spacing or float format "
                "can change between renders).",
                "Pass the data itself as the segment content (Segment(role, data, tag, ...)) "
                "so it is serialized canonically: sorted keys, fixed separators.",
            )
    return None


def _whitespace(seg: Segment) -> Finding | None:
    if "\r" in seg.content:
        what = "carriage returns (CRLF or CR line endings)"
    elif _TRAILING_WS.search(seg.content + "\n"):
        what = "trailing spaces or tabs at line ends"
    else:
        return None
    return Finding(
        seg.tag,
        "PC006",
        f"{what}; editors, templates and OSes rewrite these, so two renders of the same text "
        "can differ.",
        "Normalize the text once when building the segment: '\\n' line endings, no trailing "
        "whitespace.",
    )


def _user_data(seg: Segment) -> Finding | None:
    if seg.stability != "static":
        return None
    m = _search([_EMAIL, _PHONE, _USER_FIELD], seg.content)
    if m is None:
        return None
    return Finding(
        seg.tag,
        "PC007",
        f"per-user data {m!r} in a static segment; static material should be the same for "
        "every user.",
        "Move user details into a session or dynamic segment (tenant-wide material: shared).",
    )


def _counter(seg: Segment) -> Finding | None:
    if seg.stability not in ("static", "shared"):
        return None
    m = _search([_COUNTER], seg.content)
    if m is None:
        return None
    return Finding(
        seg.tag,
        "PC008",
        f"counter {m!r} in a {seg.stability} segment changes as the conversation advances.",
        "Keep counters out of stable segments: put them in the dynamic tail, or leave them "
        "implicit in the appended history.",
    )


_CONTENT_CHECKS: tuple[Callable[[Segment], Finding | None], ...] = (
    _clock_value,
    _random_id,
    _request_id,
    _non_canonical_json,
    _whitespace,
    _user_data,
    _counter,
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
            )


def _shared_order(prompt: PromptParts) -> Iterable[Finding]:
    if prompt.shared_order != "declared":
        return
    shared = [s.tag for s in prompt.segments if s.stability == "shared"]
    for prev, tag in pairwise(shared):
        if tag < prev:
            yield Finding(
                tag,
                "PC009",
                f"shared segments are in declared order ({tag!r} after {prev!r}), e.g. by "
                "retrieval score; the same documents in another order miss the cache after "
                "the first difference.",
                "Use shared_order='tag' (builder: .order_shared_by_tag()) and tag documents by "
                "a stable id.",
            )
            return


def _search(patterns: list[re.Pattern[str]], text: str) -> str | None:
    for pattern in patterns:
        m = pattern.search(text)
        if m is not None:
            return m.group(0).strip()
    return None
