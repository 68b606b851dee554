"""What a request's stream shows: when it stops, which text it releases, its outputs.

A stop string can span tokens, so generated text that could still begin one is held back in
``seq.pending_text`` and released once it cannot; when one appears, the text is cut before
it. These functions change the sequence's text fields only (engine thread); the engine owns
the rest of a sequence's life (blocks, metrics).
"""

from __future__ import annotations

from ..memory.miss_reasons import segment_misses
from ..request import RequestOutput, RequestTiming, SegmentUsage, TokenLogprob, Usage
from .sequence import Sequence


def finish_reason(
    seq: Sequence, token: int, eos_token_ids: frozenset[int], max_seq_len: int
) -> str | None:
    """Take in ``token`` (just appended to ``seq.token_ids``): "stop" or "length" when the
    sequence ends with it (its held-back text is then final), else None."""
    params, detokenizer = seq.request.sampling, seq.detokenizer
    assert detokenizer is not None
    stoppable = seq.num_output_tokens >= params.min_tokens  # the sampler masked the stop ids
    if token in params.stop_token_ids:
        reason, seq.stop_reason = "stop", token
    elif token in eos_token_ids and not params.ignore_eos:
        reason = "stop"
    else:
        reason = None
    if reason is not None and params.include_stop_str_in_output:
        seq.pending_text += detokenizer.push(token)  # vLLM's: the stop token's text kept too
    elif reason is None:
        seq.pending_text += detokenizer.push(token)
        if params.stop and stoppable and _cut_at_stop(seq):
            return "stop"
    if reason is None and (
        seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_seq_len
    ):
        reason = "length"
    if reason is not None:
        seq.pending_text += detokenizer.flush()  # what the detokenizer still holds back
        if params.stop and stoppable and _cut_at_stop(seq):
            reason = "stop"
    return reason


def delta_output(seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
    """A running sequence's output for one new token: the text that can no longer become part
    of a stop string."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[token],
        text_delta=_release_text(seq),
        logprobs=[logprob] if logprob is not None else None,
    )


def final_output(seq: Sequence, reason: str, now: float) -> RequestOutput:
    """The stream's last output: the rest of the held-back text, usage and timing."""
    delta, seq.pending_text = seq.pending_text, ""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[],
        text_delta=delta,
        finished=True,
        finish_reason=reason,
        stop_reason=seq.stop_reason,
        usage=usage_of(seq),
        timing=RequestTiming(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, now),
    )


def aborted_output(request_id: str, message: str) -> RequestOutput:
    """The last output of a stream the engine ended without running it to its end."""
    return RequestOutput(request_id, [], "", finished=True, finish_reason="abort", error=message)


def usage_of(seq: Sequence) -> Usage:
    cached = seq.num_cached_tokens or 0
    segments = None
    spans = seq.request.segments
    placed = {p.segment: p for p in seq.placements}
    if spans is not None:
        misses = segment_misses(spans, cached, seq.miss)
        segments = []
        for i, (s, miss) in enumerate(zip(spans, misses, strict=True)):
            tokens, hit = s.end - s.start, max(0, min(cached, s.end) - s.start)
            usage = SegmentUsage(
                s.tag, tokens, hit, miss, "cached" if hit == tokens else "computed"
            )
            if (p := placed.get(i)) is not None:
                usage.served, usage.reused_tokens = "reused_anywhere", p.num_tokens
                usage.recomputed_tokens = tokens - p.num_tokens - hit
            segments.append(usage)
    tiers = {"pool": cached - seq.num_reloaded_tokens}
    if seq.num_reloaded_tokens:
        tiers[seq.reload_tier] = seq.num_reloaded_tokens
    return Usage(
        prompt_tokens=seq.num_prompt_tokens,
        cached_tokens=cached,
        cached_tokens_by_tier=tiers,
        computed_prompt_tokens=seq.num_computed_prompt_tokens,
        completion_tokens=seq.num_output_tokens,
        segments=segments,
        reused_tokens=sum(p.num_tokens for p in seq.placements),
    )


def _cut_at_stop(seq: Sequence) -> bool:
    """If a stop string appears in the held-back text, cut the text before the first one (it
    becomes the sequence's ``stop_reason``), or after it with ``include_stop_str_in_output``."""
    sampling = seq.request.sampling
    hits = [(at, s) for s in sampling.stop if s and (at := seq.pending_text.find(s)) >= 0]
    if not hits:
        return False
    at, stop = min(hits, key=lambda hit: hit[0])
    seq.stop_reason = stop
    seq.pending_text = seq.pending_text[: at + len(stop) if sampling.include_stop_str_in_output else at]  # fmt: skip
    return True


def _release_text(seq: Sequence) -> str:
    """Text that can no longer become part of a stop string; the rest stays held back."""
    hold = max((len(s) for s in seq.request.sampling.stop), default=1) - 1
    cut = len(seq.pending_text) - hold
    if cut <= 0:
        return ""
    delta, seq.pending_text = seq.pending_text[:cut], seq.pending_text[cut:]
    return delta
