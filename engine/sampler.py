"""Turn last-token logits into next tokens: greedy rows in one argmax, sampled rows per request."""

from __future__ import annotations

import torch

from .request import SamplingParams, TokenLogprob


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` is float32 ``[n, vocab]``; returns one token (and optional logprob) per row."""
        assert logits.shape[0] == len(params)
        tokens = logits.argmax(dim=-1).tolist()  # greedy for every row; sampled rows overwrite
        for row, (p, rid) in enumerate(zip(params, request_ids, strict=True)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, rid)
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


def _logprob_of(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logp = torch.log_softmax(row, dim=-1)
    result = TokenLogprob(token_id=token, logprob=float(logp[token]))
    if top > 0:
        values, ids = torch.topk(logp, top)
        result.top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return result
