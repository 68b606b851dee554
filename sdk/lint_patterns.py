"""What the lint rules look for: text in, character spans out (no prompts, no rule ids here).

Each detector is a regular expression, optionally with a check on the match that the pattern
alone cannot express (a number in the range of plausible Unix times, a token random enough to
be a generated id, a Luhn checksum). Patterns lean towards silence: a value is flagged when
its shape or the words around it say it changes per request, not merely because it could.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from .canonical import canonical_json

Span = tuple[int, int]
_I = re.IGNORECASE


@dataclass(frozen=True, slots=True)
class Detector:
    pattern: re.Pattern[str]
    accept: Callable[[re.Match[str]], bool] | None = None
    group: int | str = 0  # the part of the match to report

    def spans(self, text: str) -> Iterable[Span]:
        for m in self.pattern.finditer(text):
            if self.accept is None or self.accept(m):
                start, end = m.span(self.group)
                if end > start:
                    yield start, end


def find(detectors: Sequence[Detector], text: str) -> list[Span]:
    """Every span any detector reports, sorted, overlapping spans merged."""
    spans = sorted(span for d in detectors for span in d.spans(text))
    merged: list[Span] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    # a match may carry surrounding blanks (e.g. "ts = ..."): report the text itself
    return [_strip(text, s) for s in merged]


def _strip(text: str, span: Span) -> Span:
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


# --- clock values -----------------------------------------------------------------------------

_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_WEEKDAY = r"(?:mon|tues?|wed(?:nes)?|thu(?:rs)?|fri|sat(?:ur)?|sun)(?:day)?"
_HH_MM = r"(?:[01]?\d|2[0-3]):[0-5]\d"
_ZONE = (
    r"(?:utc|gmt|z|[ecmp][sd]t|bst|ist|jst|kst|cet|cest|eet|eest|wet|west|aest|aedt"
    r"|(?:utc|gmt)?[+-]\d{1,2}(?::?\d{2})?)"
)
_ORDINAL = r"(?:st|nd|rd|th)"
_DAY_OF_MONTH = (  # "November 29", "29th of November", optionally with the year
    rf"(?:{_MONTH}\.?\s+(?:0?[1-9]|[12]\d|3[01]){_ORDINAL}?"
    rf"|(?:0?[1-9]|[12]\d|3[01]){_ORDINAL}?\s+(?:of\s+)?{_MONTH})(?:,?\s+\d{{4}})?\b"
)
_RANGE_AFTER = re.compile(r"\s*(?:-|–|—|to|until|till|and)\s*\d", _I)
_RANGE_BEFORE = re.compile(r"(?:-|–|—|\bto|\buntil|\btill|\bfrom|\bbetween)\s*$", _I)
_SCHEDULE_AFTER = re.compile(r"\s*(?:daily|every|each|nightly|weekly|on weekdays)\b", _I)
_SECONDS_2000 = 946_684_800  # 2000-01-01: Unix times below this are not "now"
_SECONDS_2100 = 4_102_444_800


def _not_a_range(m: re.Match[str]) -> bool:
    """Opening hours and schedules ("9:00 to 17:00", "at 02:00 daily") stay the same."""
    text = m.string
    if _RANGE_AFTER.match(text, m.end()) or _SCHEDULE_AFTER.match(text, m.end()):
        return False
    return not _RANGE_BEFORE.search(text[max(0, m.start() - 12) : m.start()])


def _plausible_epoch(m: re.Match[str]) -> bool:
    value = int(m.group("epoch"))
    return (
        _SECONDS_2000 <= value <= _SECONDS_2100
        or _SECONDS_2000 * 1000 <= value <= _SECONDS_2100 * 1000
    )


_TIME_KEY = (
    r"(?:\w*(?:timestamp|_ts|_at|_time|_date|_on|epoch|_since|_until)"
    r"|ts|time|now|date|created|updated|modified|generated|expires?|expiry|iat|exp|nbf|issued)"
)

CLOCK_PHRASES: tuple[Detector, ...] = (
    Detector(
        re.compile(
            rf"\b(?:today(?:'s date)? is,?\s+(?:{_WEEKDAY}(?:,?\s+{_DAY_OF_MONTH})?"
            rf"|{_DAY_OF_MONTH}|{_MONTH}|\d[\d/.-]*\d|\d)"
            r"|today(?:'s date)?\s*[:=]\s*\S"
            r"|current (?:date|time|timestamp|datetime|local time)\b"
            rf"|the (?:date|time) is\s+(?:now\s+)?(?:{_WEEKDAY}|{_MONTH}|\d)"
            r"|(?:date|time) now\s*[:=]"
            r"|as of (?:now|today|right now)\b"
            r"|it(?:'s| is) now\b"
            r"|(?:right )?now it(?:'s| is)\s+\d"
            rf"|it(?:'s| is)\s+(?:{_HH_MM}|\d{{1,2}}\s*[ap]\.?m\b)"
            r"|\bnow\s*[:=]\s*\d)",
            _I,
        )
    ),
)

CLOCK_EPOCH: tuple[Detector, ...] = (
    Detector(
        re.compile(
            rf"(?<![\w-])\"?{_TIME_KEY}\"?\s*(?:[:=]|\bis\b)?\s*\"?(?P<epoch>\d{{9,13}})(?!\d)", _I
        ),
        _plausible_epoch,
    ),
)

CLOCK_STRONG: tuple[Detector, ...] = (
    # ISO 8601 / RFC 3339 date-times, "2026/11/29 14:05"
    Detector(
        re.compile(
            r"\b\d{4}[-/]\d{2}[-/]\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?"
            r"(?:\s?(?:Z|[+-]\d{2}:?\d{2}|UTC|GMT)(?![\w:]))?"
        )
    ),
    # a time of day with seconds, 24 h or 12 h
    Detector(re.compile(rf"\b{_HH_MM}:[0-5]\d(?:[.,]\d+)?(?:\s*[ap]\.?m\.?)?(?!\d)", _I)),
    # relative times: "3 minutes ago", "an hour ago"
    Detector(
        re.compile(
            r"\b(?:\d+|an?|one|two|three|four|five|ten|a few|several|few)\s+"
            r"(?:sec(?:ond)?s?|min(?:ute)?s?|hours?|hrs?|days?|weeks?|months?|years?)\s+ago\b",
            _I,
        )
    ),
    *CLOCK_EPOCH,
)

CLOCK_WEAK: tuple[Detector, ...] = (
    # dates: ISO, US / European with slashes, dots or dashes, spelled out
    Detector(re.compile(r"(?<![\w.-])\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")),
    Detector(
        re.compile(
            r"(?<![\w./-])(?:0?[1-9]|[12]\d|3[01])/(?:0?[1-9]|[12]\d|3[01])/(?:\d{4}|\d{2})"
            r"(?![\w/]|\.\d)"
            r"|(?<![\w.])(?:0?[1-9]|[12]\d|3[01])\.(?:0?[1-9]|1[0-2])\.\d{4}(?![\w]|\.\d)"
        )
    ),
    Detector(re.compile(r"\b(?:0?[1-9]|[12]\d|3[01])-(?:0?[1-9]|1[0-2])-\d{4}\b")),
    Detector(
        re.compile(
            rf"\b{_MONTH}\.? (?:0?[1-9]|[12]\d|3[01]){_ORDINAL}?,? \d{{4}}\b"
            rf"|\b(?:0?[1-9]|[12]\d|3[01]){_ORDINAL}? (?:of )?{_MONTH}\.?,? \d{{4}}\b"
            rf"|\b{_WEEKDAY},? (?:{_MONTH}\.? (?:0?[1-9]|[12]\d|3[01])|(?:0?[1-9]|[12]\d|3[01])"
            rf"{_ORDINAL}? (?:of )?{_MONTH})\b",
            _I,
        )
    ),
    # times of day: 12-hour, with a zone, or after "at"/"now"
    Detector(
        re.compile(rf"\b(?:1[0-2]|0?[1-9])(?::[0-5]\d)?\s*[ap]\.?m\.?(?!\w)(?:\s*{_ZONE}\b)?", _I),
        _not_a_range,
    ),
    Detector(re.compile(rf"\b{_HH_MM}\s*{_ZONE}(?![\w:])", _I), _not_a_range),
    Detector(re.compile(rf"\b(?:at|now|time:?)\s+{_HH_MM}(?![\d:])", _I), _not_a_range),
)


# --- random ids -------------------------------------------------------------------------------

_TOKEN = re.compile(r"(?<![\w+=/-])[A-Za-z0-9_+-]{16,}={0,2}(?![\w+=/-])")


def _class(c: str) -> int:
    return 0 if c.islower() else 1 if c.isupper() else 2 if c.isdigit() else 3


def looks_random(token: str) -> bool:
    """A generated id (nanoid, KSUID, base64 / base62 token), not a word, name or code.

    Random text switches often between lower case, upper case and digits; identifiers,
    product codes and model names are runs of words.
    """
    token = token.rstrip("=")
    lower = sum(c.islower() for c in token)
    upper = sum(c.isupper() for c in token)
    digits = sum(c.isdigit() for c in token)
    if lower < 2 or digits < 2:
        return False
    if upper == 0 and not token.isalnum():
        return False  # lower-case words joined by - or _: an identifier or slug
    classes = [_class(c) for c in token]
    switches = sum(a != b for a, b in pairwise(classes))
    longest_word = max(len(w) for w in re.findall(r"[a-z]+|[A-Z][a-z]*|\d+|[_+-]", token))
    return switches >= 0.4 * (len(token) - 1) and longest_word <= 5


_HEX_CHARS = re.compile(r"[0-9a-f]+", _I)

RANDOM_IDS: tuple[Detector, ...] = (
    Detector(re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", _I)),
    Detector(  # ULID: 26 Crockford base-32 characters
        re.compile(
            r"\b(?=[0-9A-HJKMNP-TV-Z]*\d)(?=[0-9A-HJKMNP-TV-Z]*[A-Z])[0-9A-HJKMNP-TV-Z]{26}\b"
        )
    ),
    Detector(re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{32,}\b", _I)),
    Detector(re.compile(r"\beyJ[\w-]{4,}\.eyJ[\w-]{4,}\.[\w-]*")),  # JWT
    Detector(
        re.compile(
            r"\b(?:nonce|salt|random[ _-]?(?:id|seed|token|value)|session[ _-]?(?:id|token)"
            r"|cache[ _-]?buster|idempotency[ _-]?key|csrf[ _-]?token|api[ _-]?key|token)"
            r"\s*[:=]\s*(?=[\w+/=-]*\d)[\w+/=-]{6,}",  # a value with a digit: not "salt: a pinch"
            _I,
        )
    ),
    Detector(_TOKEN, lambda m: looks_random(m.group(0)) and not _HEX_CHARS.fullmatch(m.group(0))),
)

REQUEST_IDS: tuple[Detector, ...] = (
    Detector(
        re.compile(
            r"\b(?:x-)?(?:amzn?-|ms-|goog-)?(?:request|req|trace|span|correlation|transaction"
            r"|invocation|execution|run)[ _-]?id\b(?:\s*[:=#]\s*[\w-]{3,}|\s+(?=[\w-]*\d)[\w-]{4,})"
            r"|\btraceparent\b|\bx-cloud-trace-context\b|\bcf-ray\b",
            _I,
        )
    ),
    Detector(re.compile(r"\bRoot=1-[0-9a-f]{8}-[0-9a-f]{24}\b")),  # AWS X-Ray
    Detector(re.compile(r"\b[0-9a-f]{32}/\d{1,20}(?:;o=[01])?(?!\w)")),  # Google Cloud Trace
    Detector(re.compile(r"\b[0-9a-f]{16}-[A-Z]{3}\b")),  # Cloudflare ray id
    Detector(  # provider request / response ids
        re.compile(r"\b(?:req|msg|resp|run|call|evt|chatcmpl|cmpl)[_-](?=\w*\d)[A-Za-z0-9]{12,}\b")
    ),
)


# --- per-user data ----------------------------------------------------------------------------

_ROLE_MAILBOX = (
    r"(?:support|help|info|sales|admin|contact|noreply|no-reply|team|security|privacy|billing"
    r"|hello|feedback|press|legal|abuse|webmaster|postmaster|careers|jobs|office|orders)"
)
_NOT_NAMES = (
    r"(?:hi|hello|hey|thanks|thank|yes|no|ok|okay|please|sure|help|what|how|why|when|where"
    r"|who|which|can|could|would|is|are|do|does|i|my|the|a|an)"
)


def _luhn(m: re.Match[str]) -> bool:
    digits = [int(c) for c in m.group(0) if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


USER_DATA: tuple[Detector, ...] = (
    Detector(re.compile(rf"\b(?!{_ROLE_MAILBOX}@)[\w.+-]+@[\w-]+\.[\w.-]*\w", _I)),
    Detector(  # international and US-formatted phone numbers
        re.compile(
            r"(?<![\w+])\+\d{1,3}[\s.-]?\(?\d{1,4}\)?(?:[\s.-]?\d{2,4}){2,4}\b"
            r"|(?<!\w)\(\d{3}\)\s?\d{3}-\d{4}\b"
        )
    ),
    Detector(  # a bare number is a phone number only when the words say so
        re.compile(
            r"\b(?:phone|tel|telephone|mobile|cell|call|text|sms|whatsapp|fax)\b[^\n\d]{0,20}?"
            r"(?P<number>[(+]?\d[\d\s().-]{6,}\d)",
            _I,
        ),
        group="number",
    ),
    Detector(
        re.compile(
            r"\b(?i:user|customer|client|member|account|patient|subscriber)[ _-]?"
            r"(?i:id|name|email|number|no\.?|phone|address|handle)\s*[:=]\s*"
            r"(?:\"?[\w.+-]*\d[\w.@+-]*|[\w.+-]+@[\w.-]*\w|[A-Z][a-z]+)"
            r"|\b(?i:my name is)\b|\b(?i:the user(?:'s name)? is (?:named |called )?)[A-Z]"
            r"|\b(?i:you are (?:talking|speaking|chatting) (?:to|with) )[A-Z]"
            r"|\b(?i:(?:logged|signed) in as)\s+@?[\w.-]*\w"
            r"|\b(?i:acct|account)\s*(?:#|no\.?|number)\s*:?\s*[\w-]*\d[\w-]*"
            r"|\b(?i:account|card) ending in\s+\d{4}\b"
        )
    ),
    Detector(  # "User: jdoe" / "Customer: Maria Lopez" (a handle or a name, not a sentence)
        re.compile(
            rf"\b(?i:user|username|customer|client|member|patient)\s*:\s*"
            rf"(?!(?i:{_NOT_NAMES})\b)(?P<name>@?[a-z][\w.-]*\d(?:[\w.-]*\w)?|@[\w.-]*\w"
            r"|[A-Z][a-z]+(?: [A-Z][a-z]+){0,2})[ \t]*(?=$|[,;)\n]|\.(?:\s|$))",
            re.MULTILINE,
        ),
        group="name",
    ),
    Detector(re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){3,7}(?: ?[A-Z0-9]{1,3})?\b")),  # IBAN
    Detector(re.compile(r"\b\d{4}(?:[ -]\d{4}){2}[ -]\d{1,7}\b"), _luhn),  # card number
)


# --- counters ---------------------------------------------------------------------------------

COUNTERS: tuple[Detector, ...] = (
    Detector(
        re.compile(
            r"\b(?:turn|attempt|retry|iteration|request|message|try|visit)"
            r"\s*(?:#|no\.?|number)?\s*\d+\b(?!\s*(?:times|x|seconds?|minutes?|ms)\b)"
            r"|\b(?:question|round|call|page|item)\s*#?\s*\d+\s+(?:of|/)\s+\d+\b"
            r"|\b\d+(?:st|nd|rd|th) (?:attempt|try|turn|retry|iteration|request|message|visit)\b"
            r"|\b(?:attempts?|retries|tries|turns?|requests?|messages?|calls?|credits?|tokens?"
            r"|quota)\s+(?:left|remaining|so far|used)\s*[:=]?\s*\d+"
            r"|\b\d+\s+(?:attempts?|retries|tries|turns?|requests?|messages?|calls?|credits?)"
            r"\s+(?:left|remaining|so far|used)\b"
            r"|\b(?:counter|count|seq|sequence(?: number)?|tick|step count|call count|visits)"
            r"\s*[:=#]\s*\d+",
            _I,
        )
    ),
)


# --- JSON -------------------------------------------------------------------------------------

_FENCED_JSON = re.compile(r"```json[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL)
_DECODER = json.JSONDecoder()
_LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{12,}(?:[eE][+-]?\d+)?(?![\w.])")
_UNICODE_ESCAPE = re.compile(r"\\u[0-9a-fA-F]{4}")


def json_problems(text: str) -> list[tuple[Span, str]]:
    """JSON in the text that would not render byte-identically every time, with what is wrong.

    The whole text or a ```json block must be canonical. A JSON object inline in prose is
    often a hand-written format example, so there only machine-made signs count: ``\\uXXXX``
    escapes and floats at full machine precision.
    """
    found: list[tuple[Span, str]] = []
    for span, whole in _json_candidates(text):
        candidate = text[span[0] : span[1]]
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to check
            continue
        if not isinstance(value, (dict, list)):
            continue
        why = _why_unstable(candidate, value, whole)
        if why is not None:
            found.append((span, why))
    return found


def _json_candidates(text: str) -> list[tuple[Span, bool]]:
    """(span, whether the span is a whole JSON text or block rather than inline)."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        start = text.index(stripped[0])
        return [((start, start + len(stripped)), True)]
    found = [(m.span(1), True) for m in _FENCED_JSON.finditer(text)]
    blocks = [span for span, _ in found]
    pos = 0
    while (pos := text.find("{", pos)) != -1:
        if any(s <= pos < e for s, e in blocks):
            pos += 1
            continue
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to check
            pos += 1
            continue
        if isinstance(value, dict) and value:
            found.append(((pos, end), False))
        pos = end
    return sorted(found)


def _why_unstable(candidate: str, value: object, whole: bool) -> str | None:
    if _LONG_FLOAT.search(candidate):
        return (
            "a float at full machine precision (e.g. 0.30000000000000004) renders differently "
            "after any change in how it is computed"
        )
    if _UNICODE_ESCAPE.search(candidate):
        return "\\uXXXX escapes where canonical JSON keeps UTF-8 text"
    if not whole or canonical_json(value) == candidate.strip():
        return None
    if not _keys_sorted(value):
        return "keys not in sorted order"
    compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if re.sub(r"\s+", "", candidate) == re.sub(r"\s+", "", compact):
        return "spacing or indentation that differs from the canonical separators"
    return "number format (e.g. 12.50, 1e3, -0.0) that differs from the canonical form"


def _keys_sorted(value: object) -> bool:
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys) and all(_keys_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(_keys_sorted(v) for v in value)
    return True
