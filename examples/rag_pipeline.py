"""Many questions over the same documents: the documents' prefill is paid once.

A document collection becomes shared segments, ordered by tag so that retrieval order never
changes the bytes; each question is a dynamic segment at the end. Prints time to first token
(TTFT) cold vs warm and the prompt-token hit rate.

    prefixcache serve --model demo            # in another terminal
    python examples/rag_pipeline.py [--base-url URL] [--questions 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import anyio

from prefixcache.sdk import AsyncClient, PermissionDeniedError, Prompt

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

PRODUCTS = ["Aurora lamp", "Breeze fan", "Cinder stove", "Delta kettle", "Ember heater"]
QUESTIONS = [
    "How long is the warranty on the Breeze fan?",
    "Can the Cinder stove be used outdoors?",
    "What is the power draw of the Ember heater?",
    "Which products ship with a remote control?",
    "How do I descale the Delta kettle?",
    "Is the Aurora lamp dimmable?",
    "Which product is the quietest?",
    "What does the returns policy say about opened boxes?",
]


def documents() -> dict[str, str]:
    """A small product knowledge base, keyed by a stable document id."""
    docs = {}
    for i, name in enumerate(PRODUCTS):
        docs[f"doc:{name.split()[0].lower()}"] = (
            f"{name}. Model line {i + 1}. Warranty {2 + i % 3} years. Power draw {40 + 15 * i} W. "
            f"Noise {28 + 3 * i} dB. Remote control: {'yes' if i % 2 else 'no'}. "
            f"Care: wipe with a dry cloth; descale monthly where water is used. "
            f"Safety: indoor use only unless the manual says otherwise. " * 2
        ).strip()
    docs["doc:returns"] = (
        "Returns policy. Unopened items may be returned within 30 days for a full refund. "
        "Opened boxes are accepted within 14 days if all parts are present; a 10% restocking "
        "fee applies. Refunds go to the original payment method within 5 business days."
    )
    return docs


def build_prompt(docs: dict[str, str], question: str) -> Prompt:
    b = Prompt.builder().static(
        "You are a product support assistant. Answer only from the documents below, in one "
        "or two sentences, and name the document you used.",
        tag="instructions",
    )
    # the retriever returns documents in score order; order_shared_by_tag() makes the bytes
    # independent of it
    for tag in reversed(sorted(docs)):
        b.shared(docs[tag], tag=tag)
    return b.order_shared_by_tag().dynamic(question, tag="question").build()


async def run(args: argparse.Namespace) -> None:
    docs = documents()
    questions = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: args.questions]
    async with AsyncClient(args.base_url, model=args.model) as client:
        first = build_prompt(docs, questions[0])
        findings = first.lint()
        print(f"lint: {len(findings)} finding(s)")
        for f in findings:
            print("  ", f)
        if not args.keep_cache:
            try:
                print(f"evicted {await client.evict()} cached blocks for a cold start")
            except PermissionDeniedError:
                print("(cannot evict without an admin key; the first request may be warm)")

        ttfts: list[float] = []
        prompt_tokens = cached_tokens = 0
        for i, question in enumerate(questions):
            prompt = build_prompt(docs, question)
            stream = client.stream(prompt, max_tokens=args.max_tokens, temperature=0.0)
            async for _ in stream:
                pass
            assert stream.ttft is not None and stream.usage is not None
            ttfts.append(stream.ttft)
            prompt_tokens += stream.usage.prompt_tokens or 0
            cached_tokens += stream.usage.cached_tokens
            print(
                f"q{i + 1:<2} ttft {stream.ttft * 1000:7.1f} ms"
                f"  prompt {stream.usage.prompt_tokens:5d}"
                f"  cached {stream.usage.cached_tokens:5d}  {question}"
            )
        cold, warm = ttfts[0], statistics.median(ttfts[1:]) if len(ttfts) > 1 else float("nan")
        print(f"\nTTFT cold {cold * 1000:.1f} ms, warm (median) {warm * 1000:.1f} ms", end="")
        print(f", {cold / warm:.1f}x faster" if warm > 0 else "")
        print(f"prompt-token hit rate {cached_tokens / max(prompt_tokens, 1):.1%}", end="")
        try:
            stats = await client.cache_stats()
            print(f" (server-wide hit rate {stats.hit_rate:.1%})")
        except PermissionDeniedError:
            print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL))
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--keep-cache", action="store_true", help="do not evict before starting")
    args = p.parse_args(argv)
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
