"""``n`` choices on /v1/chat/completions and /v1/completions, and batches of prompts on
/v1/completions, as OpenAI and vLLM serve them.

Each choice is an engine request of its own over the one rendered prompt (seed + index where
a seed is given), so a choice equals the single request it stands for; the prompt is counted
once in ``usage``. On the real demo server: choices equal their separate requests, the
followers hit the prompt the first one cached, streams interleave by ``index``, and a refused
or abandoned request leaves no block in use.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from conftest import Server, wait_for_idle_blocks
from sidecar_fake_engine import FakeEngine

from prefixcache.sidecar.server.app import create_app
from prefixcache.sidecar.server.settings import SidecarSettings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BLOCK = 16  # the demo engine's block size
PROMPT = "Choices share one prompt: " + "the cached prefix pays its prefill once. " * 6


async def fake_client(max_waiting: int = 64) -> tuple[httpx.AsyncClient, FakeEngine, Any]:
    engine = FakeEngine(max_model_len=512)
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False, max_waiting=max_waiting))
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://sidecar"), engine, app


async def test_each_choice_is_a_request_with_seed_plus_index() -> None:
    client, engine, _ = await fake_client()
    async with client:
        body = {"prompt": "hello", "max_tokens": 3, "n": 3, "seed": 7, "temperature": 0.9}
        r = await client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    ids = [req.request_id for req in engine.received]
    assert len(set(ids)) == 3 and all(i.startswith(out["id"]) for i in ids)
    assert [req.sampling.seed for req in engine.received] == [7, 8, 9]
    prompts = {tuple(req.prompt_token_ids) for req in engine.received}
    assert len(prompts) == 1  # one rendering
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(next(iter(prompts)))  # counted once
    assert usage["completion_tokens"] == 9
    assert usage["total_tokens"] == usage["prompt_tokens"] + 9


async def test_a_seed_at_the_top_of_its_range_wraps() -> None:
    client, engine, _ = await fake_client()
    async with client:
        body = {"prompt": "x", "max_tokens": 1, "n": 2, "seed": 2**63 - 1}
        assert (await client.post(COMPLETIONS, json=body)).status_code == 200
    assert [req.sampling.seed for req in engine.received] == [2**63 - 1, 0]


async def test_more_choices_than_the_queue_holds_is_a_400_and_starts_none() -> None:
    client, engine, _ = await fake_client(max_waiting=4)
    async with client:
        r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"
        ok = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 4})
        assert ok.status_code == 200, ok.text
    assert len(engine.received) == 4  # the refused request reached nothing


async def test_a_queue_too_full_for_every_choice_admits_none() -> None:
    client, engine, app = await fake_client(max_waiting=4)
    app_admission = app.state.sidecar.admission
    app_admission.num_waiting = 2  # two places left: n=3 must take none of them
    async with client:
        r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1, "n": 3})
    assert r.status_code == 429, r.text
    assert app_admission.num_waiting == 2  # the two admitted before the refusal gave theirs back
    assert engine.received == []


def test_choices_equal_their_separate_requests_and_reuse_the_prompt(
    sidecar_server: Server,
) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    prompt = PROMPT + "seeded"
    many = client.completions.create(
        model="demo", prompt=prompt, max_tokens=8, n=3, seed=11, temperature=1.0
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [
        client.completions.create(
            model="demo", prompt=prompt, max_tokens=8, seed=11 + i, temperature=1.0
        )
        for i in range(3)
    ]
    assert [c.text for c in many.choices] == [r.choices[0].text for r in alone]
    assert [c.finish_reason for c in many.choices] == [r.choices[0].finish_reason for r in alone]
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    # greedy choices are the one greedy answer; the later ones reuse the prompt the first
    # computed (a prompt nothing before it shares)
    greedy = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Fresh start. " + PROMPT + "greedy"}],
        max_tokens=6,
        n=4,
        temperature=0,
    )
    assert len({c.message.content for c in greedy.choices}) == 1
    report = greedy.model_extra["prefixcache"]
    first_computed = greedy.usage.prompt_tokens - report["cached_tokens"]  # the first choice's
    assert first_computed > 3 * BLOCK
    assert report["computed_tokens"] <= first_computed + 3 * BLOCK  # all four choices'
    # OpenAI's usage counts the prompt once: cached and written add up to it (the other
    # choices' recomputed last tokens are in the report's computed_tokens, not here)
    details = greedy.usage.prompt_tokens_details
    written = greedy.model_dump()["usage"]["prompt_tokens_details"]["cache_write_tokens"]
    assert details.cached_tokens + written == (greedy.usage.prompt_tokens)
    assert report["computed_tokens"] > written
    wait_for_idle_blocks(sidecar_server.root)


def test_streamed_choices_interleave_by_index_and_match_the_whole_reply(
    sidecar_server: Server,
) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    fields = {"model": "demo", "max_tokens": 10, "n": 3, "seed": 5, "temperature": 1.0}
    messages = [{"role": "user", "content": PROMPT + "stream"}]
    whole = client.chat.completions.create(messages=messages, **fields)
    texts = {0: "", 1: "", 2: ""}
    finishes: dict[int, str] = {}
    roles = set()
    usage = None
    for chunk in client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **fields
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    wait_for_idle_blocks(sidecar_server.root)


def test_a_client_gone_mid_stream_aborts_every_choice(sidecar_server: Server) -> None:
    body = {"prompt": PROMPT + "gone", "max_tokens": 200, "n": 4, "stream": True,
            "ignore_eos": True, "temperature": 1.0}  # fmt: skip
    with httpx.stream("POST", f"{sidecar_server.url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 4:
                break  # leave with every choice still generating
    stats = wait_for_idle_blocks(sidecar_server.root)
    assert stats["blocks"]["in_use"] == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_n_out_of_range_is_refused_by_name(sidecar_server: Server, path: str) -> None:
    body: dict = {"max_tokens": 2, "n": 129}
    body |= {"messages": [{"role": "user", "content": "x"}]} if path == CHAT else {"prompt": "x"}
    r = httpx.post(f"{sidecar_server.root}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"


def test_a_batch_of_prompts_is_each_prompts_choices_in_order(sidecar_server: Server) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    texts = [PROMPT + "first", PROMPT + "second, longer than the first"]
    token_prompt = [1, 20, 30, 40, 50, 60]
    batch = [*texts, token_prompt]
    out = client.completions.create(
        model="demo", prompt=batch, max_tokens=5, n=2, seed=3, temperature=1.0
    )
    assert [c.index for c in out.choices] == list(range(6))
    singles = [
        client.completions.create(
            model="demo", prompt=prompt, max_tokens=5, seed=3 + j, temperature=1.0
        )
        for prompt in batch
        for j in range(2)
    ]
    assert [c.text for c in out.choices] == [r.choices[0].text for r in singles]
    assert out.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in singles[::2])
    assert out.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    wait_for_idle_blocks(sidecar_server.root)


async def test_a_batch_refused_midway_leaves_no_choice_admitted() -> None:
    client, engine, app = await fake_client(max_waiting=8)
    admission = app.state.sidecar.admission
    admission.num_waiting = 4  # four places: the first two prompts' choices fit, not the third
    async with client:
        body = {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2}
        r = await client.post(COMPLETIONS, json=body)
    assert r.status_code == 429, r.text
    assert admission.num_waiting == 4
    assert engine.received == []


def test_echo_puts_the_prompt_before_the_completion(sidecar_server: Server) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    prompt = PROMPT + "echo"
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    echoed = client.completions.create(
        model="demo", prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage.prompt_tokens_details.cached_tokens > 0  # no logprobs: a cache hit
    streamed = ""
    for chunk in client.completions.create(
        model="demo", prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True
    ):
        streamed += chunk.choices[0].text if chunk.choices else ""
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_scores_prompts_as_lm_eval_reads_them(sidecar_server: Server) -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts in a batch, echo,
    logprobs=1, max_tokens=1; a prompt's token_logprobs are read by position. They are the
    same whether or not the prompt was cached before (a scored prompt is computed whole)."""
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    tokenized = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"prompt": PROMPT + "score me"}, timeout=30
    ).json()["tokens"]
    other = [*tokenized[:-3], 7, 8, 9]

    def score() -> openai.types.Completion:
        return client.completions.create(
            model="demo", prompt=[tokenized, other], max_tokens=1, temperature=0, logprobs=1,
            echo=True,
        )  # fmt: skip

    cold = score()
    first, second = cold.choices
    for choice, ids in ((first, tokenized), (second, other)):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        for i in range(1, len(ids) + 1):
            # logprobs=1: the top token, and the token itself where it is another (k + 1)
            top = lp.top_logprobs[i]
            assert lp.tokens[i] in top and top[lp.tokens[i]] == lp.token_logprobs[i]
            assert 1 <= len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
        decoded = httpx.post(
            f"{sidecar_server.root}/detokenize", json={"tokens": ids}, timeout=30
        ).json()["prompt"]
        assert choice.text.startswith(decoded)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    client.completions.create(model="demo", prompt=[tokenized], max_tokens=1)  # cache it
    warm = score()
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # computed whole again
    assert [c.logprobs.token_logprobs for c in warm.choices] == [
        c.logprobs.token_logprobs for c in cold.choices
    ]
    wait_for_idle_blocks(sidecar_server.root)


