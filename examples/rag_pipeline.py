"""Many questions over the same documents, retrieved in another order each time: prefix
caching alone next to documents reused anywhere.

The document is real and can be checked: the Apache License 2.0
(examples/documents/apache-license-2.0.txt, about 2,200 tokens), byte for byte the copy that
prometheus_client, a dependency of ``prefixcache[serve]``, installs (see ``DOCUMENT_SOURCE``;
tests/test_example_documents.py checks it still matches), cut into sections. Each question's
"retriever" returns the top 3 sections in its own order; each question is a dynamic segment
at the end. Two modes, side by side (``--mode both``, the default):

- ``prefix``: the sections as shared segments in retrieval order. Exact, but once the first
  section differs from an earlier request's, everything after it is computed again.
- ``anywhere``: the sections as ``.document()`` segments (``reuse="anywhere"``): the server
  computes each section's KV once and places it wherever the retriever puts it, recomputing
  a few leading tokens of each (``--reuse-repair-tokens``). Faster, approximate: outputs may
  differ from the exact ones (docs/prompt-layout.md, "Documents reused anywhere").

Prints every question with its answer, TTFT, cached and reused tokens, then TTFT per mode.

    prefixcache serve --model smollm2         # in another terminal
    python examples/rag_pipeline.py [--base-url URL] [--questions 8] [--mode both]
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


def retrieve(docs: dict[str, str], i: int, top_k: int = 3) -> list[str]:
    """A stand-in retriever: question i's top-k sections, in its own score order."""
    tags = sorted(docs)
    picked = [tags[(i * 2 + j * 3) % len(tags)] for j in range(len(tags))]
    return list(dict.fromkeys(picked))[:top_k]


def build_prompt(docs: dict[str, str], tags: list[str], question: str, mode: str) -> Prompt:
    b = Prompt.builder().static(
        "You answer questions about a software licence. Answer in one sentence, only from the "
        "documents below.",
        tag="instructions",
    )
    for tag in tags:  # retrieval order
        if mode == "anywhere":
            b.document(docs[tag], tag=tag)  # KV reusable at any position (approximate)
        else:
            b.shared(docs[tag], tag=tag)
    return b.dynamic(question, tag="question").build()


async def run_mode(client: AsyncClient, args: argparse.Namespace, mode: str) -> list[float]:
    docs = documents()
    questions = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: args.questions]
    if not args.keep_cache:
        try:
            print(f"[{mode}] evicted {await client.evict()} cached blocks for a cold start")
        except PermissionDeniedError:
            print(f"[{mode}] (cannot evict without an admin key; requests may start warm)")
    ttfts: list[float] = []
    for i, question in enumerate(questions):
        tags = retrieve(docs, i)
        prompt = build_prompt(docs, tags, question, mode)
        stream = client.stream(prompt, max_tokens=args.max_tokens, temperature=0.0)
        async for _ in stream:
            pass
        assert stream.ttft is not None and stream.usage is not None
        ttfts.append(stream.ttft)
        reused = stream.cache.reused_tokens if stream.cache is not None else 0
        print(f"\n[{mode}] Q{i + 1}: {question}  (documents {', '.join(tags)})")
        print(f"A: {stream.text.strip() or '(empty answer)'}")
        print(
            f"   TTFT {stream.ttft * 1000:.0f} ms, prompt {stream.usage.prompt_tokens} tokens, "
            f"{stream.usage.cached_tokens} cached, {reused} reused anywhere",
            flush=True,
        )
    return ttfts


async def run(args: argparse.Namespace) -> None:
    modes = ["prefix", "anywhere"] if args.mode == "both" else [args.mode]
    async with AsyncClient(args.base_url, model=args.model) as client:
        medians = {}
        for mode in modes:
            ttfts = await run_mode(client, args, mode)
            # the first request computes every document: the later ones show the steady state
            medians[mode] = statistics.median(ttfts[1:] if len(ttfts) > 1 else ttfts)
        print()
        for mode, median in medians.items():
            print(f"TTFT median after the first request, {mode}: {median * 1000:.1f} ms")
        if len(medians) == 2 and medians["anywhere"] > 0:
            print(f"documents reused anywhere: {medians['prefix'] / medians['anywhere']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--base-url",
        default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL),
        help=f"$PREFIXCACHE_BASE_URL, else {DEFAULT_BASE_URL} (here: %(default)s)",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--keep-cache", action="store_true", help="do not evict before each mode")
    p.add_argument("--mode", choices=["prefix", "anywhere", "both"], default="both")
    args = p.parse_args(argv)
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
