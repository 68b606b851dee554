"""Turn last-token logits into next tokens: greedy rows in one argmax, sampled rows per request.

The logits processors run here, in this order: the grammar masks of constrained requests
(``StructuredOutput``, in place: logprobs see them), then on a copy the penalties and any
processors given at construction, one row at a time; the grammars then take the tokens.

Numerics are safe for every value validation lets through: a temperature below
``GREEDY_BELOW`` is greedy (``logits / T`` would overflow), sampled rows are scaled and
normalised in float64 on the CPU, top-p keeps the most likely token whatever ``top_p`` is, and
penalised logits are clamped to finite values. A row that still fails (a non-finite model
output, a bug) fails alone: its error is in ``Sampled.errors`` and the other rows are unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..request import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from .sequence import Sequence as Seq
    from .structured_output import StructuredOutput

log = logging.getLogger("prefixcache.engine")

History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, output ids) of one request
GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy, as vLLM's _SAMPLING_EPS
# Changes one request's row of logits in place (row, its params, its request id); an
# exception fails that request alone.
RowProcessor = Callable[[torch.Tensor, SamplingParams, str], None]


# Up to this many logits, numpy's argmax (one thread, vectorised) takes the rows: a decode
# step's 1-4 rows in 6-90 us, where the two passes below wake torch's threads for 25-115 us
# (and now and then for milliseconds); past it the passes' two threads win (32 x 262K: 0.5x).
NUMPY_ARGMAX_MAX_ELEMENTS = 1 << 20


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (the first maximum of each row, NaN counting as the largest),
    by numpy's argmax (the same rule) for a few rows, else in two vectorised passes: torch's
    CPU argmax reads a row one element at a time, 20x slower than ``amax`` over a 32 x 32,000
    batch."""
    rows, vocab = logits.shape
    if (
        rows * vocab <= NUMPY_ARGMAX_MAX_ELEMENTS
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and not logits.requires_grad
    ):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    chunk = 256
    while chunk >= 16 and vocab % chunk:
        chunk //= 2
    if chunk < 16 or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // chunk, chunk)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding each row's maximum
    within = blocks[torch.arange(rows), best].argmax(dim=-1)
    return best * chunk + within


