"""What a client's requests got from the cache, per prompt family, and why a family missed.

A family is the requests whose stable part agrees up to the end of one stability class
(``static`` by default: the same tools, instructions and examples), keyed by that part's
fingerprint. Per family: requests, prompt tokens, cached (read) and cache-write tokens, the
token hit rate, and estimated savings from a price table. When a request caches fewer tokens
than the family's previous request did, the report records a miss: the first stable segment
whose fingerprint changed since that request (``diff``) and, from a prefixcache server, the
miss reason its segment report gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .fingerprint import Divergence, Fingerprint, diff
from .prompt import Prompt
from .stability import RANK, STABLE
from .types import CacheReport, Usage

FAMILY_HEX = 12  # characters of the family digest shown and used as its key


@dataclass(frozen=True, slots=True)
class Price:
    """Prices per million prompt tokens, in any one currency. ``cache_write`` defaults to
    ``input`` (no write premium, as with OpenAI); Anthropic charges more for writes."""

    input: float
    cached_input: float
    cache_write: float | None = None

    def savings(self, cached_tokens: int, cache_write_tokens: int) -> float:
        """What caching saved against sending every prompt token uncached (may be < 0)."""
        write = self.input if self.cache_write is None else self.cache_write
        saved = cached_tokens * (self.input - self.cached_input)
        extra = cache_write_tokens * (write - self.input)
        return (saved - extra) / 1e6


Prices = Price | Mapping[str, Price]  # one price, or by model name ("*": any other model)


@dataclass(frozen=True, slots=True)
class Miss:
    """Request number ``request`` (1-based, in the session) cached fewer tokens than the
    family's previous request. ``segment``: the tag of the first stable segment that changed
    (None: the stable part was identical, so the server dropped or never had it)."""

    request: int
    cached_tokens: int
    previous_cached_tokens: int
    diff: Divergence | None
    reason: str | None  # the server's miss reason, when its report carries one

    @property
    def segment(self) -> str | None:
        if self.diff is None:
            return None
        return self.diff.tag_b if self.diff.tag_b is not None else self.diff.tag_a

    def __str__(self) -> str:
        where = f"at {self.segment}" if self.segment else "same stable part"
        why = f" ({self.reason})" if self.reason else ""
        return f"#{self.request} {where}{why}"


@dataclass(frozen=True, slots=True)
class FamilyReport:
    family: str  # hex digest of the family's stable part
    label: str  # the tags of that part
    requests: int
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    savings: float | None  # None without a price for every model the family used
    misses: tuple[Miss, ...]
    reused_tokens: int = 0  # uncached prompt tokens placed from the document store (.document)

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class SessionReport:
    families: tuple[FamilyReport, ...]

    @property
    def requests(self) -> int:
        return sum(f.requests for f in self.families)

    @property
    def prompt_tokens(self) -> int:
        return sum(f.prompt_tokens for f in self.families)

    @property
    def cached_tokens(self) -> int:
        return sum(f.cached_tokens for f in self.families)

    @property
    def cache_write_tokens(self) -> int:
        return sum(f.cache_write_tokens for f in self.families)

    @property
    def reused_tokens(self) -> int:
        return sum(f.reused_tokens for f in self.families)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def savings(self) -> float | None:
        values = [f.savings for f in self.families]
        return None if not values or None in values else sum(v for v in values if v is not None)

    def family(self, label_or_digest: str) -> FamilyReport:
        """The family with this label (its static tags joined by "+"), digest, or the digest's
        first characters as ``table()`` shows them (at least 4). KeyError, naming what there is,
        when none matches or a label names several families (then pass the digest)."""
        key = label_or_digest
        found = [f for f in self.families if key in (f.label, f.family)]
        if not found and len(key) >= 4:
            found = [f for f in self.families if f.family.startswith(key)]
        if len(found) == 1:
            return found[0]
        if found:
            digests = ", ".join(f.family[:6] for f in found)
            raise KeyError(f"{key!r} names {len(found)} families ({digests}): pass a digest")
        known = ", ".join(f"{f.label} {f.family[:6]}" for f in self.families) or "none"
        raise KeyError(f"no family {key!r}; there are: {known}")

    def table(self) -> str:
        """A short fixed-width table: one line per family, then the total. A "reused" column
        (document-store tokens) appears once any request had some."""
        reused = self.reused_tokens > 0
        head: tuple[str, ...] = ("family", "requests", "prompt tok", "hit rate")
        head += ("cache writes", "saved")
        head += ("reused",) * reused + ("last miss",)
        rows: list[tuple[str, ...]] = [head]
        for f in self.families:
            last = str(f.misses[-1]) if f.misses else "-"
            rows.append(_row(f"{f.label} {f.family[:6]}", f, last, reused))
        count = sum(len(f.misses) for f in self.families)
        misses = f"{count} miss" + "es" * (count != 1)
        rows.append(_row("total", self, misses, reused))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        left: tuple[int, ...] = (0, len(head) - 1)  # text columns; numbers align right
        lines = [
            "  ".join(
                cell.ljust(w) if i in left else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()


def _row(name: str, r: FamilyReport | SessionReport, last: str, reused: bool) -> tuple[str, ...]:
    saved = "-" if r.savings is None else f"{r.savings:.4f}"
    counts: tuple[str, ...] = (str(r.requests), f"{r.prompt_tokens:,}", f"{r.hit_rate:.1%}")
    counts += (f"{r.cache_write_tokens:,}", saved)
    return (name, *counts, *((f"{r.reused_tokens:,}",) * reused), last)


@dataclass(slots=True)
class _Family:
    label: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reused_tokens: int = 0
    by_model: dict[str, tuple[int, int]] = field(default_factory=dict)  # cached, written
    misses: list[Miss] = field(default_factory=list)
    last: tuple[Fingerprint, int] | None = None  # previous request: fingerprint, cached


class SessionLedger:
    """Collects requests as they finish; ``report()`` summarizes them."""

    def __init__(self, family_through: str = "static") -> None:
        if family_through not in STABLE:
            raise ValueError(f"family_through must be one of {STABLE}, got {family_through!r}")
        self.family_through = family_through
        self._families: dict[str, _Family] = {}
        self._requests = 0

    def record(self, prompt: Prompt, usage: Usage, report: CacheReport | None, model: str) -> None:
        fingerprint = prompt.fingerprint()
        key = fingerprint.through(self.family_through)[:FAMILY_HEX]
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = _Family(self._label(fingerprint))
        self._requests += 1
        cached = usage.cached_tokens
        if family.last is not None:
            previous, previous_cached = family.last
            if previous_cached > 0 and cached < previous_cached:
                divergence = diff(previous, fingerprint)
                reason = _miss_reason(report, divergence)
                family.misses.append(
                    Miss(self._requests, cached, previous_cached, divergence, reason)
                )
        family.last = (fingerprint, cached)
        family.requests += 1
        family.prompt_tokens += usage.prompt_tokens or 0
        family.cached_tokens += cached
        family.cache_write_tokens += usage.cache_write_tokens
        family.reused_tokens += report.reused_tokens if report is not None else 0
        read, written = family.by_model.get(model, (0, 0))
        family.by_model[model] = (read + cached, written + usage.cache_write_tokens)

    def report(self, prices: Prices | None = None) -> SessionReport:
        return SessionReport(
            tuple(
                FamilyReport(
                    key,
                    f.label,
                    f.requests,
                    f.prompt_tokens,
                    f.cached_tokens,
                    f.cache_write_tokens,
                    _savings(f.by_model, prices),
                    tuple(f.misses),
                    f.reused_tokens,
                )
                for key, f in self._families.items()
            )
        )

    def _label(self, fingerprint: Fingerprint) -> str:
        limit = RANK[self.family_through]
        tags = [s.tag for s in fingerprint.segments if RANK[s.stability] <= limit]
        return "+".join(tags) if tags else "(no stable part)"


def _miss_reason(report: CacheReport | None, divergence: Divergence | None) -> str | None:
    """The server's reason for the changed segment, else for the first segment that has one."""
    if report is None:
        return None
    changed = divergence.tag_b if divergence is not None else None
    with_reason = [s for s in report.segments if s.miss_reason is not None]
    for s in with_reason:
        if s.tag == changed:
            return s.miss_reason
    return with_reason[0].miss_reason if with_reason else None


def _savings(by_model: Mapping[str, tuple[int, int]], prices: Prices | None) -> float | None:
    if prices is None:
        return None
    total = 0.0
    for model, (cached, written) in by_model.items():
        price = prices if isinstance(prices, Price) else prices.get(model, prices.get("*"))
        if price is None:
            return None
        total += price.savings(cached, written)
    return total
