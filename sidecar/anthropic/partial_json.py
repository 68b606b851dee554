"""The value of JSON text cut anywhere (a forced tool call that ``max_tokens`` stopped), read
as the ``anthropic`` client reads a streamed ``input_json_delta``: with jiter's partial mode
(complete values as they are, open arrays and objects closed, a value cut midway left out)."""

from __future__ import annotations

from typing import Any

import jiter


def partial_object(text: str) -> dict[str, Any]:
    """``text``'s object as far as it came; ``{}`` when no object parses."""
    try:
        value = jiter.from_json(text.encode(), partial_mode=True)
    except ValueError:  # nothing of a value yet, or not JSON
        return {}
    return value if isinstance(value, dict) else {}
