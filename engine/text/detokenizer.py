"""Token ids streamed into text deltas that never split a UTF-8 character."""

from __future__ import annotations

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    It decodes a short window of recent tokens twice (before and after the new id) and emits
    only the stable new suffix; a delta ending in U+FFFD (an incomplete byte sequence) waits.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoded with the next token for context
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream, less a last character whose bytes
        did not all come (max_tokens cut it: its one U+FFFD would stand for bytes the text does
        not have; vLLM's detokenizer never emits it either). Its tokens, and their logprobs'
        bytes, keep them."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        held = after[len(before) :] if len(after) > len(before) else ""
        return held.removesuffix("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
