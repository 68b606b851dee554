"""A multi-turn chat whose history is append-only session segments, with a branch.

Each turn sends: static instructions, the conversation so far (session), the new user message
(dynamic). After the answer, the message and the reply join the history, so the next turn's
prompt extends the previous one and only the new text is computed. At the end two different
follow-ups branch from the same history: both reuse it.

    prefixcache serve --model smollm2         # in another terminal
    python examples/chat_assistant.py [--base-url URL]
"""

from __future__ import annotations

import argparse
import os
import sys

from prefixcache.sdk import Client, Prompt, Segment

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

SYSTEM = (
    "You are a friendly travel assistant. Keep answers to two sentences. Ask one clarifying "
    "question when the traveller's plan is ambiguous. Prefer trains over flights for trips "
    "under six hours."
)
TURNS = [
    "I want to visit three cities in Italy in one week.",
    "I like art and food more than beaches.",
    "I arrive in Milan on a Monday morning.",
]
BRANCHES = {
    "branch-a": "Plan the route by train, please.",
    "branch-b": "What if I rent a car instead?",
}


def ask(
    client: Client, history: Prompt, text: str, tag: str, max_tokens: int
) -> tuple[Prompt, str]:
    """Send one user message; return the history extended by it and the reply."""
    prompt = history.append(Segment("user", text, tag, "dynamic"))
    out = client.complete(prompt, max_tokens=max_tokens, temperature=0.0)
    report = out.cache
    per_segment = (
        " ".join(f"{s.tag}={s.cached_tokens}/{s.tokens}" for s in report.segments)
        if report
        else "(no per-segment report)"
    )
    print(
        f"[{tag}] prompt {out.usage.prompt_tokens} cached {out.usage.cached_tokens}: {per_segment}"
    )
    reply = out.text.strip() or "(empty reply)"
    print(f"  user: {text}\n  assistant: {reply}")
    extended = history.append(
        Segment("user", text, f"{tag}:user", "session"),
        Segment("assistant", reply, f"{tag}:assistant", "session"),
    )
    return extended, reply


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--base-url",
        default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL),
        help=f"$PREFIXCACHE_BASE_URL, else {DEFAULT_BASE_URL} (here: %(default)s)",
    )
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)

    history = Prompt([Segment("system", SYSTEM, "system", "static")])
    with Client(args.base_url, model=args.model) as client:
        for i, text in enumerate(TURNS, 1):
            history, _ = ask(client, history, text, f"turn-{i}", args.max_tokens)
        print("\nTwo follow-ups from the same history:")
        for tag, text in BRANCHES.items():
            ask(client, history, text, tag, args.max_tokens)
    print(
        f"\nhistory: {len(history.segments)} segments, fingerprint {history.fingerprint().hex[:16]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