def test_an_echo_whose_next_token_ends_the_turn_still_lists_it(sidecar_server: Server) -> None:
    """lm-evaluation-harness takes an echo's entries after the context up to the last one as
    the continuation's: the generated token must be last even where it ends the turn (it was
    left out, so the continuation's last token was dropped and scored 0.0, greedy)."""
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    (eot,) = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"prompt": "<|eot_id|>"}, timeout=30
    ).json()["tokens"]
    ids = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"prompt": PROMPT + "the end"}, timeout=30
    ).json()["tokens"]
    done = client.completions.create(
        model="demo", prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True,
        logit_bias={str(eot): 100},
    )  # fmt: skip
    (choice,) = done.choices
    lp = choice.logprobs
    assert choice.finish_reason == "stop" and done.usage.completion_tokens == 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
    assert lp.tokens[-1] == "<|eot_id|>" and lp.text_offset[-1] == len(choice.text)
    # the continuation's scores as lm-eval slices them: [ctxlen:-1] is the prompt's tail
    assert all(x is not None for x in lp.token_logprobs[len(ids) - 2 : -1])
    wait_for_idle_blocks(sidecar_server.root)


def test_choices_say_which_stop_ended_them(sidecar_server: Server) -> None:
    """vLLM's ``stop_reason``: the stop string or stop token id matched, null otherwise; on a
    whole choice and on a stream's finishing chunk, chat and completions."""
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    common = {
        "model": "demo",
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    free = client.completions.create(prompt=PROMPT + "stop", **common).choices[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    assert len(free.text) >= 4
    needle = free.text[1:3]
    cut = client.completions.create(prompt=PROMPT + "stop", stop=[needle], **common).choices[0]
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", needle, free.text[:1])
    chunks = list(
        client.completions.create(prompt=PROMPT + "stop", stop=[needle], stream=True, **common)
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == needle
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(messages=messages, **common).choices[0]
    token = httpx.post(  # the reply's first token (greedy: the same again)
        f"{sidecar_server.root}/tokenize", json={"prompt": chat.message.content}, timeout=30
    ).json()["tokens"][0]
    body = {**common["extra_body"], "stop_token_ids": [token]}
    fields = {k: v for k, v in common.items() if k != "extra_body"}
    stopped = client.chat.completions.create(messages=messages, extra_body=body, **fields)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].stop_reason == token
    wait_for_idle_blocks(sidecar_server.root)


def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_first(sidecar_server: Server) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    fields = {"model": "demo", "prompt": PROMPT + "stream echo", "max_tokens": 3,
              "temperature": 0, "logprobs": 1, "echo": True, "n": 2}  # fmt: skip
    whole = client.completions.create(**fields)
    firsts: dict[int, object] = {}
    texts = {0: "", 1: ""}
    token_logprobs: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                token_logprobs[choice.index] += choice.logprobs.token_logprobs
    for i in (0, 1):
        assert firsts[i].text == fields["prompt"]  # the prompt alone, first
        assert firsts[i].logprobs.token_logprobs[0] is None
        assert texts[i] == whole.choices[i].text
        assert token_logprobs[i] == whole.choices[i].logprobs.token_logprobs


def test_each_choice_makes_its_own_forced_tool_call(tools_sidecar: Server) -> None:
    pytest.importorskip("llguidance")
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"enum": ["eviction", "pinning", "blocks"]}},
                "required": ["key"],
            },
        },
    }
    client = openai.OpenAI(base_url=tools_sidecar.url, api_key="x")
    fields = {
        "model": "demo", "messages": [{"role": "user", "content": "Look it up."}],
        "tools": [lookup], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 64, "n": 2, "temperature": 1.0, "seed": 4,
    }  # fmt: skip
    whole = client.chat.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup"
        assert json.loads(call.function.arguments)["key"] in ("eviction", "pinning", "blocks")
        assert choice.finish_reason == "tool_calls"
    arguments: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                arguments[choice.index] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [
        json.loads(c.message.tool_calls[0].function.arguments) for c in whole.choices
    ]