# top_p's nucleus is looked for among this many most likely tokens first, then 8x as many,
# up to the vocabulary: a top-k of 1,024 takes 0.1-1 ms where sorting every probability took
# 3.5-30 ms (49K-262K vocabularies), and the nucleus of a next token is nearly always inside.
NUCLEUS_CANDIDATES = 1024


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and probabilities top-p keeps of ``probs`` (1-D, summing to 1): in descending
    order, each whose predecessors' mass is under ``top_p``, and the most likely one always.
    Found among the most likely tokens, as many as it takes: none past a set whose mass
    reaches ``top_p`` can be kept, so the answer is the one sorting them all would give."""
    n = probs.shape[-1]
    k = min(NUCLEUS_CANDIDATES, n)
    while True:
        values, ids = torch.topk(probs, k)  # descending
        cumulative = torch.cumsum(values, dim=-1)
        if k == n or float(cumulative[-1]) >= top_p:
            keep = cumulative - values < top_p
            keep[0] = True  # the most likely token, even for a top_p that rounds to 0
            return ids[keep], values[keep]
        k = min(n, k * 8)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index of ``weights`` (1-D, not negative, not all zero) drawn with probability
    proportional to its weight: one uniform number through the cumulative sum (where
    ``torch.multinomial`` draws an exponential per entry). ValueError if a weight is not
    finite (a model's NaN or inf): that row fails alone."""
    cumulative = torch.cumsum(weights, dim=-1)
    total = float(cumulative[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"probabilities that sum to {total}")
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * total
    at = int(torch.searchsorted(cumulative, torch.tensor([u], dtype=cumulative.dtype), right=True))
    if at >= weights.shape[-1]:  # u rounded up to the total: the last token with any weight
        at = int(torch.nonzero(weights)[-1])
    return at


class Sampled(NamedTuple):
    tokens: list[int]  # -1 where the row failed
    logprobs: list[TokenLogprob | None]
    errors: list[str | None]  # why a row failed; None for the rows that did not


def is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature < GREEDY_BELOW


class Sampler:
    def __init__(
        self,
        grammar: StructuredOutput | None = None,
        processors: Sequence[RowProcessor] = (),
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.grammar = grammar
        self.processors = tuple(processors)
        self.eos_token_ids = sorted(eos_token_ids)  # masked while a request is under min_tokens
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, params: SamplingParams, namespace: str = "") -> None:
        """A new request: its grammar compiled, cached per cache namespace (ValueError for a
        schema it cannot use)."""
        if params.grammar is not None:
            if self.grammar is None:
                raise ValueError("this engine does no constrained output")
            self.grammar.add(request_id, params.grammar, namespace)

    def sample_next(self, logits: torch.Tensor, seqs: list[Seq]) -> Sampled:
        """The next token of each sequence (a row of ``logits`` each, in order)."""
        params = [s.request.sampling for s in seqs]
        histories = None
        if any(p.penalized for p in params):  # only then: the ids each request has seen
            histories = [
                (s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :])
                if p.penalized
                else ((), ())
                for s, p in zip(seqs, params, strict=True)
            ]
        banned = None
        if any(p.min_tokens or p.bad_words_token_ids for p in params):
            banned = [  # stop ids until min_tokens are out; the bad words' next tokens
                (self._stop_ids(p) if s.num_output_tokens < p.min_tokens else [])
                + bad_word_ends(p.bad_words_token_ids, s.token_ids[s.num_prompt_tokens :])
                for s, p in zip(seqs, params, strict=True)
            ]
        return self.sample(logits, params, [s.request_id for s in seqs], histories, banned)

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        return [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        histories: list[History] | None = None,
        banned: list[list[int]] | None = None,
    ) -> Sampled:
        """``logits`` is float32 ``[n, vocab]``; returns one token (and optional logprob) per row.

        Rows with penalties need their ``histories`` (prompt and output ids); logprobs are the
        model's own, before penalties, temperature and truncation (as vLLM reports them).
        """
        assert logits.shape[0] == len(params)
        if self.grammar is not None:
            self.grammar.mask(logits, request_ids)  # constrained rows only
        errors: list[str | None] = [None] * len(params)
        chosen_from = logits
        penalize = histories is not None and any(p.penalized for p in params)
        biased = any(p.logit_bias for p in params)
        allowed = any(p.allowed_token_ids for p in params)
        if penalize or self.processors or biased or allowed or (banned and any(banned)):
            chosen_from = logits.clone()
        if allowed:  # vLLM's allowed_token_ids: every other token out of reach
            for row, p in enumerate(params):
                if p.allowed_token_ids:
                    self._guard(errors, row, request_ids, keep_only, chosen_from[row], p.allowed_token_ids)  # fmt: skip
        if biased:  # before penalties, as vLLM's processors run (logprobs are the model's)
            for row, p in enumerate(params):
                if p.logit_bias:
                    self._guard(errors, row, request_ids, add_bias, chosen_from[row], p.logit_bias)
        vocab = logits.shape[-1]
        for row, ids in enumerate(banned or ()):  # min_tokens: not yet (logprobs see them)
            if ids:
                chosen_from[row, [i for i in ids if 0 <= i < vocab]] = float("-inf")
        if histories is not None and penalize:
            for row, (p, history) in enumerate(zip(params, histories, strict=True)):
                if p.penalized:
                    self._guard(
                        errors, row, request_ids, apply_penalties, chosen_from[row], p, history
                    )
        for fn in self.processors:
            for row, (p, rid) in enumerate(zip(params, request_ids, strict=True)):
                if errors[row] is None:
                    self._guard(errors, row, request_ids, fn, chosen_from[row], p, rid)
        tokens = first_argmax(chosen_from).tolist()  # greedy for every row; sampled overwrite
        for row, (p, rid) in enumerate(zip(params, request_ids, strict=True)):
            if errors[row] is None and not is_greedy(p):
                token = self._guard(
                    errors, row, request_ids, self._sample_row, chosen_from[row], p, rid
                )
                tokens[row] = -1 if token is None else token
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        for row, p in enumerate(params):
            if p.logprobs is not None and errors[row] is None:
                top = min(p.logprobs, logits.shape[-1])
                logprobs[row] = self._guard(
                    errors, row, request_ids, _logprob_of, logits[row], tokens[row], top
                )
        tokens = [-1 if e else t for t, e in zip(tokens, errors, strict=True)]
        if self.grammar is not None:
            ok = [i for i, e in enumerate(errors) if e is None]
            self.grammar.accept([request_ids[i] for i in ok], [tokens[i] for i in ok])
        return Sampled(tokens, logprobs, errors)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.forget(request_id)

    @staticmethod
    def _guard(errors: list[str | None], row: int, request_ids: list[str], fn, *args):  # type: ignore[no-untyped-def]
        """``fn(*args)``; an exception fails row ``row`` only (recorded in ``errors``)."""
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("sampling failed for request %s", request_ids[row])
            errors[row] = f"sampling failed: {type(exc).__name__}: {exc}"
            return None

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, request_id: str) -> int:
        # float64 on the CPU (where seeded generators live): logits / T stays finite for
        # T >= GREEDY_BELOW and the tail probabilities keep their precision. The elementwise
        # steps run in numpy, on this thread: torch's would wake its threads for a row past
        # 32K values and, on a busy box, wait milliseconds for the other core.
        scaled = row.detach().to("cpu", torch.float32).numpy().astype(np.float64)
        scaled /= p.temperature
        if p.min_p > 0.0:  # vLLM's order: after the temperature, before top-k and top-p
            probs = torch.softmax(torch.from_numpy(scaled), dim=-1).numpy()
            scaled[probs < p.min_p * probs.max()] = -np.inf
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = float(torch.topk(torch.from_numpy(scaled), p.top_k).values[-1])
            scaled[scaled < kth] = -np.inf
        probs = torch.softmax(torch.from_numpy(scaled), dim=-1)
        generator = self._generator(p, request_id)
        if p.top_p < 1.0:
            ids, weights = nucleus(probs, p.top_p)
            return int(ids[draw(weights, generator)])
        return draw(probs, generator)

    def _generator(self, p: SamplingParams, request_id: str) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(p.seed)
            self._generators[request_id] = gen
        return gen


