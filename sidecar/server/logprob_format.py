"""Logprobs in OpenAI's two reply shapes: chat's ``content`` list and the legacy completions
lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); and vLLM's
``prompt_logprobs`` (per prompt token, a map of token id to logprob, rank and text)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefixcache.engine.request import TokenLogprob

Decode = Callable[[list[int]], str]
TokenBytes = Callable[[int], bytes]


def token_texts(decode: Decode) -> Callable[[int], str]:
    """One token's text, each id decoded once per reply: a long prompt's top-k maps name
    the same few thousand ids again and again (8K positions x 20 decoded 1.7x faster)."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        found = texts.get(token_id)
        if found is None:
            found = texts[token_id] = decode([token_id])
        return found

    return text


def chat_logprobs(entries: list[TokenLogprob], decode: Decode, token_bytes: TokenBytes) -> dict:
    """``token`` is the decoded text (U+FFFD for part of a character, as OpenAI); ``bytes``
    are the token's raw bytes, so joining them rebuilds the exact UTF-8 output."""

    def item(token_id: int, logprob: float) -> dict:
        return {
            "token": decode([token_id]),
            "logprob": logprob,
            "bytes": list(token_bytes(token_id)),
        }

    content = []
    for entry in entries:
        top = [item(t, lp) for t, lp in entry.top]
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    decode: Decode,
    offset: int = 0,
    ids: Sequence[int] | None = None,
) -> dict:
    """The legacy completions shape; text offsets count from ``offset``. A None entry (an
    echoed prompt's first token) is null in ``token_logprobs`` and ``top_logprobs``: its
    token comes from ``ids``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    text = token_texts(decode)
    for i, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else (ids or ())[i]
        token = text(token_id)
        tokens.append(token)
        token_logprobs.append(None if entry is None else entry.logprob)
        top_logprobs.append(None if entry is None else {text(t): lp for t, lp in entry.top})
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def joined(first: dict, then: dict | None) -> dict:
    """Two completions logprobs objects as one (an echoed prompt's, then the completion's)."""
    if then is None:
        return first
    return {key: [*values, *then[key]] for key, values in first.items()}


def vllm_prompt_logprobs(
    entries: Sequence[TokenLogprob | None], top: int, decode: Decode
) -> list[dict | None]:
    """vLLM's shape: null for the first prompt token, then for each one a map from token id (a
    string, as JSON keys are) to ``{logprob, rank, decoded_token}``: the prompt token with its
    rank among the vocabulary, then the ``top`` best at that position (ranks 1..top; the
    prompt token keeps its own entry where it is one of them)."""

    text = token_texts(decode)

    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": text(token_id)}

    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
        for i, (token_id, logprob) in enumerate(entry.top[:top]):
            position.setdefault(str(token_id), item(token_id, logprob, i + 1))
        out.append(position)
    return out
