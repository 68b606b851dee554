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


class TokenOffsets:
    """Where each next token starts in the text the tokens decode to, counted from ``start``:
    the characters before it that are whole. A token inside a character split across several
    starts at that character; one that ends with part of a character still moves the next one
    past its whole ones. The same for a whole reply and a stream fed token by token."""

    def __init__(self, decode: Decode, start: int = 0) -> None:
        self.decode = decode
        self.released = start  # characters of ids[:read], the whole ones
        self.pending = 0  # whole characters past them in the window's undecided tail
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decoded last: the next token's context

    def here(self) -> int:
        """Where the next token would start: the offset of one the text leaves out."""
        return self.released + self.pending

    def take(self, token_id: int) -> int:
        """``token_id``'s offset; it becomes the text's next token."""
        at = self.here()
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if after.endswith("\ufffd"):  # a character not whole yet: count what is
            whole = after.rstrip("\ufffd")
            self.pending = len(whole) - len(before) if whole.startswith(before) else 0
            return at
        self.released += len(after) - len(before)
        self.pending = 0
        self.prefix, self.read = self.read, len(self.ids)
        del self.ids[: self.prefix]  # what no later window reads
        self.read -= self.prefix
        self.prefix = 0
        return at


LOWEST = -9999.0  # vLLM's floor: a token the grammar or a mask ruled out has -inf, no JSON


def floored(logprob: float) -> float:
    return max(logprob, LOWEST)


def chat_logprobs(
    entries: list[TokenLogprob],
    decode: Decode,
    token_bytes: TokenBytes,
    shown: Callable[[int], bool] | None = None,
) -> dict:
    """``token`` is the decoded text (U+FFFD for part of a character, as OpenAI); ``bytes``
    are the token's raw bytes, so joining them rebuilds the exact UTF-8 output: tokens the
    text leaves out (``shown`` false: an end-of-turn or other special token) are not listed."""

    def item(token_id: int, logprob: float) -> dict:
        return {
            "token": decode([token_id]),
            "logprob": floored(logprob),
            "bytes": list(token_bytes(token_id)),
        }

    content = []
    for entry in entries:
        if shown is not None and not shown(entry.token_id):
            continue
        top = [item(t, lp) for t, lp in entry.top]
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    decode: Decode,
    offsets: TokenOffsets,
    ids: Sequence[int] | None = None,
    shown: Callable[[int], bool] | None = None,
) -> dict:
    """The legacy completions shape; text offsets from ``offsets`` (a stream's carries on
    from one call to the next). A None entry (an
    echoed prompt's first token) is null in ``token_logprobs`` and ``top_logprobs``: its
    token comes from ``ids``. Each ``top_logprobs`` holds the sampled token too (up to k + 1
    entries, as OpenAI's). Every token is listed, as vLLM and OpenAI's completions list an end
    of text: lm-evaluation-harness reads an echo's last entry as the generated token. One the
    text leaves out (``shown`` false: an end of turn) has its special-token name and the
    offset where it sits, and moves no later token's offset."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    text = token_texts(decode)
    for i, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else (ids or ())[i]
        if shown is None or shown(token_id):
            text_offset.append(offsets.take(token_id))
        else:
            text_offset.append(offsets.here())
        tokens.append(text(token_id))
        token_logprobs.append(None if entry is None else floored(entry.logprob))
        if entry is None:
            top_logprobs.append(None)
            continue
        top = {text(t): floored(lp) for t, lp in entry.top}
        top.setdefault(text(token_id), floored(entry.logprob))
        top_logprobs.append(top)
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
        return {"logprob": floored(logprob), "rank": rank, "decoded_token": text(token_id)}

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
