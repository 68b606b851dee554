"""What goes into the engine and what comes out: requests, sampling parameters, usage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

GrammarKind = Literal["json", "json_schema", "regex", "choice", "grammar"]


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """What a constrained request's output must be: a JSON object (``json``, no text), JSON
    valid against a schema (``json_schema``: its text in the client's key order, the order its
    properties are generated in), a match of a regular expression (``regex``, Rust's syntax),
    one of several strings (``choice``: a JSON list of them), or a grammar (``grammar``: Lark
    or GBNF, as llguidance reads them). The same text always has the same digest."""

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        if (self.kind != "json") != bool(self.text):
            raise ValueError(f"a {self.kind} grammar needs its text, and only json has none")

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: drop tokens below min_p x the most likely one's probability
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends it before this many
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top k
    # None: off; k >= 0: each prompt token's logprob after the first, and the top k at its
    # position (vLLM's prompt_logprobs; /v1/completions' echo). Every prompt token's logits
    # are needed, so such a request computes its whole prompt (it takes no cache hit).
    prompt_logprobs: int | None = None
    prompt_logprob_ranks: bool = False  # each prompt token's rank too (vLLM reports it)
    # OpenAI's: subtracted once per generated token that already appeared / per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / transformers': logits of tokens in the prompt or output, divided if positive,
    # multiplied if negative.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to those tokens' logits
    grammar: GrammarSpec | None = None  # constrained decoding (engine/step/structured_output.py)
    skip_special_tokens: bool = True  # False: the text keeps e.g. [TOOL_CALLS] for parsers
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string
    # vLLM's: only these tokens may be sampled (logprobs stay the model's)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words, tokenized: a sequence's last token is banned wherever the output so far
    # ends with the rest of it (a one-token word: always)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:  # 0: the most likely token alone (as OpenAI's range)
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token ids >= 0, biases in [-100, 100]: {token}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True, frozen=True)
class SegmentSpan:
    """A tagged segment's token span ``[start, end)`` within the prompt. ``reuse``:
    ``"anywhere"`` lets the engine place this segment's KV, computed on its own, at any
    offset (position-independent reuse, docs/prompt-layout.md); ``""``: prefix caching only."""

    tag: str
    start: int
    end: int
    reuse: str = ""  # "" | "anywhere"


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: str = ""  # cache namespace (tenant + salt), derived by the server
    priority: int = 0  # lower value = more important (vLLM's convention); preempted last
    segments: list[SegmentSpan] | None = None
    tenant: str = ""  # opaque; namespaces with the same tenant are one tenant's salts
    retain: list[RetentionHint] | None = None  # cache_control: keep these prefixes a while


@dataclass(slots=True, frozen=True)
class SegmentMiss:
    """Why a segment's tokens were not served from the cache (engine/memory/miss_reasons.py)."""

    reason: str  # cold | evicted | diverged | partial_block | below_min | namespace | window
    segment: str | None = None  # the segment where the cached prefix stopped (diverged: changed)
    evicted_at: float | None = None  # evicted: unix time of the eviction
    evicted_by: str | None = None  # evicted: "pressure" | "admin" | "ttl"


@dataclass(slots=True, frozen=True)
class RetentionHint:
    """Keep the prompt's first ``end`` tokens cached at least ``ttl_s`` (a TTL pin once they
    are computed; the engine caps the TTL and the blocks each namespace may pin this way)."""

    end: int
    ttl_s: float


@dataclass(slots=True)
class SegmentUsage:
    tag: str
    tokens: int
    cached_tokens: int
    miss: SegmentMiss | None = None  # None: fully cached, or not reported
    # "cached" (an exact prefix hit, every token), "reused_anywhere" (stored chunk KV placed at
    # this offset, ``recomputed_tokens`` computed in place), or "computed"; "": not said
    # (readers then go by the counts)
    served: str = ""
    reused_tokens: int = 0  # placed from the chunk store (approximate KV)
    recomputed_tokens: int = 0  # reused_anywhere: the repair tokens and the chunk's tail


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache (incl. copy-on-write tokens)
    computed_prompt_tokens: int = 0  # prompt tokens whose KV this request computed
    completion_tokens: int = 0
    segments: list[SegmentUsage] | None = None
    # cached_tokens by where they came from: "pool", and "host" or "disk" (the KV tier)
    cached_tokens_by_tier: dict[str, int] | None = None
    reused_tokens: int = 0  # prompt tokens placed from the chunk store (position-independent)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    # prompt logprobs: how many vocabulary entries have a logprob >= this one (1: the best;
    # ties count, as vLLM ranks them); None for sampled tokens
    rank: int | None = None


@dataclass(slots=True, frozen=True)
class RequestTiming:
    """A request's milestones in the engine, in ``time.monotonic()`` seconds."""

    arrival: float  # handed to the engine (after the server rendered and tokenized it)
    first_scheduled: float | None  # admitted to the running batch (None: never)
    first_token: float | None  # its first token was sampled (None: never)
    finished: float

    @property
    def queue_seconds(self) -> float:
        return (self.first_scheduled or self.finished) - self.arrival

    @property
    def prefill_seconds(self) -> float:
        if self.first_scheduled is None:
            return 0.0
        return (self.first_token or self.finished) - self.first_scheduled

    @property
    def decode_seconds(self) -> float:
        return 0.0 if self.first_token is None else self.finished - self.first_token

    @property
    def engine_seconds(self) -> float:
        return self.finished - self.arrival


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's stream. The last one has ``finished`` set and carries usage;
    the first carries the prompt's (cached and computed tokens are known once it is out)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    timing: RequestTiming | None = None  # on the last output
    # with prompt_logprobs, on the first output: one per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # on the last output, vLLM's: the stop string or the stop_token_ids id that ended it (None:
    # an end of sequence, the length, ...)
    stop_reason: int | str | None = None