def bad_word_ends(words: tuple[tuple[int, ...], ...], output: Sequence[int]) -> list[int]:
    """vLLM's bad_words: the last token of each word whose other tokens end ``output``."""
    ends = []
    for word in words:
        head = word[:-1]
        if not head or (len(output) >= len(head) and tuple(output[-len(head) :]) == head):
            ends.append(word[-1])
    return ends


def keep_only(row: torch.Tensor, ids: tuple[int, ...]) -> None:
    """Every logit of ``row`` but those of ``ids`` to -inf (ids past the vocabulary: a
    ValueError, that row fails)."""
    if ids[-1] >= row.shape[-1]:
        raise ValueError(f"allowed_token_ids: a token id over the vocabulary ({row.shape[-1]})")
    index = torch.tensor(ids, dtype=torch.int64)
    kept = row.index_select(0, index)
    row.fill_(float("-inf"))
    row.index_copy_(0, index, kept)


def add_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's logit_bias on one row (ids past the vocabulary: a ValueError, that row fails)."""
    ids = torch.tensor(list(bias), dtype=torch.int64)
    if int(ids.max()) >= row.shape[-1]:
        raise ValueError(f"logit_bias token id over the vocabulary ({row.shape[-1]})")
    row.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=row.dtype))


def apply_penalties(row: torch.Tensor, p: SamplingParams, history: History) -> None:
    """Penalize one row of logits in place for the tokens its request has seen."""
    prompt, output = history
    vocab = row.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list({*prompt, *output}), dtype=torch.long, device=row.device)
        values = row[seen]
        largest = torch.finfo(row.dtype).max  # a tiny penalty would divide to inf
        penalized = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
        row[seen] = penalized.clamp(-largest, largest)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(output, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _logprob_of(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logp = torch.log_softmax(row, dim=-1)
    result = TokenLogprob(token_id=token, logprob=float(logp[token]))
    if top > 0:
        values, ids = torch.topk(logp, top)
        result.top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return result
