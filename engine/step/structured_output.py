"""Constrained decoding: a request's ``GrammarSpec`` masks its logits row at every step.

llguidance (Rust, no torch or GPU compiler) turns a grammar (JSON, JSON valid against a
schema, a regular expression, a choice of strings, a Lark or GBNF grammar) into a grammar
string once; ``StructuredOutput`` keeps those by digest (LRU) and one
matcher per constrained request. Each step the engine asks it to ``mask`` the rows of
constrained requests (unconstrained rows are untouched, so they sample what they would
alone) and then ``accept`` the sampled tokens. The grammar's end allows only the stop
tokens, so a finished value ends the request with "stop"; ``max_tokens`` may still cut it
("length").

The grammar itself (objects closed unless the schema says, no free whitespace) comes from
``engine/grammar.py``; here it is checked against the tokenizer. llguidance is imported on the
first constrained request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..grammar import REFUSED, GrammarCache, compiled_grammar
from ..request import GrammarSpec

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

log = logging.getLogger("prefixcache.engine")

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


class StructuredOutput:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_bytes: int = 64 << 20) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's, >= the tokenizer's)
        self._lltok: Any = None
        self._executor: Any = None
        self.grammars = GrammarCache(cache_bytes)  # checked against the tokenizer
        self._matchers: dict[str, Any] = {}  # request id -> LLMatcher
        self._ended: set[str] = set()  # requests whose matcher took its stop token
        self._stop_ids = frozenset(tokenizer.eos_token_ids)
        self._bitmask: np.ndarray | None = None
        self.num_compiled = 0  # grammars compiled (not taken from the cache), for tests

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def compile(self, spec: GrammarSpec, namespace: str = "") -> str:
        """The checked grammar of ``spec``, from the namespace's cache if seen; ValueError if
        invalid (kept too: a refused schema sent again is refused at once)."""
        return self.grammars.get_or_compile(spec, self._checked, namespace)

    def _checked(self, spec: GrammarSpec) -> str:
        import llguidance as llg

        grammar = compiled_grammar(spec)  # ValueError where the schema itself is refused
        try:
            error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer())
        except (RuntimeError, ValueError, TypeError) as exc:
            error = str(exc)
        if error:
            raise ValueError(f"{REFUSED[spec.kind]}: {error}")
        self.num_compiled += 1
        return grammar

    def add(self, request_id: str, spec: GrammarSpec, namespace: str = "") -> None:
        import llguidance as llg

        matcher = llg.LLMatcher(self._tokenizer(), self.compile(spec, namespace), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{REFUSED[spec.kind]}: {matcher.get_error()}")
        self._matchers[request_id] = matcher

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._ended.discard(request_id)

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Set to -inf, in place, every token the grammar forbids in the constrained rows."""
        matchers, ended = self._matchers, self._ended
        # A matcher whose value is complete allows only the stop tokens; once one is taken
        # (yet the request goes on, e.g. with ignore_eos) nothing is left: its row is left as
        # it is.
        rows = [i for i, rid in enumerate(request_ids) if rid in matchers and rid not in ended]
        if not rows:
            return
        bitmask = self._bitmask_for(len(rows))
        # every row's mask at once, across llguidance's threads, without the GIL
        self._executor.unsafe_compute_mask_ptr(
            [(matchers[request_ids[row]], k) for k, row in enumerate(rows)],
            bitmask.ctypes.data,
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )
        bits = np.unpackbits(bitmask[: len(rows)].view(np.uint8), axis=1, bitorder="little")
        forbidden = bits[:, : logits.shape[1]] == 0
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS:
            # numpy on this thread: torch's masked_fill_ over a 49K-token row fans out to its
            # intra-op workers, which stalled 250 ms at a time on a loaded 2-vCPU box
            values = logits.detach().numpy()
            for k, row in enumerate(rows):
                np.copyto(values[row], -np.inf, where=forbidden[k])
            return
        mask = torch.from_numpy(forbidden).to(logits.device)
        with torch.inference_mode():  # the model's logits are inference tensors
            for k, row in enumerate(rows):
                logits[row].masked_fill_(mask[k], float("-inf"))

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        for rid, token in zip(request_ids, tokens, strict=True):
            matcher = self._matchers.get(rid)
            if matcher is None or rid in self._ended:
                continue
            if not matcher.consume_token(token):  # masked, so only a bug gets here
                log.error("grammar rejected token %d of request %s", token, rid)
                self._ended.add(rid)  # an error state is for good: unconstrained from here
            elif token in self._stop_ids and matcher.is_stopped():
                self._ended.add(rid)

    def _bitmask_for(self, num_rows: int) -> np.ndarray:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            words = (self.vocab_size + 31) // 32  # one bit a token, little-endian words
            self._bitmask = np.zeros((max(num_rows, 8), words), dtype=np.int32)
        return self._bitmask

    def prepare(self) -> None:
        """Build llguidance's view of the vocabulary now (before compiles on other threads)."""
        self._tokenizer()

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once: the token trie)."""
        if self._lltok is None:
            import llguidance as llg

            tok = self.tokenizer
            special = tok.special_token_ids
            # An empty entry keeps a token out of every value: control tokens are never text,
            # and JSON without free whitespace never holds a raw control character.
            pieces = []
            for i in range(tok.vocab_size):
                piece = b"" if i in special else tok.token_bytes(i)
                pieces.append(b"" if any(byte < 0x20 for byte in piece) else piece)
            pieces += [b""] * (self.vocab_size - len(pieces))  # the model's extra rows
            wrapper = llg.TokenizerWrapper(_Vocabulary(tok, pieces))
            self._lltok = llg.LLTokenizer(
                wrapper, n_vocab=self.vocab_size, eos_token=list(tok.eos_token_ids)
            )
            self._executor = llg.LLExecutor()
        return self._lltok


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: the pieces, the stop and special ids, and
    an encoder (llguidance tokenizes grammar literals with it)."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes]) -> None:
        self._tokenizer = tokenizer
        self.tokens = pieces
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id: int | None = None
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)
