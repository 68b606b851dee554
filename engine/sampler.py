"""Turn last-token logits into next tokens: greedy rows in one argmax, sampled rows per request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import SamplingParams, TokenLogprob

History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, output ids) of one request


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        histories: list[History] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is float32 ``[n, vocab]``; returns one token (and optional logprob) per row.

        Rows with penalties need their ``histories`` (prompt and output ids); logprobs are the
        model's own, before penalties, temperature and truncation (as vLLM reports them).
        """
        assert logits.shape[0] == len(params)
        chosen_from = logits
        if histories is not None and any(p.penalized for p in params):
            chosen_from = logits.clone()
            for row, (p, history) in enumerate(zip(params, histories, strict=True)):
                if p.penalized:
                    apply_penalties(chosen_from[row], p, history)
        tokens = chosen_from.argmax(dim=-1).tolist()  # greedy for every row; sampled overwrite
        for row, (p, rid) in enumerate(zip(params, request_ids, strict=True)):
            if not p.greedy:
                tokens[row] = self._sample_row(chosen_from[row], p, rid)
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        for row, p in enumerate(params):
            if p.logprobs is not None:
                logprobs[row] = _logprob_of(logits[row], tokens[row], p.logprobs)
        return tokens, logprobs

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, request_id: str) -> int:
        scaled = row.float().cpu() / p.temperature  # seeded generators live on the CPU
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p  # first always kept
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(p, request_id)).item())

    def _generator(self, p: SamplingParams, request_id: str) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(p.seed)
            self._generators[request_id] = gen
        return gen


def apply_penalties(row: torch.Tensor, p: SamplingParams, history: History) -> None:
    """Penalize one row of logits in place for the tokens its request has seen."""
    prompt, output = history
    vocab = row.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list({*prompt, *output}), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
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
