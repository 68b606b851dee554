"""Encoding that remembers the text between special tokens.

A tokenizer.json pipeline first cuts its input at the added tokens matched on the raw text
(leftmost-longest), then runs the normalizer, the pre-tokenizer and the model on each piece in
between on its own. Unless a pre-tokenizer looks at where a piece sits in the input (Metaspace
with ``prepend_scheme="first"``) or an added token eats the whitespace beside it, encoding piece
by piece gives exactly the ids of a whole-text encode. A piece seen before (a long system
prompt, a tool schema, a retrieved document inside a chat template) then costs a dict lookup
instead of a BPE pass: 30K tokens take 70-150 ms to encode on one CPU core.

``PieceEncoder.create`` returns None for tokenizers where that equality is not certain: their
configuration must be on the list below and a set of probe strings must encode alike both ways.

The memo is keyed by cache namespace as well as text: a tenant only ever hits pieces it sent
itself, so how fast its prompt is encoded never tells it what another tenant sent (what is
shared is the budget, so another tenant's volume can evict its entries, as in the KV cache).
It is bounded in bytes (the strings and their ids), and ``forget`` drops a refused request's
pieces so that nothing is kept for it.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizers that treat every piece alike, wherever it sits in the input.
_LOCAL_PRE_TOKENIZERS = frozenset(
    {
        "ByteLevel",
        "Split",
        "Whitespace",
        "WhitespaceSplit",
        "Punctuation",
        "Digits",
        "BertPreTokenizer",
        "CharDelimiterSplit",
        "UnicodeScripts",
        "Metaspace",  # unless prepend_scheme is "first": checked below
    }
)
_PROBE_TEXTS = (
    "Hello world",
    " leading space, then\n\nnewlines\tand tabs  ",
    "café naïve 東京 🙂 1234567 x=y+z;",
    "\n",
    " ",
)


@dataclass(slots=True)
class PieceCacheStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    chars: int = 0
    bytes: int = 0  # what the entries hold: strings, ids and their containers


DEFAULT_MAX_BYTES = 128 * 1024**2
_ENTRY_OVERHEAD = 200  # the key tuple, the dict slot, the array header


def entry_bytes(piece: str, ids: array) -> int:
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + _ENTRY_OVERHEAD


class PieceEncoder:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False).ids``."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        split_tokens: Iterable[str],
        max_chars: int = 16_000_000,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._tok = tokenizer
        tokens = sorted(set(split_tokens), key=len, reverse=True)  # longest first: leftmost-longest
        self._split = re.compile("(" + "|".join(map(re.escape, tokens)) + ")")
        self._token_ids: dict[str, int] = {t: tokenizer.token_to_id(t) for t in tokens}
        self._encode_batch: Callable[..., Any] = getattr(
            tokenizer, "encode_batch_fast", tokenizer.encode_batch
        )  # the fast one skips offsets, which we never read
        self._max_chars = max_chars
        self._max_bytes = max_bytes
        self._pieces: OrderedDict[tuple[str, str], array] = OrderedDict()  # (namespace, piece)
        self._fresh: set[tuple[str, str]] = set()  # stored, not hit since: what forget drops
        self._lock = threading.Lock()
        self.stats = PieceCacheStats()

    @classmethod
    def create(
        cls,
        tokenizer: HFTokenizer,
        max_chars: int = 16_000_000,
        max_bytes: int = DEFAULT_MAX_BYTES,
        pipeline: dict[str, Any] | None = None,
    ) -> PieceEncoder | None:
        """An encoder for ``tokenizer``, or None when piece-wise encoding might differ.
        ``pipeline``: ``tokenizer``'s JSON where the caller has it parsed already."""
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return None  # pieces would be cut or padded one by one
        if pipeline is None:
            pipeline = json.loads(tokenizer.to_str())
        split_tokens = _split_tokens(pipeline)
        if not split_tokens:
            return None
        encoder = cls(tokenizer, split_tokens, max_chars, max_bytes)
        if not encoder._agrees_on_probes(split_tokens):
            return None
        encoder.clear()
        return encoder

    def encode(self, text: str, namespace: str = "") -> list[int]:
        """``text``'s ids; its pieces are looked up and remembered under ``namespace`` only."""
        parts = self._split.split(text)  # odd indices are the special tokens
        ids: list[int] = []
        pieces = [piece for piece in parts[0::2] if piece]
        with self._lock:
            missing = dict.fromkeys(p for p in pieces if (namespace, p) not in self._pieces)
        if missing:
            self._store(namespace, list(missing))
        with self._lock:
            for i, part in enumerate(parts):
                if i % 2:
                    ids.append(self._token_ids[part])
                elif part:
                    key = (namespace, part)
                    cached = self._pieces.get(key)
                    if cached is None:  # too big to keep, or evicted by a concurrent store
                        cached = array("l", self._tok.encode(part, add_special_tokens=False).ids)
                    else:
                        self._pieces.move_to_end(key)
                        if part not in missing:
                            self._fresh.discard(key)  # another request's: forget keeps it
                    ids.extend(cached)
            self.stats.hits += len(pieces) - len(missing)
            self.stats.misses += len(missing)
        return ids

    def forget(self, text: str, namespace: str = "") -> None:
        """Drop the pieces of ``text`` under ``namespace`` that no request has hit since they
        were stored (a refused request's own; a shared system prompt stays)."""
        with self._lock:
            for piece in self._split.split(text)[0::2]:
                key = (namespace, piece)
                if key in self._fresh:
                    self._fresh.discard(key)
                    self._account(piece, self._pieces.pop(key), -1)
            self.stats.entries = len(self._pieces)

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._fresh.clear()
            self.stats = PieceCacheStats()

    def _store(self, namespace: str, pieces: list[str]) -> None:
        encodings = self._encode_batch(pieces, add_special_tokens=False)
        with self._lock:
            for piece, encoding in zip(pieces, encodings, strict=True):
                ids = array("l", encoding.ids)
                key = (namespace, piece)
                too_big = len(piece) > self._max_chars or entry_bytes(piece, ids) > self._max_bytes
                if too_big or key in self._pieces:
                    continue
                self._pieces[key] = ids
                self._fresh.add(key)
                self._account(piece, ids, +1)
            while self.stats.chars > self._max_chars or self.stats.bytes > self._max_bytes:
                old_key, evicted_ids = self._pieces.popitem(last=False)
                self._fresh.discard(old_key)
                self._account(old_key[1], evicted_ids, -1)
            self.stats.entries = len(self._pieces)

    def _account(self, piece: str, ids: array, sign: int) -> None:
        self.stats.chars += sign * len(piece)
        self.stats.bytes += sign * entry_bytes(piece, ids)

    def _agrees_on_probes(self, split_tokens: list[str]) -> bool:
        specials = split_tokens[:4] + split_tokens[-2:]
        texts = list(_PROBE_TEXTS)
        for i, special in enumerate(specials):
            a, b = _PROBE_TEXTS[i % 3], _PROBE_TEXTS[(i + 1) % 3]
            texts += [special + a, a + special, a + special + special + b, f" {special} {b}"]
            texts.append(special + "\n" + a + specials[(i + 1) % len(specials)] + b)
        for text in texts:
            whole = self._tok.encode(text, add_special_tokens=False).ids
            if self.encode(text) != whole:
                return False
        return True


def _split_tokens(config: dict[str, Any]) -> list[str]:
    """The added tokens a whole-text encode cuts at before normalizing, if pieces are local."""
    if not _pre_tokenizer_is_local(config.get("pre_tokenizer")):
        return []
    tokens = []
    for added in config.get("added_tokens") or []:
        if added.get("normalized", True):
            continue  # matched after normalization, inside a piece: the piece encode does it too
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return []  # these reach into the neighbouring text
        tokens.append(added["content"])
    return tokens


def _pre_tokenizer_is_local(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_is_local(child) for child in node.get("pretokenizers", []))
    if kind == "Metaspace":
        return node.get("prepend_scheme", "always") != "first"
    return kind in _LOCAL_PRE_TOKENIZERS
