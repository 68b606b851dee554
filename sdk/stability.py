"""The four stability classes in render order, defined once for the SDK (and the sidecar).

Rendering, fingerprints, lint and the sidecar's segment ordering all read the order from
here: ``static`` (the same for everyone) → ``shared`` → ``session`` (append-only) →
``dynamic`` (this request only). The first three are "stable": they form the cacheable prefix.
"""

from __future__ import annotations

from typing import Literal, get_args

Stability = Literal["static", "shared", "session", "dynamic"]

STABILITIES: tuple[Stability, ...] = get_args(Stability)
RANK: dict[str, int] = {s: i for i, s in enumerate(STABILITIES)}  # static 0 … dynamic 3
STABLE: tuple[Stability, ...] = STABILITIES[:-1]  # everything but "dynamic"


def is_stable(stability: str) -> bool:
    """Whether segments of this class belong to the cacheable prefix."""
    return RANK[stability] < RANK["dynamic"]
