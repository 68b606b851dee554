"""Request wire types: OpenAI-compatible request bodies plus the segment extension, and the
cross-field checks (reply_types.py holds what the sidecar sends back).

Requests are decoded straight into these Structs, so a wrong type or an out-of-range value is
rejected by msgspec with the JSON path of the offending field. Every optional OpenAI field
also accepts an explicit ``null`` (= its default). Checks that span several fields (exactly
one of messages/segments, unique tags, unsupported options, ...) live in ``check_*`` functions
below.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from prefixcache.sdk.stability import RANK, Stability

# "developer": OpenAI's newer name for the system role; templates see it as "system".
Role = Literal["system", "developer", "user", "assistant"]
MessageRole = Literal["system", "developer", "user", "assistant", "tool"]
FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
CacheSalt = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+\Z")
]
Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Segments are rendered one prefix at a time (rendering.py): their count bounds that work.
MAX_SEGMENTS = 256
# A file name inside --cache-dir: no separators, no leading dot, so never a path elsewhere.
CacheFileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")]
StopList = Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=16)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Error(ValueError):
    """A request that decoded but makes no sense as a whole; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# --- requests -------------------------------------------------------------------------------


# Anthropic's retention hint: "keep the prompt up to here cached at least this long".
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_CACHE_BREAKPOINTS = 4  # as Anthropic's


class CacheControl(msgspec.Struct):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def ttl_s(self) -> float:
        return CACHE_TTLS[self.ttl]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class FunctionCall(msgspec.Struct):
    name: FunctionName
    arguments: str  # JSON text of an object (OpenAI's form)


class ToolCallItem(msgspec.Struct):
    """An earlier assistant turn's tool call, sent back in the history."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct):
    role: MessageRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: which call this is the result of

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Segment(msgspec.Struct):
    role: Role
    content: str
    tag: Tag
    stability: Stability = "dynamic"
    cache_control: CacheControl | None = None  # keep the prompt up to this segment's end


def order_segments(segments: list[Segment]) -> list[Segment]:
    """static → shared → session → dynamic, stable within a class."""
    return sorted(segments, key=lambda s: RANK[s.stability])


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(msgspec.Struct):
    name: FunctionName


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


def _fill_defaults(obj: msgspec.Struct, defaults: dict[str, Any]) -> None:
    """An explicit ``null`` means the default (OpenAI allows null for optional fields)."""
    for name, value in defaults.items():
        if getattr(obj, name) is None:
            setattr(obj, name, value)


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    # None: the model's generation_config.json value, else OpenAI's default (as vLLM does)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 and 0: off (vLLM's)
    n: PositiveInt | None = 1
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
    logit_bias: dict[str, float] | None = None  # refused unless empty (check_sampling)
    stop_token_ids: (
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=256)] | None
    ) = None  # vLLM's field

    def __post_init__(self) -> None:
        _fill_defaults(self, _SAMPLING_DEFAULTS)
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


_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "stream": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "ignore_eos": False,
    "priority": 0,
}


# OpenAI's defaults, for fields neither the request nor the model's generation config sets.
SAMPLING_FALLBACKS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
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
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # false: tool_choice required forces one call
    response_format: ResponseFormat | None = None
    # OpenAI options this server does not implement: accepted by the decoder so that
    # check_chat can refuse them by name instead of silently ignoring them.
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    prediction: Any = None

    def __post_init__(self) -> None:
        SamplingFields.__post_init__(self)
        _fill_defaults(
            self,
            {"logprobs": False, "add_generation_prompt": True, "continue_final_message": False},
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
    # str, token ids, or a one-element batch of either (msgspec unions allow one list type)
    prompt: (
        str
        | list[Annotated[int, msgspec.Meta(ge=0)] | str | list[Annotated[int, msgspec.Meta(ge=0)]]]
    )
    max_tokens: PositiveInt | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: PositiveInt | None = None

    def __post_init__(self) -> None:
        SamplingFields.__post_init__(self)
        _fill_defaults(self, {"max_tokens": 16, "echo": False})


class CacheRequest(msgspec.Struct, kw_only=True):
    """Body of /v1/cache/warm and /v1/cache/unpin."""

    model: str | None = None
    messages: list[Message] | None = None
    segments: Annotated[list[Segment], msgspec.Meta(max_length=MAX_SEGMENTS)] | None = None
    pin: bool | None = False
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=30 * 86400)] | None = None  # pin's lifetime
    cache_salt: CacheSalt | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as the requests that will reuse it

    def __post_init__(self) -> None:
        _fill_defaults(self, {"pin": False})
        if self.ttl_s is not None and not self.pin:
            raise Error('ttl_s is the lifetime of a pin: it needs "pin": true', "ttl_s")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return self.chat_template_kwargs or {}


class EvictRequest(msgspec.Struct, kw_only=True):
    """Body of /v1/cache/evict (optional)."""

    include_pinned: bool = False  # unpin everything first
    keep_tier: bool = False  # the pool's blocks spill into the KV tier instead of being lost


class CacheFileRequest(msgspec.Struct, kw_only=True):
    """Body of /v1/cache/save and /v1/cache/load: which file in --cache-dir."""

    name: CacheFileName = "pinned"


def check_sampling(req: SamplingFields) -> None:
    if req.logit_bias:
        raise Error("'logit_bias' is not supported by this server", "logit_bias")
    if req.n != 1:
        raise Error("only n=1 is supported", "n")
    if req.stream_options is not None and not req.stream:
        raise Error("stream_options is only allowed with stream=true", "stream_options")


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
    for name in ("audio", "reasoning_effort", "prediction"):
        if getattr(req, name) is not None:
            return name
    return None


def check_chat(req: ChatCompletionRequest) -> None:
    if (field := _unsupported(req)) is not None:
        raise Error(f"'{field}' is not supported by this server", field)
    check_sampling(req)
    if req.segments is not None and req.messages == []:
        req.messages = None  # the openai client requires `messages`: segment users send []
    check_prompt_source(req.messages, req.segments)
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


def check_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise Error("tool function names must be unique", "tools")
    mode = req.tool_mode
    if mode in ("required", "named") and not names:
        raise Error(f"tool_choice {mode!r} needs 'tools'", "tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        raise Error(
            f"tool_choice names {req.tool_choice.function.name!r}, which is not in 'tools'",
            "tool_choice",
        )
    for message in req.messages or ():
        if message.role == "tool" and not message.tool_call_id:
            raise Error("a 'tool' message needs 'tool_call_id'", "messages")
        if message.tool_calls and message.role != "assistant":
            raise Error("only assistant messages may carry 'tool_calls'", "messages")
        for call in message.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise Error(
                    f"tool call {call.id!r}: 'arguments' must be the JSON text of an object",
                    "messages",
                )


def check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None or not isinstance(fmt.json_schema.schema, dict):
        raise Error(
            "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
            "response_format",
        )


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


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completions request: text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt):
        if len(prompt) != 1:
            raise Error("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
        if isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt):
            raise Error("'prompt' must be a string or a list of token ids", "prompt")
    if not prompt:
        raise Error("'prompt' must not be empty", "prompt")
    return prompt  # type: ignore[return-value]


def check_completion(req: CompletionRequest) -> None:
    check_sampling(req)
    completion_prompt(req)
    if req.echo:
        raise Error("echo is not supported", "echo")
    if req.suffix:
        raise Error("suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise Error("only best_of=1 is supported", "best_of")
