"""Streamed chunks as clients time them (vLLM's ``bench serve``, genai-perf): a chat stream's
first chunk (the role) leaves when the first token is out, not before the prompt's
computation; every token has its own chunk (empty text while its character is incomplete);
the finish reason rides on the last token's chunk, not on an extra empty one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest
from sidecar_fake_engine import FakeTokenizer

from prefixcache.engine.request import RequestOutput, Usage
from prefixcache.sidecar.http.streaming import DONE
from prefixcache.sidecar.server.responses import Job, stream_events

# (token id, text delta): "a", then "é" as two tokens whose first completes no character
TOKENS = [(5, "a"), (6, ""), (7, "é")]


def _job(kind: str, stream: AsyncIterator[RequestOutput]) -> Job:
    return Job(
        id="x", kind=kind, model="m", created=0, spans=[], stream=stream,  # type: ignore[arg-type]
        want_logprobs=False, include_usage=False, fingerprint="fp",
    )  # fmt: skip


async def _engine_stream(released: anyio.Event) -> AsyncIterator[RequestOutput]:
    await released.wait()  # the prompt being computed
    for i, (token, text) in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        usage = Usage(prompt_tokens=3, completion_tokens=len(TOKENS)) if last else None
        yield RequestOutput("x", [token], text, last, "length" if last else None, usage)


def _chunks(frames: list[bytes]) -> list[dict]:
    assert frames[-1] == DONE
    return [json.loads(f.decode().removeprefix("data: ")) for f in frames[:-1]]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_nothing_is_sent_before_the_first_token(kind: str) -> None:
    released = anyio.Event()
    frames: list[bytes] = []

    async def consume() -> None:
        async for f in stream_events([_job(kind, _engine_stream(released))], FakeTokenizer()):
            frames.append(f)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.sleep(0.1)
        assert frames == []  # the role chunk too waits for the first token
        released.set()
    chunks = _chunks(frames)
    if kind == "chat":
        role, *chunks = chunks
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    else:
        texts = [c["choices"][0]["text"] for c in chunks]
    # one chunk a token, in order; the finish on the last token's chunk, none after it
    assert texts == [text for _, text in TOKENS]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None, None, "length"]
