"""What the router reads of a request: its rendered text and, with a tokenizer, its token ids.

``text`` keys the approximate tree: the model, then each message as role and content (or the
completions prompt), with separators no prompt text contains, and without the generation
prompt, so turn N's text is a prefix of turn N+1's. ``token_ids`` are what the upstream will
compute: the chat template rendered once and encoded once (chat/rendering.py, as vLLM and
our engine do), or the completions prompt encoded with special tokens (a token-id prompt as
given). None when the router has no tokenizer or the body is not one it can render.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ..chat.rendering import ChatTokenizer, PromptRenderer

FIELD = "\x1f"  # between a message's role and content
RECORD = "\x1e"  # after each message


@dataclass(slots=True, frozen=True)
class RouteInput:
    text: str
    token_ids: list[int] | None


class RouteReader:
    def __init__(self, tokenizer: ChatTokenizer | None = None) -> None:
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(tokenizer) if tokenizer is not None else None

    def chat(self, body: dict[str, Any]) -> RouteInput:
        """``body`` after the segments rewrite: plain ``messages``."""
        messages = body.get("messages")
        model = str(body.get("model"))
        if not isinstance(messages, list):
            return RouteInput(model + RECORD + _canonical(messages), None)
        parts = [model, RECORD]
        plain: list[dict[str, str]] = []
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else message
            parts += [
                str(role),
                FIELD,
                content if isinstance(content, str) else _canonical(content),
            ]
            parts.append(RECORD)
            if isinstance(role, str) and isinstance(content, str):
                plain.append({"role": role, "content": content})
        text = "".join(parts)
        token_ids = None
        if self.renderer is not None and plain and len(plain) == len(messages):
            try:
                token_ids = self.renderer.render_messages(plain).token_ids
            except Exception:
                token_ids = None
        return RouteInput(text, token_ids)

    def completion(self, body: dict[str, Any]) -> RouteInput:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        model = str(body.get("model")) + RECORD
        if isinstance(prompt, str):
            ids = None
            if self.tokenizer is not None:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            return RouteInput(model + prompt, ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return RouteInput(model + ",".join(map(str, prompt)), list(prompt))
        return RouteInput(model + _canonical(prompt), None)


def _canonical(value: Any) -> str:
    try:
        return msgspec.json.encode(value, order="sorted").decode()
    except (TypeError, msgspec.EncodeError):
        return repr(value)
