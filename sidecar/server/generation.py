"""The generation routes, /v1/chat/completions and /v1/completions: a checked request becomes
an ``EngineRequest`` (context length, sampling values, namespace), is admitted, and replied to."""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from prefixcache.engine.api import EngineAPI, TokenizerAPI
from prefixcache.engine.grammar import GrammarCache, compiled_grammar
from prefixcache.engine.request import EngineRequest, GrammarSpec, RetentionHint, SamplingParams

from ..chat.rendering import PromptRenderer, RenderedPrompt
from ..chat.tool_prompt import ToolTemplate, canonical_tools, format_grammar, grammar_for
from ..http.errors import bad_request
from ..http.streaming import SSEResponse
from ..http.tenancy import Tenant
from ..wire import protocol as p
from .admission import Admission
from .gate import RequestGate, content_size
from .responses import Job, reply
from .settings import SidecarSettings

# (renderer, the rendered prompt, template kwargs) -> the prompt's retention hints
Retention = Callable[[PromptRenderer, RenderedPrompt, dict[str, Any]], list[RetentionHint]]


class GenerationRoutes:
    def __init__(
        self,
        engine: EngineAPI,
        gate: RequestGate,
        admission: Admission,
        settings: SidecarSettings,
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.admission = admission
        self.use_generation_config = settings.use_generation_config
        self._fingerprint: str | None = None
        self._sampling_defaults: dict[str, float] | None = None
        self.tool_call_parser = settings.tool_call_parser
        self._tool_template: ToolTemplate | None = None
        self.grammars = GrammarCache()  # by cache namespace: no tenant times another's

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        tenant, req = await self.gate.generation_request(
            request, p.ChatCompletionRequest, p.check_chat
        )
        jobs = await self.chat_jobs(tenant, req, f"chatcmpl-{uuid.uuid4().hex}")
        return await reply(jobs, req.stream, request, self.engine.tokenizer)

    async def chat_job(
        self,
        tenant: Tenant,
        req: p.ChatCompletionRequest,
        request_id: str,
        retention: Retention | None = None,
    ) -> Job:
        """A checked chat request of one choice rendered, admitted and started: what
        /v1/messages and /v1/responses reply from. ``retention`` replaces the retention hints
        of the ``cache_control`` marks on text parts (it runs where the prompt renders)."""
        (job,) = await self.chat_jobs(tenant, req, request_id, retention, choices=1)
        return job

    async def chat_jobs(
        self,
        tenant: Tenant,
        req: p.ChatCompletionRequest,
        request_id: str,
        retention: Retention | None = None,
        choices: int | None = None,
    ) -> list[Job]:
        """The request's ``n`` choices (or ``choices``), one job each over the one rendering."""
        namespace = self.gate.namespace(tenant.name, req.cache_salt)
        generic = not self.tool_template.supports_tools
        grammar = await checked_grammar(req, self.grammars, namespace, generic)  # before rendering
        prompt = await self.render_chat(req, namespace, retention)
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        parser = self.tool_template.parser(req)
        jobs = self._submit(
            "chat",
            request_id,
            req,
            tenant,
            prompt,
            max_tokens,
            top,
            grammar=grammar,
            # a parser that reads special tokens keeps them in the text whatever was asked
            skip_special_tokens=bool(req.skip_special_tokens)
            and (parser is None or not parser.needs_special_tokens),
            choices=choices,
        )
        echo = echoed_message(req)
        for job in jobs:
            job.tool_parser = parser
            job.retain = prompt.retain
            job.message_echo = echo
        return jobs

    async def render_chat(
        self, req: p.ChatCompletionRequest, namespace: str, retention: Retention | None = None
    ) -> RenderedPrompt:
        """``req``'s prompt as /v1/chat/completions renders it (also for counting and
        tokenizing, whose callers forget it); ``retention`` replaces the retention hints of
        the ``cache_control`` marks on text parts (it runs where the prompt renders)."""
        template_kwargs = self.chat_template_kwargs(req)
        generic_tools = self.tool_template.generic_tools(req)

        def render(renderer: PromptRenderer) -> RenderedPrompt:
            out = renderer.render_chat(
                req.messages,
                req.segments,
                bool(req.add_generation_prompt),
                template_kwargs,
                bool(req.continue_final_message),
                namespace,
                generic_tools,
            )
            if retention is not None:
                out.retain = retention(renderer, out, template_kwargs)
            if req.add_special_tokens:  # vLLM's: the tokenizer's special tokens on top
                out = renderer.with_special_tokens(out)
            return out

        return await self.gate.render(render, content_size(req.messages, req.segments))

    def chat_template_kwargs(self, req: p.ChatCompletionRequest) -> dict[str, Any]:
        """What the chat template sees besides the messages: the request's kwargs, vLLM's
        ``documents``, and tools."""
        template_kwargs = req.template_kwargs
        if req.documents is not None:
            template_kwargs = {**template_kwargs, "documents": req.documents}
        if req.tools:
            if not self.tool_template.supports_tools:  # written into the messages instead
                if req.continue_final_message and req.tool_mode != "none":
                    raise bad_request(
                        "continue_final_message cannot be used with tools here: the chat "
                        f"template of {self.engine.model_name!r} does not render tools, so they "
                        "are sent in a JSON format the reply must start; serve the model with "
                        "--chat-template set to a template that renders tools",
                        "continue_final_message",
                    )
                return template_kwargs
            template_kwargs = {**template_kwargs, "tools": canonical_tools(req.tools)}
        return template_kwargs

    @property
    def tool_template(self) -> ToolTemplate:
        if self._tool_template is None:  # the tokenizer exists once the engine is ready
            self._tool_template = ToolTemplate(self.engine.tokenizer, self.tool_call_parser)
        return self._tool_template

    async def completions(self, request: Request) -> Response | SSEResponse:
        gate = self.gate
        tenant, req = await gate.generation_request(
            request, p.CompletionRequest, p.check_completion
        )
        namespace = gate.namespace(tenant.name, req.cache_salt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        n = req.n or 1
        prompts = p.completion_prompts(req)
        self._check_choices(len(prompts) * n)
        grammar = None  # vLLM's structured_outputs, or a response_format (vLLM takes it here)
        if (vllm := p.structured_output_of(req)) is not None:
            grammar = await compiled_or_400(vllm[0], self.grammars, namespace, vllm[1])
        elif (formatted := format_grammar(req.response_format)) is not None:
            grammar = await compiled_or_400(formatted, self.grammars, namespace, "response_format")
        rendered: list[RenderedPrompt] = []
        jobs: list[Job] = []
        try:
            special = bool(req.add_special_tokens)  # vLLM's, for a text prompt
            for prompt in prompts:
                rendered.append(await gate.completion_prompt(prompt, namespace, special))
            # max_tokens 0 with echo (vLLM's echo without generation): the prompt alone, from
            # a request of one token whose token is not shown
            max_tokens = req.max_tokens or (None if req.max_tokens is None else 1)
            for i, prompt in enumerate(rendered):  # choice i * n + j: prompt i's choice j
                jobs += self._submit(
                    "completion", request_id, req, tenant, prompt, max_tokens, req.logprobs,
                    grammar=grammar, first_index=i * n, batch=len(rendered) > 1,
                    echo=echo_text(prompt, prompts[i], self.engine.tokenizer) if req.echo else None,
                    skip_special_tokens=bool(req.skip_special_tokens),
                )  # fmt: skip
            for job in jobs:
                job.prompt_only = req.max_tokens == 0
        except Exception:
            for job in jobs:  # an earlier prompt's choices: admitted, not started
                job.stream.discard()
            for prompt in rendered:
                gate.forget(prompt)
            raise
        return await reply(jobs, req.stream, request, self.engine.tokenizer)

    def _check_choices(self, choices: int) -> None:
        """More engine requests than the queue holds could never be admitted: a 400, not 429."""
        if choices > 1 and choices > self.admission.max_waiting:
            raise bad_request(
                f"{choices} choices exceed this server's queue of {self.admission.max_waiting} "
                "waiting requests (--queue-limit)",
                "n",
            )

    @property
    def system_fingerprint(self) -> str:
        """``fp_`` + 10 hex digits of the model, tokenizer, dtype and head kernel (stable)."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.engine.output_identity).hexdigest()
            self._fingerprint = "fp_" + digest[:10]
        return self._fingerprint

    def _submit(
        self,
        kind: str,
        request_id: str,
        req: p.SamplingFields,
        tenant: Tenant,
        prompt: RenderedPrompt,
        max_tokens: int | None,
        logprobs: int | None,
        grammar: GrammarSpec | None = None,
        skip_special_tokens: bool = True,
        choices: int | None = None,
        first_index: int = 0,
        batch: bool = False,
        echo: str | None = None,
    ) -> list[Job]:
        """The admitted jobs, one per choice (``req.n`` unless ``choices``), numbered from
        ``first_index`` (a batch's later prompts); a refused request leaves nothing of its
        prompt in the memos and no choice running."""
        jobs: list[Job] = []
        asked = None if req.stream else req.prompt_logprobs
        try:
            num_prompt = len(prompt.token_ids)
            context = self.engine.max_model_len
            if (k := req.truncate_prompt_tokens) is not None and num_prompt > (
                context if k == -1 else k
            ):  # vLLM would cut the prompt: this server never does (it is the cache key)
                raise bad_request(
                    f"truncate_prompt_tokens={k}: the prompt is {num_prompt} tokens, and this "
                    "server does not truncate prompts; send a shorter prompt",
                    "truncate_prompt_tokens",
                )
            # OpenAI's and vLLM's first sentence: clients (LiteLLM's context-window fallbacks)
            # recognise the error by it
            where = "messages" if kind == "chat" else "prompt"
            if num_prompt >= context:
                raise bad_request(
                    f"This model's maximum context length is {context} tokens. However, your "
                    f"{where} resulted in {num_prompt} tokens, and at least one must be left to "
                    f"generate. Please reduce the length of the {where}.",
                    where,
                    "context_length_exceeded",
                )
            if max_tokens is None:
                max_tokens = context - num_prompt
            elif num_prompt + max_tokens > context:
                raise bad_request(
                    f"This model's maximum context length is {context} tokens. However, you "
                    f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {where}, "
                    f"{max_tokens} in the completion). Please reduce the length of the {where} "
                    f"or completion (max_tokens={max_tokens}; at most {context - num_prompt}).",
                    "max_tokens",
                    "context_length_exceeded",
                )
            try:
                sampling = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=self.sampling_value(req.temperature, "temperature"),
                    top_k=int(self.sampling_value(req.top_k, "top_k")),
                    top_p=self.sampling_value(req.top_p, "top_p"),
                    min_p=self.sampling_value(req.min_p, "min_p"),
                    min_tokens=req.min_tokens or 0,
                    seed=None if req.seed is None else req.seed % 2**63,  # -1: 2**63 - 1
                    stop=req.stop_list,
                    stop_token_ids=self.gate.stop_token_ids(req.stop_token_ids),
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                    # echo with logprobs, vLLM's prompt_logprobs: the prompt's own, each choice
                    # computing its prompt (none when streamed: vLLM sends none then)
                    prompt_logprobs=_most(logprobs if echo is not None else None, asked),
                    prompt_logprob_ranks=asked is not None,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    repetition_penalty=self.sampling_value(
                        req.repetition_penalty, "repetition_penalty"
                    ),
                    logit_bias=self.gate.logit_bias(p.logit_bias_of(req)),
                    grammar=grammar,
                    skip_special_tokens=skip_special_tokens,
                    include_stop_str_in_output=bool(req.include_stop_str_in_output),
                    allowed_token_ids=_allowed(
                        self.gate.token_ids(req.allowed_token_ids, "allowed_token_ids")
                    ),
                    bad_words_token_ids=self._bad_words(req.bad_words, prompt.namespace),
                )
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            n = choices or req.n or 1
            self._check_choices(n)
            created = int(time.time())
            for index in range(first_index, first_index + n):
                engine_request = EngineRequest(
                    request_id=request_id if n == 1 and not batch else f"{request_id}-{index}",
                    prompt_token_ids=prompt.token_ids,
                    sampling=choice_sampling(sampling, index - first_index),
                    namespace=prompt.namespace,
                    priority=req.priority,
                    segments=prompt.spans or None,
                    tenant=self.gate.namespace(tenant.name, None),  # opaque: a tenant's salts
                    # cache_control marks: TTL pins once computed (the first choice's)
                    retain=(prompt.retain or None) if index == first_index else None,
                )
                job = Job(
                    id=request_id,
                    kind=kind,
                    # the name the request used (an alias too), as vLLM answers
                    model=req.model or self.gate.model_names[0],
                    created=created,
                    spans=prompt.spans,
                    stream=self.admission.admit(engine_request),  # 429 when the queue is full
                    want_logprobs=logprobs is not None,
                    include_usage=req.include_usage,
                    fingerprint=self.system_fingerprint,
                    continuous_usage=bool(req.stream) and req.continuous_usage,
                    prompt_tokens=len(prompt.token_ids),
                    index=index,
                    choices=n,
                    echo=echo,
                    prompt_logprobs=asked,
                    return_token_ids=bool(req.return_token_ids),
                )
                jobs.append(job)
            return jobs
        except Exception:
            for job in jobs:  # admitted but not started: their queue places back
                job.stream.discard()
            self.gate.forget(prompt)
            raise

    def _bad_words(self, words: list[str] | None, namespace: str) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as written and after a space (how it
        reads mid-sentence), stripped of leading spaces first, as vLLM tokenizes them."""
        encode = self.engine.tokenizer.encode
        sequences: dict[tuple[int, ...], None] = {}
        for word in words or ():
            word = word.lstrip()
            for text in (word, " " + word) if word else ():
                ids = tuple(encode(text, add_special_tokens=False, namespace=namespace))
                if ids:
                    sequences[ids] = None
        return tuple(sequences)

    def sampling_value(self, value: float | None, name: str) -> float:
        """A request's value, else the model's generation_config.json one, else OpenAI's."""
        if value is not None:
            return value
        if self._sampling_defaults is None:  # the engine is ready by now: resolve once
            model = self.engine.sampling_defaults if self.use_generation_config else {}
            self._sampling_defaults = {**p.SAMPLING_FALLBACKS, **model}
        return self._sampling_defaults[name]


def _most(*ks: int | None) -> int | None:
    """The largest of the top-k counts asked for (None if none is)."""
    given = [k for k in ks if k is not None]
    return max(given) if given else None


def _allowed(ids: list[int] | None) -> tuple[int, ...] | None:
    """vLLM's allowed_token_ids, sorted and once each; [] (as null) restricts nothing."""
    return tuple(sorted(set(ids))) if ids else None


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: a given seed becomes ``seed + index`` (vLLM's convention),
    so each choice of a seeded request is reproducible on its own."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)


def echoed_message(req: p.ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text, put before each choice's content where
    that message has the reply's role (vLLM's: the assistant's after a generation prompt,
    else the last message's own), e.g. a prefilled assistant turn being continued."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    return last.text


def echo_text(prompt: RenderedPrompt, given: str | list[int], tokenizer: TokenizerAPI) -> str:
    """What ``echo`` puts before a completion: the prompt as given, or token ids decoded (their
    special tokens kept), as vLLM echoes them."""
    if isinstance(given, str):
        return given
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


# One compile at a time off the event loop: a big schema takes up to a second of llguidance
# (which lets go of the GIL), and a flood of them must not take every worker thread.
_COMPILES = anyio.CapacityLimiter(1)


async def checked_grammar(
    req: p.ChatCompletionRequest, cache: GrammarCache, namespace: str, generic: bool = False
) -> GrammarSpec | None:
    """``req``'s grammar (``generic``: for a template that does not render tools), compiled
    once here (on a worker thread, cached per namespace) so that a schema llguidance refuses
    is a 400 naming the field, not an error inside a stream that has begun."""
    try:
        grammar = grammar_for(req, generic)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None
    if grammar is None:
        return None
    vllm = p.structured_output_of(req)
    if vllm is not None:
        param = vllm[1]
    elif req.response_format is not None and req.response_format.type != "text":
        param = "response_format"
    else:
        named = req.tool_choice.function.name if req.tool_mode == "named" else None  # type: ignore[union-attr]
        where = [i for i, t in enumerate(req.tools or ()) if t.function.name == named]
        param = f"tools[{where[0]}].function.parameters" if where else "tools"
    return await compiled_or_400(grammar, cache, namespace, param)


async def compiled_or_400(
    grammar: GrammarSpec, cache: GrammarCache, namespace: str, param: str
) -> GrammarSpec:
    """``grammar`` once compiled (cached per namespace, off the event loop), or a 400 naming
    ``param`` with llguidance's reason."""
    try:
        if cache.lookup(grammar, namespace) is None:
            await anyio.to_thread.run_sync(
                cache.get_or_compile, grammar, compiled_grammar, namespace, limiter=_COMPILES
            )
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
    return grammar
