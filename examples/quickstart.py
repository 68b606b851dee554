"""Quickstart: a long shared system prompt, one cold request, then warm ones.

Run against a running sidecar (``prefixcache serve --model smollm2``, a real instruct model;
``make demo`` starts one and runs this):

    python examples/quickstart.py [--base-url URL]    # default: $PREFIXCACHE_BASE_URL, else :8000

Plain OpenAI wire format over httpx: any OpenAI-compatible client works the same way. The
first request computes the system prompt's KV state; the next ones, with other questions,
find it cached and only compute their question, so their time to first token (TTFT) drops.
Each question is printed with its answer, its TTFT and how many prompt tokens were cached.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

QUESTIONS = [
    "When are you open on Sundays?",
    "How much notice do you need for a birthday cake?",
    "How much is a large rye loaf?",
    "Can I pay by cheque?",
    "Do you deliver on Saturdays?",
    "What allergens may your products contain?",
]

SECTIONS = {
    "Opening hours": "Tuesday to Saturday seven to three, Sunday eight to one, closed Mondays.",
    "Breads": "sourdough, rye, spelt, brioche and baguette, baked every morning from four.",
    "Cakes": "to order with two days' notice; birthday, wedding and plain sponge cakes.",
    "Allergens": "every product may contain wheat, milk, eggs, nuts and sesame.",
    "Payment": "cash, debit and credit cards; no cheques.",
    "Delivery": "within three kilometres for orders over twenty euros, Tuesday to Friday.",
    "Returns": "unopened goods within one day with the receipt.",
    "Tone": "friendly, short, no more than two sentences, never invent products.",
}


BREADS = ["sourdough", "rye", "spelt", "brioche", "baguette", "wholemeal", "seeded", "ciabatta"]
PASTRIES = ["croissant", "pain au chocolat", "cinnamon roll", "apple turnover", "eclair"]


def price_list() -> list[str]:
    """A price list with stock notes: varied, deterministic text for the shared prompt."""
    lines = []
    for i, bread in enumerate(BREADS):
        for size, grams in (("small", 400), ("large", 800)):
            price = 2.5 + 0.4 * i + (1.6 if size == "large" else 0.0)
            lines.append(
                f"- {size.capitalize()} {bread} loaf ({grams} g): {price:.2f} euros; baked at "
                f"{4 + i % 3} am, usually sold out by {11 + i % 4} o'clock."
            )
    for i, pastry in enumerate(PASTRIES):
        lines.append(f"- {pastry.capitalize()}: {1.2 + 0.3 * i:.2f} euros, {6 + i} made per tray.")
    return lines


def system_prompt() -> str:
    """About 1,000 tokens of facts that every request shares, byte for byte."""
    lines = [
        "You are the assistant of the Corner Bakery. Answer in one short sentence, using only "
        "the facts below."
    ]
    lines += [f"{title}: {text}" for title, text in SECTIONS.items()]
    lines += ["", "Price list:", *price_list()]
    lines += ["", "Staff notes:"]
    lines += [
        f"- Week {w}: the {BREADS[w % len(BREADS)]} is the bread of the week, at 10% off; "
        f"the {PASTRIES[w % len(PASTRIES)]} is the pastry of the week."
        for w in range(1, 13)
    ]
    return "\n".join(lines)


@dataclass
class Result:
    question: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


def ask(client: httpx.Client, model: str, system: str, question: str, max_tokens: int) -> Result:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict = {}
    with client.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text = choice["delta"].get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(text)
    return Result(
        question,
        ttft if ttft is not None else time.perf_counter() - start,
        usage.get("prompt_tokens", 0),
        usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "".join(parts),
    )


def print_result(i: int, r: Result) -> None:
    label = "cold" if i == 0 else f"warm {i}"
    print(f"\nQ ({label}): {r.question}")
    print(f"A: {r.answer.strip() or '(empty answer)'}")
    print(
        f"   TTFT {r.ttft_s * 1000:.0f} ms, prompt {r.prompt_tokens} tokens, "
        f"{r.cached_tokens} cached",
        flush=True,
    )


def print_table(results: list[Result], hit_rate: float) -> None:
    print(f"\n{'request':<8} {'TTFT ms':>8} {'prompt':>7} {'cached':>7} {'hit':>5}  question")
    for i, r in enumerate(results):
        label = "cold" if i == 0 else f"warm {i}"
        share = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        print(
            f"{label:<8} {r.ttft_s * 1000:>8.1f} {r.prompt_tokens:>7} {r.cached_tokens:>7} "
            f"{share:>5.0%}  {r.question}"
        )
    cold = results[0].ttft_s
    warm = statistics.median(r.ttft_s for r in results[1:])
    print(
        f"\nTTFT cold {cold * 1000:.0f} ms, warm median {warm * 1000:.0f} ms "
        f"({cold / warm:.1f}x faster); engine prefix-cache hit rate {hit_rate:.0%}"
    )


def run(
    base_url: str,
    num_warm: int = 5,
    max_tokens: int = 48,
    fresh: bool = False,
    api_key: str | None = None,
) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=300, headers=headers) as client:
        model = client.get("/models").json()["data"][0]["id"]
        if fresh:  # so that the first request really is cold on a long-lived server
            client.post("/cache/evict", json={})
        # One tiny unrelated request first: the engine's one-time start-up work (first kernel
        # calls, allocations) would otherwise be counted in the cold request's TTFT.
        ask(client, model, "You are brief.", "Hi", 1)
        system = system_prompt()
        questions = (QUESTIONS * (1 + num_warm // len(QUESTIONS)))[: num_warm + 1]
        print(f"model {model!r}; shared system prompt of {len(system)} characters")
        results = []
        for i, question in enumerate(questions):
            results.append(ask(client, model, system, question, max_tokens))
            print_result(i, results[-1])
        stats = client.get("/cache/stats").json()  # needs an admin key if keys are on
    print_table(results, stats["hit_rate"])
    warm_hits = all(r.cached_tokens > 0 for r in results[1:])
    if not warm_hits:
        print("warning: a warm request found nothing cached", file=sys.stderr)
    return 0 if warm_hits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url",
        default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL),
        help=f"$PREFIXCACHE_BASE_URL, else {DEFAULT_BASE_URL} (here: %(default)s)",
    )
    parser.add_argument("--warm", type=int, default=5, help="warm requests after the cold one")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fresh", action="store_true", help="evict the cache first (admin)")
    parser.add_argument("--api-key", default=None, help="an admin key, if the server has keys")
    args = parser.parse_args(argv)
    return run(args.base_url, args.warm, args.max_tokens, args.fresh, args.api_key)


if __name__ == "__main__":
    sys.exit(main())
