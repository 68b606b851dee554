"""Reply wire types: the JSON bodies the engine-mode sidecar sends (OpenAI-compatible
completions, stream chunks, model cards, and the cache admin replies), and the router's own
reply to /reset_prefix_cache."""

from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int
    # OpenAI's newer field: prompt tokens whose KV this request computed and wrote to the cache
    cache_write_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # left out of a stream's running usage (vLLM's continuous_usage_stats): known at the end
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET


class SegmentMiss(msgspec.Struct, omit_defaults=True):
    """Why a segment was not (all) served from the cache; engine/memory/miss_reasons.py."""

    reason: str
    segment: str | None = None
    evicted_at: float | None = None
    evicted_by: str | None = None


class SegmentReport(msgspec.Struct):
    tag: str
    tokens: int
    cached_tokens: int
    miss: SegmentMiss | None = None
    served: str = "computed"  # "cached" | "reused_anywhere" | "computed"
    reused_tokens: int = 0  # reused_anywhere: tokens placed from the chunk store
    recomputed_tokens: int = 0  # reused_anywhere: tokens computed in place (the repair)


class CacheReport(msgspec.Struct):
    cached_tokens: int
    prompt_tokens: int
    computed_tokens: int
    segments: list[SegmentReport]
    # cached_tokens by where the KV was: "pool", "host" or "disk" (copied back from the tier)
    cached_tokens_by_tier: dict[str, int] | msgspec.UnsetType = msgspec.UNSET
    # prompt tokens placed from the chunk store (reuse "anywhere" segments); left out when 0
    reused_tokens: int | msgspec.UnsetType = msgspec.UNSET


class FunctionCallReply(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallReply(msgspec.Struct):
    id: str
    function: FunctionCallReply
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None  # null when the reply is only tool calls (as OpenAI)
    refusal: None = None
    tool_calls: list[ToolCallReply] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: dict | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id matched
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prefixcache: CacheReport
    system_fingerprint: str
    object: str = "chat.completion"
    # vLLM's, where the request asked for them: per prompt token, null for the first
    prompt_logprobs: list[dict | None] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of one tool call in a stream; ``index`` says which (OpenAI's chunk shape)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # the chunk's, with return_token_ids


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id matched
    prompt_logprobs: list[dict | None] | msgspec.UnsetType = msgspec.UNSET  # vLLM's
    # vLLM's return_token_ids: the choice's tokens (a chunk's, streamed), its prompt's (once)
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    prefixcache: CacheReport
    system_fingerprint: str
    object: str = "text_completion"


class StreamChunk(msgspec.Struct):
    """One SSE chunk of either endpoint (``object`` says which). UNSET fields are left out;
    ``usage`` is null on every chunk but the last when include_usage is set (as OpenAI)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list  # ChatChunkChoice or CompletionChoice
    usage: UsageInfo | msgspec.UnsetType | None = msgspec.UNSET
    prefixcache: CacheReport | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # chat's first, if asked


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "prefixcache"
    root: str | None = None  # vLLM's fields: what the model was loaded from, its context
    parent: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None  # the weights' and KV cache's (prefixcache's field)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):  # vLLM's
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(msgspec.Struct):  # vLLM's
    prompt: str


class TokenizerInfo(msgspec.Struct):  # vLLM's /tokenizer_info: the tokenizer's config
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
    pad_token: str | None = None
    tokenizer_class: str = "PreTrainedTokenizerFast"


class WarmResponse(msgspec.Struct):
    tokens: int
    cached_tokens: int
    pinned_blocks: int
    ttl_s: float | None = None  # the pin's lifetime (renewed by hits); None: until unpinned


class UnpinResponse(msgspec.Struct):
    unpinned_blocks: int


class EvictResponse(msgspec.Struct):
    evicted_blocks: int


class ResetPrefixCacheResponse(msgspec.Struct):
    """vLLM's ``{"success": bool}`` (false: running requests held blocks, which stay cached;
    retry once they finish), with what /v1/cache/evict would say and what was kept."""

    success: bool
    evicted_blocks: int
    pinned_blocks: int  # kept, as /v1/cache/evict keeps them
    in_use_blocks: int  # held by running requests at the reset


class UpstreamReset(msgspec.Struct):
    """One upstream's answer to a forwarded /reset_prefix_cache (``prefixcache route``)."""

    url: str
    status: int | None  # None: not reached (down, unreachable, or silent past the timeout)
    success: bool  # a 200 whose body does not say "success": false


class RouterResetResponse(msgspec.Struct):
    """``prefixcache route``'s /reset_prefix_cache: vLLM's ``success`` (every upstream's),
    and each upstream's answer."""

    success: bool
    upstreams: list[UpstreamReset]


class CacheSaveResponse(msgspec.Struct):
    name: str
    prefixes: int
    blocks: int
    bytes: int


class CacheLoadResponse(msgspec.Struct):
    name: str
    prefixes: int
    blocks: int
    restored_blocks: int
    reused_blocks: int
    skipped_blocks: int
    pinned_prefixes: int
