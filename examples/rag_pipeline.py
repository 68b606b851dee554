"""Many questions over the same document: the document's prefill is paid once.

The document is real and can be checked: the Apache License 2.0
(examples/documents/apache-license-2.0.txt, about 2,200 tokens), byte for byte the copy that
prometheus_client, a dependency of ``prefixcache[serve]``, installs (see ``DOCUMENT_SOURCE``;
tests/test_example_documents.py checks it still matches), cut into sections. Each section is
a shared segment, ordered by tag so that retrieval order never changes the bytes; each
question is a dynamic segment at the end. Prints every question with its answer, time to
first token (TTFT) and cached tokens, then TTFT cold vs warm.

    prefixcache serve --model smollm2         # in another terminal
    python examples/rag_pipeline.py [--base-url URL] [--questions 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import anyio

from prefixcache.sdk import AsyncClient, PermissionDeniedError, Prompt

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# Source: prometheus_client's <site-packages>/prometheus_client-*.dist-info/licenses/LICENSE
# (safetensors ships the same bytes), sha256
# c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4.
DOCUMENT = Path(__file__).resolve().parent / "documents" / "apache-license-2.0.txt"
DOCUMENT_SOURCE = ("prometheus_client", "licenses/LICENSE")  # (distribution, file in dist-info)
DOCUMENT_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"

QUESTIONS = [
    "What does the License mean by a Derivative Work?",
    "Which rights does the copyright license of Section 2 grant?",
    "When does the patent license end for someone who sues over a patent?",
    "What must you give recipients when you redistribute the Work?",
    "What must a file you modified carry?",
    "Does the License let you use the Licensor's trademarks?",
    "Is the Work provided with any warranty?",
    "How do you apply the License to your own work?",
]
# Section tag -> the heading (or first words) where the section starts in the file.
SECTIONS = {
    "doc:1-definitions": "Apache License",
    "doc:2-grants": "2. Grant of Copyright License.",
    "doc:3-redistribution": "4. Redistribution.",
    "doc:4-warranty-liability": "7. Disclaimer of Warranty.",
    "doc:5-appendix": "APPENDIX: How to apply",
}


def documents() -> dict[str, str]:
    """The file's sections, keyed by a stable document id."""
    text = DOCUMENT.read_text(encoding="utf-8")
    starts = [(text.index(marker), tag) for tag, marker in SECTIONS.items()]
    starts.sort()
    bounds = [*(pos for pos, _ in starts[1:]), len(text)]
    return {tag: text[pos:end].strip() for (pos, tag), end in zip(starts, bounds, strict=True)}


def build_prompt(docs: dict[str, str], question: str) -> Prompt:
    b = Prompt.builder().static(
        "You answer questions about a software licence. Answer in one sentence, only from the "
        "documents below.",
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
            print(f"\nQ{i + 1}: {question}")
            print(f"A: {stream.text.strip() or '(empty answer)'}")
            print(
                f"   TTFT {stream.ttft * 1000:.0f} ms, prompt {stream.usage.prompt_tokens} tokens, "
                f"{stream.usage.cached_tokens} cached",
                flush=True,
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
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--keep-cache", action="store_true", help="do not evict before starting")
    args = p.parse_args(argv)
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
