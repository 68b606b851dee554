"""Request wire types: OpenAI-compatible request bodies plus the segment extension, and the
cross-field checks (reply_types.py holds what the sidecar sends back).

Requests are decoded straight into these Structs, so a wrong type or an out-of-range value is
rejected by msgspec with the JSON path of the offending field. Every optional OpenAI field
also accepts an explicit ``null`` (= its default). Checks that span several fields (exactly
one of messages/segments, unique tags, unsupported options, ...) live in ``check_*`` functions
below. The parts of a prompt are prompt_parts.py's, tools and response_format are
tool_requests.py's, the cache admin bodies cache_requests.py's (``stable_chat``: a warm body
as the chat request of its stable part); the names the sidecar uses as ``protocol.X`` are
re-exported here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from .cache_requests import CacheFileRequest as CacheFileRequest
from .cache_requests import CacheRequest as CacheRequest
from .cache_requests import CacheSaveRequest as CacheSaveRequest
from .cache_requests import EvictRequest as EvictRequest
from .cache_requests import reset_query as reset_query
from .prompt_parts import (
    MAX_CACHE_BREAKPOINTS,
    MAX_SEGMENTS,
    CacheSalt,
    Error,
    Message,
    Segment,
    fill_defaults,
)
from .prompt_parts import MAX_OPENAI_BREAKPOINTS as MAX_OPENAI_BREAKPOINTS
from .prompt_parts import order_segments as order_segments
from .structured_outputs import structured_output_of as structured_output_of
from .tool_requests import MAX_TOOLS, NamedToolChoice, ResponseFormat, ToolChoice, ToolDef
from .tool_requests import check_response_format as check_response_format

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
StopList = Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=16)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # OpenAI's int64 range
MAX_CHOICES = 128  # n: OpenAI's limit; each choice is an engine request of its own
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI documents 300; vLLM sets no limit)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens)
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    # None: the model's generation_config.json value, else OpenAI's default (as vLLM does)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 and 0: off (vLLM's)
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None  # vLLM's
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None  # vLLM's
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = 1
    stop: Annotated[str, msgspec.Meta(min_length=1)] | StopList | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None  # vLLM's
    ignore_eos: bool | None = False
    user: str | None = None
    cache_salt: CacheSalt | None = None
    # vLLM's field: lower is more important; the engine preempts the least important first.
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] | None = 0
    # OpenAI's: token id (a decimal string) -> bias in [-100, 100], at most MAX_LOGIT_BIAS
    logit_bias: dict[str, float] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=256)] | None
    ) = None  # vLLM's field
    # vLLM's: each prompt token's logprob and rank, and the top k at its position (not streamed)
    prompt_logprobs: int | None = None
    # vLLM's: the prompt's and each choice's token ids in the reply (streamed: as they come)
    return_token_ids: bool | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: a matched stop string kept
    # vLLM's: only these tokens may be generated (an end of sequence too only if listed)
    allowed_token_ids: (
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=65536)] | None
    ) = None
    # vLLM's: words the output must not contain (each word's last token banned after the rest)
    bad_words: (
        Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=128)]
        | None
    ) = None
    # vLLM's: false keeps special tokens in the text (a tool parser that reads them keeps them)
    skip_special_tokens: bool | None = True
    # vLLM's: false (with special tokens kept) drops a decoder's space between two of them;
    # this server's text is the decoder's own, so that pair is refused (alone it does nothing)
    spaces_between_special_tokens: bool | None = True
    # vLLM's: a prompt longer than this is truncated there; here such a prompt is a 400 (never
    # truncated), so the field is honoured wherever it truncates nothing. -1: the context.
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's constrained output (structured_outputs.py reads them into one grammar)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's options that change the output and are not implemented here: decoded so that
    # check_sampling refuses them by name (see UNSERVED_SAMPLING; inert values pass)
    use_beam_search: Any = None
    logprob_token_ids: Any = None
    return_tokens_as_token_ids: Any = None  # refused with logprobs only (it renames theirs)
    watermarking: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    def __post_init__(self) -> None:
        fill_defaults(self, _SAMPLING_DEFAULTS)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk, only with include_usage
        (alone it does nothing, as on vLLM)."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)


_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "stream": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "ignore_eos": False,
    "priority": 0,
    "skip_special_tokens": True,
}


# OpenAI's defaults, for fields neither the request nor the model's generation config sets.
SAMPLING_FALLBACKS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[Message] | None = None
    segments: Annotated[list[Segment], msgspec.Meta(max_length=MAX_SEGMENTS)] | None = None
    # vLLM's chat-template options: what the template sees and how the prompt ends.
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # false: tool_choice required forces one call
    response_format: ResponseFormat | None = None
    # vLLM's: the rendered conversation encoded with the tokenizer's special tokens too (a BOS
    # on top of the template's), as /tokenize encodes it; messages only
    add_special_tokens: bool | None = False
    documents: list[dict[str, str]] | None = None  # vLLM's: the template's `documents` (RAG)
    echo: bool | None = False  # vLLM's: the last message's text before each choice's content
    # vLLM's chat fields this server cannot honour: refused by name (see UNSERVED_CHAT)
    chat_template: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None
    # OpenAI options this server does not implement: accepted by the decoder so that
    # check_chat can refuse them by name instead of silently ignoring them.
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None

    def __post_init__(self) -> None:
        SamplingFields.__post_init__(self)
        fill_defaults(
            self,
            {
                "logprobs": False,
                "add_generation_prompt": True,
                "continue_final_message": False,
                "add_special_tokens": False,
                "echo": False,
            },
        )

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return self.chat_template_kwargs or {}

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required", or "named" (tool_choice names one function)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or ("auto" if self.tools else "none")


class CompletionRequest(SamplingFields, kw_only=True):
    # str, token ids, or a batch of either (msgspec unions allow one list type)
    prompt: (
        str
        | list[Annotated[int, msgspec.Meta(ge=0)] | str | list[Annotated[int, msgspec.Meta(ge=0)]]]
    )
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16  # 0: with echo only
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: PositiveInt | None = None
    add_special_tokens: bool | None = True  # vLLM's: false encodes a text prompt without them
    response_format: ResponseFormat | None = None  # vLLM's: json_object or json_schema here too
    # vLLM's completion fields this server does not honour: refused by name
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        SamplingFields.__post_init__(self)
        fill_defaults(self, {"max_tokens": 16, "echo": False, "add_special_tokens": True})


def logit_bias_of(req: SamplingFields) -> dict[int, float] | None:
    """``logit_bias`` with int keys; Error for a key that is no token id or a bias outside
    [-100, 100] (the vocabulary bound is checked where the tokenizer is known)."""
    if not req.logit_bias:
        return None
    if len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise Error(f"logit_bias has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
    bias: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        if not key.isdecimal() or not -100.0 <= value <= 100.0:
            raise Error(
                "logit_bias maps token ids (decimal strings) to biases in [-100, 100]",
                "logit_bias",
            )
        bias[int(key)] = value
    return bias


# vLLM's request fields whose effect this server does not implement and whose silent
# ignoring would change the tokens or the reply's shape: each a 400 naming it (with why, or
# what to use instead) unless its value asks for nothing (null, false, "", [] or {}).
UNSERVED_SAMPLING = {
    "use_beam_search": "",
    "logprob_token_ids": "use logprobs with top_logprobs",
    "watermarking": "",
    "repetition_detection": "",
    "thinking_token_budget": "",
    "kv_transfer_params": "this server does no disaggregated prefill",
    "ec_transfer_params": "this server does no disaggregated prefill",
}
UNSERVED_CHAT = {
    "chat_template": "a chat template in the request is not accepted (vLLM refuses it too "
    "unless started with --trust-request-chat-template): serve the model with --chat-template",
    "media_io_kwargs": "the model takes text only",
    "mm_processor_kwargs": "the model takes text only",
    "return_prompt_text": "/tokenize and /detokenize give the prompt's ids and text",
}
UNSERVED_COMPLETION = {
    "prompt_embeds": "send the prompt as text or token ids",
}


def _asks_nothing(name: str, value: Any) -> bool:
    if name == "thinking_token_budget" and value == -1:  # vLLM's "unlimited", its default
        return True
    if name == "response_format" and value == {"type": "text"}:
        return True
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def check_unserved(req: msgspec.Struct, table: dict[str, str]) -> None:
    """A 400 for the first field of ``table`` the request sets to a value that asks for
    something (the reply would silently lack it)."""
    for name, why in table.items():
        if not _asks_nothing(name, getattr(req, name)):
            raise Error(
                f"'{name}' is not supported by this server{f': {why}' if why else ''}", name
            )


def check_sampling(req: SamplingFields) -> None:
    logit_bias_of(req)
    check_unserved(req, UNSERVED_SAMPLING)
    structured_output_of(req)  # its shape (one constraint, well formed)
    logprobs = getattr(req, "logprobs", None)  # chat's true, or completions' count (0 too)
    asked = (logprobs is not None and logprobs is not False) or req.prompt_logprobs is not None
    if req.return_tokens_as_token_ids and asked:
        raise Error(
            "'return_tokens_as_token_ids' is not supported by this server: logprobs name "
            "each token by its text (and bytes)",
            "return_tokens_as_token_ids",
        )
    if req.spaces_between_special_tokens is False and req.skip_special_tokens is False:
        raise Error(
            "'spaces_between_special_tokens' false with skip_special_tokens false is not "
            "supported by this server: the text keeps the tokenizer decoder's spacing",
            "spaces_between_special_tokens",
        )
    if req.stream_options is not None and not req.stream:
        raise Error("stream_options is only allowed with stream=true", "stream_options")
    if (k := req.prompt_logprobs) is not None:
        if req.stream and (k > 0 or k == -1):  # vLLM's rule and message
            raise Error(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if not 0 <= k <= 20:  # -1 (the whole vocabulary) too: vLLM's default max_logprobs
            raise Error("prompt_logprobs must be in [0, 20]", "prompt_logprobs")


def check_cache_breakpoints(messages: list[Message] | None, segments: list[Segment] | None) -> None:
    """At most MAX_CACHE_BREAKPOINTS ``cache_control`` marks in one request."""
    marks = sum(1 for s in segments or () if s.cache_control is not None)
    for m in messages or ():
        if isinstance(m.content, list):
            marks += sum(1 for part in m.content if part.cache_control is not None)
    if marks > MAX_CACHE_BREAKPOINTS:
        raise Error(
            f"{marks} cache_control breakpoints; at most {MAX_CACHE_BREAKPOINTS} are allowed",
            "messages" if messages is not None else "segments",
        )


def check_prompt_source(messages: list[Message] | None, segments: list[Segment] | None) -> None:
    """Exactly one of ``messages`` / ``segments``, non-empty, with unique non-empty tags."""
    if (messages is None) == (segments is None):
        raise Error("give exactly one of 'messages' or 'segments'", "messages")
    if messages is not None and not messages:
        raise Error("'messages' must not be empty", "messages")
    if segments is not None:
        if not segments:
            raise Error("'segments' must not be empty", "segments")
        tags = [s.tag for s in segments]
        if len(set(tags)) != len(tags):
            raise Error("segment tags must be unique", "segments")
    check_cache_breakpoints(messages, segments)


def _unsupported(req: ChatCompletionRequest) -> str | None:
    """The first option that would change what the model must do but is not implemented."""
    if req.functions:
        return "functions"
    if req.function_call not in (None, "none"):
        return "function_call"
    if req.modalities not in (None, ["text"]):
        return "modalities"
    for name in ("audio", "prediction", "web_search_options", "moderation"):
        if getattr(req, name) is not None:
            return name
    if req.reasoning_effort not in (None, "none"):  # "none": no reasoning, what is served
        return "reasoning_effort"
    return None


def check_chat(req: ChatCompletionRequest) -> None:
    if (field := _unsupported(req)) is not None:
        raise Error(f"'{field}' is not supported by this server", field)
    check_sampling(req)
    check_unserved(req, UNSERVED_CHAT)
    if req.segments is not None and req.messages == []:
        req.messages = None  # the openai client requires `messages`: segment users send []
    check_prompt_source(req.messages, req.segments)
    for name in ("add_special_tokens", "echo"):  # one rendered text; the last message
        if getattr(req, name) and req.segments is not None:
            raise Error(f"{name} needs 'messages', not segments", name)
    if req.top_logprobs is not None and not req.logprobs:
        raise Error("top_logprobs requires logprobs=true", "top_logprobs")
    check_template_kwargs(req.chat_template_kwargs)
    if req.continue_final_message and req.add_generation_prompt:
        raise Error(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    if req.continue_final_message and req.segments is not None:
        raise Error("continue_final_message needs 'messages', not segments", "segments")
    check_tools(req)
    check_response_format(req.response_format)
    constrained = req.response_format is not None and req.response_format.type != "text"
    if constrained and req.tool_mode in ("required", "named"):
        raise Error(
            "response_format cannot be combined with tool_choice required or a named "
            "function: both constrain the output",
            "response_format",
        )
    vllm = structured_output_of(req)
    if vllm is not None and (constrained or (req.tools and req.tool_mode != "none")):
        other = "response_format" if constrained else "tools (unless tool_choice is 'none')"
        raise Error(f"{vllm[1]} cannot be combined with {other}: both constrain the output", vllm[1])  # fmt: skip


def check_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise Error("tool function names must be unique", "tools")
    for i, tool in enumerate(req.tools or ()):  # arguments are an object (OpenAI refuses else)
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise Error(
                f"a function's parameters must be a JSON Schema of type 'object', not "
                f"{str(kind)[:40]!r}",
                f"tools[{i}].function.parameters",
            )
    mode = req.tool_mode
    if mode in ("required", "named") and not names:
        raise Error(f"tool_choice {mode!r} needs 'tools'", "tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        raise Error(
            f"tool_choice names {req.tool_choice.function.name!r}, which is not in 'tools'",
            "tool_choice",
        )
    check_tool_messages(req.messages)


def check_tool_messages(messages: list[Message] | None) -> None:
    """Tool turns as a template can render them (chat, and the cache routes' warm / unpin):
    each ``tool`` message answers a call of the assistant message before it (only tool
    messages between), as OpenAI requires; an agent's id bug is a 400, not a prompt."""
    calls: set[str] | None = None  # the open assistant turn's call ids, while tools answer it
    for message in messages or ():
        if message.role == "tool" and not message.tool_call_id:
            raise Error("a 'tool' message needs 'tool_call_id'", "messages")
        if message.role == "tool":
            if calls is None:
                raise Error(
                    "a 'tool' message must answer a preceding assistant message's 'tool_calls'",
                    "messages",
                )
            if message.tool_call_id not in calls:
                raise Error(
                    f"tool_call_id {message.tool_call_id!r} answers no call of the assistant "
                    "message before it",
                    "messages",
                )
        elif message.role == "assistant" and message.tool_calls:
            calls = {call.id for call in message.tool_calls}
        else:
            calls = None
        if message.tool_calls and message.role != "assistant":
            raise Error("only assistant messages may carry 'tool_calls'", "messages")
        for call in message.tool_calls or ():
            if arguments_object(call.function.arguments) is None:
                raise Error(
                    f"tool call {call.id!r}: 'arguments' must be the JSON text of an object",
                    "messages",
                )


def arguments_object(text: str) -> dict[str, Any] | None:
    """A tool call's arguments as the object their JSON text holds; None if they hold none
    (or NaN / Infinity, which Python's json reads but JSON has not). Empty text (how some
    clients send back a call without arguments) is the empty object."""
    if not text.strip():
        return {}

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        value = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# Set by the server from the request itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_NAMES & set(kwargs or ()))
    if reserved:
        raise Error(
            f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: "
            "use the request fields",
            "chat_template_kwargs",
        )


def stable_chat(req: CacheRequest) -> ChatCompletionRequest:
    """The chat request whose prompt is a warm / unpin body's stable part, checked as chat
    checks it: the messages, or the segments less the dynamic ones, with the body's prompt
    fields (tools, documents, add_special_tokens, ...) and no generation prompt."""
    check_prompt_source(req.messages, req.segments)  # tags unique over every segment
    if req.add_generation_prompt:
        raise Error(
            "a cached prefix is the stable part of a prompt, which never holds the generation "
            "prompt (the chat requests add theirs after it): leave add_generation_prompt out",
            "add_generation_prompt",
        )
    segments = None
    if req.segments is not None:
        segments = [s for s in req.segments if s.stability != "dynamic"]
        if not segments:
            raise Error("nothing to cache: every segment is dynamic", "segments")
    chat = ChatCompletionRequest(
        model=req.model,
        messages=req.messages,
        segments=segments,
        cache_salt=req.cache_salt,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=req.tools,
        tool_choice=req.tool_choice,
        documents=req.documents,
        add_special_tokens=req.add_special_tokens,
        continue_final_message=req.continue_final_message,
        add_generation_prompt=False,
    )
    check_chat(chat)
    return chat


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request, each text or token ids: one, or a batch (a list
    of strings or of token-id lists, OpenAI's array forms)."""
    prompt = req.prompt
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        prompts: list[str | list[int]] = [prompt]  # type: ignore[list-item]
    elif any(isinstance(t, int) for t in prompt):
        raise Error("'prompt' must be a string, token ids, or a list of either", "prompt")
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    # "" is a prompt where the tokenizer adds a start token (a base model's unconditional
    # sample, as vLLM serves it); the gate refuses it where encoding leaves no token
    if not prompts or any(isinstance(x, list) and not x for x in prompts):
        raise Error("'prompt' must not be empty", "prompt")
    if len(prompts) * (req.n or 1) > MAX_CHOICES:
        raise Error(f"prompts times n must be at most {MAX_CHOICES}", "prompt")
    return prompts


def check_completion(req: CompletionRequest) -> None:
    check_sampling(req)
    check_unserved(req, UNSERVED_COMPLETION)
    completion_prompts(req)
    check_response_format(req.response_format)
    vllm = structured_output_of(req)
    if vllm is not None and req.response_format is not None and req.response_format.type != "text":
        raise Error(f"{vllm[1]} cannot be combined with response_format: both constrain the output", vllm[1])  # fmt: skip
    if req.max_tokens == 0 and not req.echo:
        raise Error(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens"
        )
    if req.suffix:
        raise Error("suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise Error("only best_of=1 is supported", "best_of")
