"""Chained digests of a prompt's stable part, and where two prompts stop sharing a prefix.

Digest i covers the tools (if any) and every stable segment up to and including segment i,
in render order: ``d[i] = sha256(d[i-1] | role | len(content) | content)``. Two prompts whose
digests agree up to i share that prefix byte for byte; the first digest that differs names the
segment where a prefix cache stops hitting. Tags are labels and do not enter the digest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .segment import PromptParts, tools_segment
from .stability import RANK, STABLE

_ROOT = hashlib.sha256(b"prefixcache.sdk.fingerprint.v1").digest()
CACHE_KEY_HEX = 32  # 128 bits; keeps "pc-" + key well under OpenAI's 64-character limit


@dataclass(frozen=True, slots=True)
class SegmentDigest:
    tag: str
    stability: str
    digest: str  # hex sha256 of everything up to and including this segment


@dataclass(frozen=True, slots=True)
class Fingerprint:
    segments: tuple[SegmentDigest, ...]

    @property
    def hex(self) -> str:
        """The digest of the whole stable part (of nothing, for a prompt without one)."""
        return self.segments[-1].digest if self.segments else _ROOT.hex()

    def through(self, stability: str) -> str:
        """The digest of the stable part up to the end of class ``stability`` (inclusive)."""
        if stability not in STABLE:
            raise ValueError(f"stability must be one of {STABLE}, got {stability!r}")
        limit = RANK[stability]
        last = _ROOT.hex()
        for seg in self.segments:
            if RANK[seg.stability] > limit:
                break
            last = seg.digest
        return last

    def cache_key(self, through: str = "shared") -> str:
        """A short routing key: "pc-" and 32 hex characters of ``through(stability)``.

        The default stops before ``session`` so that every turn of a conversation, and every
        conversation over the same instructions and documents, shares one key.
        """
        return "pc-" + self.through(through)[:CACHE_KEY_HEX]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first stable segment where two prompts differ (``None`` tag: absent on that side)."""

    index: int
    tag_a: str | None
    tag_b: str | None

    def __str__(self) -> str:
        where = f"stable segment {self.index}"
        if self.tag_a == self.tag_b:
            return f"{where} {self.tag_a!r}: its content changed"
        if self.tag_a is None:
            return f"{where}: {self.tag_b!r} added"
        if self.tag_b is None:
            return f"{where}: {self.tag_a!r} gone"
        return f"{where}: {self.tag_a!r} became {self.tag_b!r}"


def compute_fingerprint(prompt: PromptParts) -> Fingerprint:
    chain = _ROOT
    out: list[SegmentDigest] = []
    tools = tools_segment(prompt.tools)
    stable = ([tools] if tools else []) + [s for s in prompt.rendered() if s.is_stable]
    for seg in stable:
        chain = _link(chain, seg.role, seg.content)
        out.append(SegmentDigest(seg.tag, seg.stability, chain.hex()))
    return Fingerprint(tuple(out))


def diff(a: PromptParts | Fingerprint, b: PromptParts | Fingerprint) -> Divergence | None:
    """The first stable segment that differs between ``a`` and ``b``; None when they match."""
    fa = a if isinstance(a, Fingerprint) else compute_fingerprint(a)
    fb = b if isinstance(b, Fingerprint) else compute_fingerprint(b)
    n = max(len(fa.segments), len(fb.segments))
    for i in range(n):
        sa = fa.segments[i] if i < len(fa.segments) else None
        sb = fb.segments[i] if i < len(fb.segments) else None
        if sa is None or sb is None or sa.digest != sb.digest:
            return Divergence(i, sa.tag if sa else None, sb.tag if sb else None)
    return None


def _link(parent: bytes, role: str, content: str) -> bytes:
    data = content.encode()
    h = hashlib.sha256(parent)
    h.update(role.encode() + b"\x00")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    return h.digest()
