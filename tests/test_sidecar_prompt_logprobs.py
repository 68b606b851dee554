"""vLLM's ``prompt_logprobs`` request field on /v1/completions and /v1/chat/completions: per
prompt token (null for the first), a map from token id to ``{logprob, rank, decoded_token}``
holding the prompt token with its rank and the top k at that position; on each completions
choice, at the top of a chat reply. Refused with ``stream`` (vLLM's rule and message) and
outside [0, 20]; absent from replies that did not ask. On the real demo server."""

from __future__ import annotations

import itertools
import re

import httpx
import openai
import pytest
from conftest import Server, wait_for_idle_blocks

PROMPT = "Prompt logprobs score every token of this prompt, as vLLM reports them."


def tokens_of(server: Server, text: str) -> list[int]:
    reply = httpx.post(f"{server.root}/tokenize", json={"prompt": text}, timeout=30)
    return reply.json()["tokens"]


def check_positions(positions: list, prompt_ids: list[int], k: int) -> None:
    """Each position's map holds its prompt token and the top k, ranked consistently."""
    assert positions[0] is None and len(positions) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], positions[1:], strict=True):
        mine = position[str(token_id)]
        assert mine["rank"] >= 1 and mine["logprob"] <= 0 and isinstance(mine["decoded_token"], str)
        best = sorted(
            ((v["rank"], int(t), v["logprob"]) for t, v in position.items() if t != str(token_id)),
        )
        tops = [r for r in best if r[0] <= k]
        assert len(position) - 1 == len(tops) <= k  # the prompt token, and the top k (less itself)
        if mine["rank"] > k:  # outside the top k: every top entry is at least as likely
            assert len(tops) == k and all(lp >= mine["logprob"] - 1e-6 for _, _, lp in tops)
        if mine["rank"] == 1:
            assert all(lp <= mine["logprob"] + 1e-6 for _, _, lp in tops)
        ranks = [r for r, _, _ in tops]  # distinct, within 1..k, in logprob order
        assert len(set(ranks)) == len(ranks) and all(1 <= r <= k for r in ranks)
        assert all(a[2] >= b[2] - 1e-6 for a, b in itertools.pairwise(tops))


def test_completions_choices_carry_vllm_prompt_logprobs(sidecar_server: Server) -> None:
    client = openai.OpenAI(base_url=sidecar_server.url, api_key="x")
    ids = tokens_of(sidecar_server, PROMPT)
    reply = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    for choice in reply.choices:
        check_positions(choice.model_extra["prompt_logprobs"], ids, 2)
    # the prompt tokens' logprobs are echo's (one computation, two shapes)
    echo = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0, echo=True
    ).choices[0]
    ours = reply.choices[0].model_extra["prompt_logprobs"]
    got = [ours[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert got == echo.logprobs.token_logprobs[1 : len(ids)]
    wait_for_idle_blocks(sidecar_server.root)


def test_zero_gives_the_prompt_token_alone_and_chat_puts_them_on_top(
    sidecar_server: Server,
) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}
    positions = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=60).json()[
        "choices"
    ][0]["prompt_logprobs"]
    ids = tokens_of(sidecar_server, PROMPT)
    check_positions(positions, ids, 0)
    assert all(len(p) == 1 for p in positions[1:])

    messages = [{"role": "user", "content": PROMPT}]
    chat = {"model": "demo", "messages": messages, "max_tokens": 1, "prompt_logprobs": 1}
    reply = httpx.post(f"{sidecar_server.url}/chat/completions", json=chat, timeout=60).json()
    rendered = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"messages": messages}, timeout=30
    ).json()["tokens"]
    check_positions(reply["prompt_logprobs"], rendered, 1)
    assert "prompt_logprobs" not in reply["choices"][0]
    assert reply["usage"]["prompt_tokens"] == len(rendered)


def test_replies_that_did_not_ask_have_no_such_field(sidecar_server: Server) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1}
    reply = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=60).json()
    assert "prompt_logprobs" not in reply["choices"][0] and "prompt_logprobs" not in reply


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stream": True, "prompt_logprobs": 1}, "not available when `stream=True`"),
        ({"stream": True, "prompt_logprobs": -1}, "not available when `stream=True`"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": -2}, r"prompt_logprobs must be in \[0, 20\]"),
    ],
)
def test_refused_with_vllms_rules(
    sidecar_server: Server, path: str, extra: dict, message: str
) -> None:
    body = {"model": "demo", "max_tokens": 1, **extra}
    if path == "/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    reply = httpx.post(f"{sidecar_server.url}{path}", json=body, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt_logprobs"
    assert re.search(message, error["message"])


def test_streamed_with_zero_streams_without_them(sidecar_server: Server) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{sidecar_server.url}/completions", json={**body, "prompt_logprobs": 0}, timeout=60
    ) as reply:
        assert reply.status_code == 200
        text = "".join(reply.iter_text())
    assert "[DONE]" in text and "prompt_logprobs" not in text
