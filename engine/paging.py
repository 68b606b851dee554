"""Page arithmetic: the default page size and how many pages hold a number of tokens.

A leaf module: any engine module may import it.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16  # token slots per KV page (block)


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, e.g. the pages that hold ``n`` tokens at ``d`` tokens a page."""
    return -(-n // d)
