"""Run requests through an ``LLMEngine`` to completion, blocking (scripts, tests, benches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..request import EngineRequest, TokenLogprob, Usage

if TYPE_CHECKING:
    from ..engine import LLMEngine


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


def run_to_completion(engine: LLMEngine, requests: list[EngineRequest]) -> list[GenerationResult]:
    """Add ``requests``, step until each has finished; their results in order."""
    for request in requests:
        engine.add_request(request)
    results: dict[str, GenerationResult] = {
        r.request_id: GenerationResult(r.request_id, list(r.prompt_token_ids), [], "", "", Usage())
        for r in requests
    }
    pending = set(results)
    while pending:
        if not engine.has_unfinished:
            raise RuntimeError("engine stopped with unfinished requests")
        for out in engine.step():
            result = results.get(out.request_id)
            if result is None:
                continue
            result.token_ids.extend(out.new_token_ids)
            result.text += out.text_delta
            if out.logprobs:
                result.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                result.finish_reason = out.finish_reason or ""
                result.stop_reason = out.stop_reason
                result.usage = out.usage or Usage()
                pending.discard(out.request_id)
    return [results[r.request_id] for r in requests]
