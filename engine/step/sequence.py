"""A request's life inside the engine: its tokens, its block table and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..request import EngineRequest, SegmentMiss, TokenLogprob

if TYPE_CHECKING:
    from ..memory.block_types import BlockTable
    from ..text.detokenizer import IncrementalDetokenizer
    from .chunk_reuse import Placement


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    arrival_order: int  # admission tie-breaker and the preemption order (newest first)
    arrival_step: int  # the step it (re-)entered the waiting queue: the age bound counts from here
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    table: BlockTable | None = None
    num_computed_tokens: int = 0  # tokens whose KV is written in the table's blocks
    num_cached_tokens: int | None = None  # prompt tokens hit at the first admission
    num_reloaded_tokens: int = 0  # of those, copied back from the KV tier
    reload_tier: str = ""  # that tier's kind: "host" | "disk"
    num_computed_prompt_tokens: int = 0  # prompt tokens this request computed (incl. recompute)
    block_hashes: list[bytes] = field(default_factory=list)  # of token_ids' full blocks
    hit_estimate: int = 0  # cached-prefix length while waiting, for admission order only
    hit_estimate_step: int = -1  # the step it was last measured (-1: never)
    miss: SegmentMiss | None = None  # why the first admission's match stopped where it did
    pending_text: str = ""  # generated text held back while it may start a stop string
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # reuse="anywhere" segments' stored KV placed into the table at this admission (sorted,
    # disjoint); those positions count as computed without being computed
    placements: list[Placement] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # with prompt_logprobs: per prompt position, filled as its chunks are computed
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def namespace(self) -> str:
        return self.request.namespace

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt token's logits are needed: the prompt is computed whole, no hit."""
        return self.request.sampling.prompt_logprobs is not None

    @property
    def has_reuse_segments(self) -> bool:
        return any(s.reuse for s in self.request.segments or ())

    @property
    def exact_tokens(self) -> int:
        """Leading tokens whose KV is exact (only these may be committed to the tree)."""
        return self.placements[0].start if self.placements else len(self.token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens left to compute (placed spans ahead are not computed)."""
        done = self.num_computed_tokens
        ahead = sum(p.end - max(p.start, done) for p in self.placements if p.end > done)
        return self.num_uncomputed_tokens - ahead

    def compute_runs(self, num_tokens: int) -> list[tuple[int, int]]:
        """The next ``num_tokens`` tokens to compute, as ``[start, end)`` runs around the
        placed spans (one step computes them all: each run is a batch entry over the table)."""
        runs, pos, left = [], self.num_computed_tokens, num_tokens
        for p in self.placements:
            if p.end <= pos:
                continue
            n = min(left, p.start - pos)
            if n:
                runs.append((pos, pos + n))
                left -= n
            if left == 0:
                return runs
            pos = p.end
        if left:
            runs.append((pos, pos + left))
        return runs

    def skip_placed(self) -> None:
        """Progress past placed spans that start where the computed tokens end."""
        for p in self.placements:
            if p.start == self.num_computed_tokens:
                self.num_computed_tokens = p.end
