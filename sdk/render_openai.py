"""OpenAI Chat Completions body: messages in render order, tools, and ``prompt_cache_key``."""

from __future__ import annotations

from typing import Any

from .fingerprint import compute_fingerprint
from .segment import PromptParts


def render_openai(
    prompt: PromptParts,
    *,
    model: str | None = None,
    cache_key_through: str | None = "shared",
    **params: Any,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body. ``params`` (max_tokens, temperature, ...) pass through.

    ``prompt_cache_key`` is the fingerprint of the stable part up to ``cache_key_through``
    ("static", "shared" or "session"; None leaves the key out).
    """
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    body["messages"] = [{"role": s.role, "content": s.content} for s in prompt.rendered()]
    if prompt.tools:
        body["tools"] = [{"type": "function", "function": tool.to_dict()} for tool in prompt.tools]
    if cache_key_through is not None:
        body["prompt_cache_key"] = compute_fingerprint(prompt).cache_key(cache_key_through)
    body.update(params)
    return body
