"""Prompt tokenization with a long repeated system prompt: whole-text encode vs the piece memo.

    .venv/bin/python bench/tokenization.py [--prefix-tokens 30000] [--requests 20] [--json]

Each request is the chat template rendered over the same system prompt and a new question.
Baseline: the whole text encoded at once (what transformers' ``apply_chat_template`` and
vLLM do for every request). Ours: ``Tokenizer.encode``, which remembers the text between
special tokens, so the system prompt is encoded by the first request only. Ids are checked
equal on every request. Ideal: the cost of encoding the question alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from prefixcache.engine.model.demo_model import ensure_demo_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.text.tokenizer import Tokenizer

WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "engine",
    "request",
    "batch",
    "decode",
    "prefill",
    "schedule",
    "evict",
    "pin",
    "tenant",
    "segment",
    "stream",
    "latency",
    "memory",
    "attention",
    "kernel",
    "page",
    "table",
    "model",
    "server",
    "client",
    "reuse",
    "system",
    "prompt",
    "schema",
    "document",
    "history",
    "tool",
    "answer",
    "question",
    "order",
    "train",
    "leaves",
    "station",
]


def system_prompt(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences))) < tokens:
        words = [rng.choice(WORDS) for _ in range(200)]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="'demo' or a Hugging Face folder")
    parser.add_argument("--prefix-tokens", type=int, default=30000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()

    folder = ensure_demo_model() if args.model == "demo" else Path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    if tokenizer.piece_cache is None:
        raise SystemExit(f"{folder}: this tokenizer encodes whole texts only (no piece memo)")
    hf = tokenizer._tok  # the tokenizers.Tokenizer underneath: the baseline
    system = system_prompt(tokenizer, args.prefix_tokens, args.seed)
    tokenizer.piece_cache.clear()

    whole, cached, question_only = [], [], []
    cold_s = 0.0
    num_tokens = 0
    for i in progress_iter(range(args.requests), "requests tokenized"):
        question = f"Request {i}: which train leaves after {i % 24}:00, and from which platform?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages)
        expected, whole_s = timed(lambda t: hf.encode(t, add_special_tokens=False).ids, text)
        ids, ours_s = timed(tokenizer.encode, text)
        if ids != expected:
            raise SystemExit(f"request {i}: the piece memo changed the ids")
        _, alone_s = timed(lambda q: hf.encode(q, add_special_tokens=False).ids, question)
        num_tokens = len(ids)
        if i == 0:
            cold_s = ours_s
            continue
        whole.append(whole_s)
        cached.append(ours_s)
        question_only.append(alone_s)

    whole_ms = statistics.median(whole) * 1000
    cached_ms = statistics.median(cached) * 1000
    ideal_ms = statistics.median(question_only) * 1000
    result = {
        "bench": "tokenize",
        "prompt_tokens": num_tokens,
        "requests": args.requests,
        "whole_ms": round(whole_ms, 3),
        "cached_ms": round(cached_ms, 3),
        "cold_ms": round(cold_s * 1000, 3),
        "question_only_ms": round(ideal_ms, 3),
        "speedup": round(whole_ms / cached_ms, 1),
        "ideal_speedup": round(whole_ms / ideal_ms, 1),
    }
    print(f"prompt: {num_tokens} tokens, {args.prefix_tokens}-token system prompt, new question")
    print(f"whole-text encode (baseline)  {whole_ms:9.3f} ms per request")
    print(f"piece memo, first request     {result['cold_ms']:9.3f} ms")
    print(f"piece memo, later requests    {cached_ms:9.3f} ms  ({result['speedup']}x)")
    print(f"the question alone (ideal)    {ideal_ms:9.3f} ms  ({result['ideal_speedup']}x)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