def test_echo_without_generation_returns_the_prompt_alone(sidecar_server: Server) -> None:
    """vLLM's echo with max_tokens 0 (older scoring harnesses send it): the prompt and its
    logprobs, no completion token shown or counted; without echo max_tokens 0 is a 400."""
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    fields = {"model": "demo", "prompt": PROMPT + "alone", "max_tokens": 0, "echo": True,
              "logprobs": 1, "temperature": 0}  # fmt: skip
    whole = client.completions.create(**fields)
    (choice,) = whole.choices
    assert choice.text == fields["prompt"] and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == whole.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert whole.usage.completion_tokens == 0
    with_one = client.completions.create(**{**fields, "max_tokens": 1})
    prompt_part = with_one.choices[0].logprobs.token_logprobs[: whole.usage.prompt_tokens]
    assert choice.logprobs.token_logprobs == prompt_part
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **fields)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fields["prompt"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    r = httpx.post(
        f"{sidecar_server.url}/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    wait_for_idle_blocks(sidecar_server.root)


def test_logprobs_name_the_end_of_turn(sidecar_server: Server) -> None:
    """An end-of-turn token ends the reply but is not in its text. Chat and completions list
    it last by name (vLLM's, OpenAI's completions' end of text), one entry per completion
    token, so the entries align with the token ids (what RL frameworks pair them with); the
    other entries' bytes join into the text exactly."""
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    (eot,) = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"prompt": "<|eot_id|>"}, timeout=30
    ).json()["tokens"]
    # sampled (seeded) with the end of turn favoured: with this seed it comes after some text,
    # within 16 (a seed's draws are the sampler's: the bias went 4 -> 8 when its draw changed)
    common = {"model": "demo", "max_tokens": 16, "temperature": 1, "seed": 0}
    common["logit_bias"] = {str(eot): 8}
    chat = dict(common, messages=[{"role": "user", "content": PROMPT}], logprobs=True)
    for stream in (False, True):
        if stream:
            chunks = [c for c in client.chat.completions.create(**chat, stream=True) if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            entries = [
                e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**chat).choices[0]
            text, entries = choice.message.content or "", choice.logprobs.content
            finish = choice.finish_reason
        assert finish == "stop" and text
        assert entries[-1].token == "<|eot_id|>"
        assert b"".join(bytes(e.bytes) for e in entries[:-1]).decode() == text
    done = client.completions.create(**common, prompt=PROMPT, logprobs=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and choice.text
    assert choice.logprobs.tokens[-1] == "<|eot_id|>"
    assert "".join(choice.logprobs.tokens[:-1]) == choice.text
    assert len(choice.logprobs.tokens) == done.usage.completion_tokens
    assert len(choice.logprobs.top_logprobs) == len(choice.logprobs.tokens)
    assert choice.logprobs.text_offset[-1] == len(choice.text)
    streamed = list(client.completions.create(**common, prompt=PROMPT, logprobs=0, stream=True))
    lp = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for part in lp for t in part.tokens] == choice.logprobs.tokens
    assert [o for part in lp for o in part.text_offset] == choice.logprobs.text_offset
    for token, lp, top in zip(
        choice.logprobs.tokens,
        choice.logprobs.token_logprobs,
        choice.logprobs.top_logprobs,
        strict=True,
    ):
        assert top == {token: lp}  # logprobs=0: the sampled token's own, as OpenAI's
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, at in zip(choice.logprobs.tokens[:-1], offsets[:-1], strict=True):
        if "\ufffd" not in token:  # where a whole token starts, its text is
            assert choice.text[at : at + len(token)] == token
