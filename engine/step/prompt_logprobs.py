"""Prompt logprobs (vLLM's ``prompt_logprobs``, /v1/completions' ``echo``): the logprob of each
prompt token after the first, from the logits at the position before it, and the top k there.

A request that asks for them computes its whole prompt (the scheduler gives it no hit: cached
KV carries no logits). Each chunk's batch entry names the prompt tokens its rows predict and
where the results go (``PromptLogprobSink``); the runner computes those rows' logits through
the same LM head as sampled rows (batch-invariant), a slice at a time, and fills the sink. A
recompute after preemption writes the same values again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import TokenLogprob
from .sequence import Sequence

ROWS_PER_SLICE = 256  # logits rows at once: 256 x a 262K vocabulary is 268 MB of fp32


@dataclass(slots=True)
class PromptLogprobSink:
    """Rows ``[0, len(targets))`` of an entry predict ``targets``; row r's result goes to
    ``into[first + r]`` (the sequence's per-position list)."""

    targets: list[int]
    top: int
    into: list[TokenLogprob | None]
    first: int
    ranks: bool = False  # count each target's rank (a pass over every row: off unless asked)


def sink_for(seq: Sequence, start: int, end: int) -> PromptLogprobSink | None:
    """The sink of a chunk computing positions ``[start, end)`` of ``seq``; None if it wants no
    prompt logprobs or no row of the chunk predicts a prompt token."""
    top = seq.request.sampling.prompt_logprobs
    if top is None:
        return None
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * seq.num_prompt_tokens
    targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
    if not targets:
        return None
    ranks = seq.request.sampling.prompt_logprob_ranks
    return PromptLogprobSink(targets, top, seq.prompt_logprobs, start + 1, ranks)


def fill(sink: PromptLogprobSink, logits: torch.Tensor) -> None:
    """``logits`` float32 ``[len(targets), vocab]``: each row's log-softmax at its target, its
    rank there and, with ``top``, the top k (as the sampler reports a sampled token's)."""
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(sink.targets, dtype=torch.int64)
    chosen_col = logp.gather(1, targets[:, None])
    ranks: list[int | None] = [None] * len(sink.targets)
    if sink.ranks:  # as a float sum: 1.5x faster than a bool tensor's count
        ranks = [int(r) for r in (logp >= chosen_col).float().sum(dim=-1).tolist()]
    chosen = chosen_col[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in sink.targets]
    if sink.top == 1:  # lm-eval's logprobs=1: max (the first maximum), half topk's time
        best, at = logp.max(dim=-1)
        values, ids = best[:, None], at[:, None]
    elif sink.top > 1:
        values, ids = torch.topk(logp, sink.top, dim=-1)
    if sink.top > 0:
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    rows = zip(sink.targets, chosen, tops, ranks, strict=True)
    for r, (token, lp, top, rank) in enumerate(rows):
        sink.into[sink.first + r] = TokenLogprob(token, lp, top, rank)
