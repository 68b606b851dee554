"""Constrained decoding: a request's ``GrammarSpec`` masks its logits row at every step.

xgrammar compiles a grammar (JSON, or JSON valid against a schema) against the vocabulary
once; ``StructuredOutput`` keeps compiled grammars by digest (LRU) and one matcher per
constrained request. Each step the engine asks it to ``mask`` the rows of constrained
requests (unconstrained rows are untouched, so they sample what they would alone) and then
``accept`` the sampled tokens. The grammar's end allows only the stop tokens, so a finished
value ends the request with "stop"; ``max_tokens`` may still cut it ("length").

xgrammar is imported on the first constrained request (it is slow to import).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from ..request import GrammarSpec

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

log = logging.getLogger("prefixcache.engine")


class StructuredOutput:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's, >= the tokenizer's)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()  # digest -> CompiledGrammar
        self._matchers: dict[str, Any] = {}  # request id -> GrammarMatcher
        self._bitmask: torch.Tensor | None = None
        self.num_compiled = 0  # grammars compiled (not taken from the cache), for tests

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec``, from the cache if seen; ValueError if invalid."""
        grammar = self._grammars.get(spec.digest)
        if grammar is not None:
            self._grammars.move_to_end(spec.digest)
            return grammar
        compiler = self._grammar_compiler()
        try:
            # No free whitespace: a model that likes spaces could otherwise never finish.
            if spec.kind == "json":  # OpenAI's json_object: any JSON object
                grammar = compiler.compile_json_schema(
                    {"type": "object"}, any_whitespace=False, strict_mode=False
                )
            else:
                schema = json.loads(spec.schema)
                grammar = compiler.compile_json_schema(schema, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(
                f"the JSON schema cannot be used for constrained output: {exc}"
            ) from None
        self.num_compiled += 1
        self._grammars[spec.digest] = grammar
        if len(self._grammars) > self.cache_size:
            self._grammars.popitem(last=False)
        return grammar

    def add(self, request_id: str, spec: GrammarSpec) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(self.compile(spec))

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Set to -inf, in place, every token the grammar forbids in the constrained rows."""
        matchers = self._matchers
        # A terminated matcher (its stop token sampled, yet the request goes on, e.g. with
        # ignore_eos) has nothing left to allow: its row is left as it is.
        rows = [
            i
            for i, rid in enumerate(request_ids)
            if rid in matchers and not matchers[rid].is_terminated()
        ]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = self._bitmask_for(len(request_ids))
        for row in rows:
            self._matchers[request_ids[row]].fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask[: len(request_ids)].to(logits.device), indices=rows
        )

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        for rid, token in zip(request_ids, tokens, strict=True):
            matcher = self._matchers.get(rid)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token):  # masked, so only a bug gets here
                log.error("grammar rejected token %d of request %s", token, rid)

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer
            special = tok.special_token_ids
            # An empty entry keeps a token out of every value: control tokens are never text,
            # and JSON without free whitespace never holds a raw control character (xgrammar's
            # strings would let some through, which JSON parsers refuse).
            vocab = []
            for i in range(tok.vocab_size):
                piece = b"" if i in special else tok.token_bytes(i)
                vocab.append(b"" if any(byte < 0x20 for byte in piece) else piece)
            info = xgr.TokenizerInfo(
                vocab,
                xgr.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=list(tok.eos_token_ids),
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler
