"""An agent loop whose tool calls and results are appended, never rewritten.

First, lint catches the classic cache-breaker: the current time in the system prompt. The
loop then runs twice over the same scripted tool calls: once with the timestamp in the system
prompt (every step recomputes everything), once with the fix (the time is a dynamic segment at
the end, and each step reuses all earlier steps).

    prefixcache serve --model smollm2         # in another terminal
    python examples/agent_loop.py [--base-url URL] [--steps 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

from prefixcache.sdk import Client, PermissionDeniedError, Prompt, PromptBuilder, Segment

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

INSTRUCTIONS = (
    "You are an operations agent. Use the tools to investigate an alert, one call per step, "
    "then write a short incident summary. Reply with the next tool call as JSON."
)
# A 135M model cannot be trusted to call tools, so the calls and results are scripted; the
# model's own reply to each step is printed next to the scripted call.
SCRIPT = [
    ({"tool": "get_alert", "args": {"id": "disk-usage"}}, "Disk usage on db-2 is at 93%."),
    ({"tool": "list_files", "args": {"host": "db-2", "path": "/var/log"}}, "app.log 41 GB"),
    ({"tool": "read_tail", "args": {"file": "app.log", "lines": 5}}, "DEBUG logging enabled"),
    ({"tool": "set_log_level", "args": {"level": "INFO"}}, "Log level set to INFO."),
    ({"tool": "rotate_logs", "args": {"host": "db-2"}}, "Rotated; disk usage now 51%."),
]


def base(fixed: bool, now: dt.datetime) -> PromptBuilder:
    b = Prompt.builder()
    b.tool(
        "get_alert", "Fetch an alert.", {"type": "object", "properties": {"id": {"type": "string"}}}
    )
    b.tool(
        "list_files", "List files.", {"type": "object", "properties": {"path": {"type": "string"}}}
    )
    if fixed:
        b.static(INSTRUCTIONS, tag="instructions")
        b.dynamic(f"Current time: {now:%Y-%m-%d %H:%M:%S} UTC.", tag="clock", role="system")
    else:
        # the classic draft: the clock first, so everything after it changes every step
        b.static(f"Current time: {now:%Y-%m-%d %H:%M:%S} UTC.\n{INSTRUCTIONS}", tag="instructions")
    return b


def evict(client: Client) -> None:
    try:
        client.evict()
    except PermissionDeniedError:
        print("  (cannot evict without an admin key; numbers include earlier runs)")


def run_loop(client: Client, fixed: bool, steps: int, max_tokens: int) -> float:
    """Run the scripted loop; return the fraction of prompt tokens served from the cache."""
    history: list[Segment] = []
    prompt_tokens = cached_tokens = 0
    for step in range(steps):
        now = dt.datetime(2026, 1, 1, 12, 0, 0) + dt.timedelta(seconds=7 * step)
        b = base(fixed, now)
        for seg in history:
            b.add(seg)
        prompt = b.dynamic("What is the next tool call?", tag="ask").build()
        out = client.complete(prompt, max_tokens=max_tokens, temperature=0.0)
        prompt_tokens += out.usage.prompt_tokens or 0
        cached_tokens += out.usage.cached_tokens
        reply = " ".join(out.text.split())[:70] or "(empty reply)"
        print(
            f"  step {step + 1}: prompt {out.usage.prompt_tokens:5d}"
            f" cached {out.usage.cached_tokens:5d}  model: {reply}"
        )
        call, result = SCRIPT[step % len(SCRIPT)]
        # append-only: the call and its result become session segments
        history.append(Segment("assistant", call, f"call-{step}", "session"))
        history.append(Segment("user", f"Tool result: {result}", f"result-{step}", "session"))
    return cached_tokens / max(prompt_tokens, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL))
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--keep-cache", action="store_true", help="do not evict before each run")
    args = p.parse_args(argv)

    now = dt.datetime(2026, 1, 1, 12, 0, 0)
    broken = base(False, now).dynamic("What is the next tool call?", tag="ask").build()
    print("lint on the first draft:")
    for finding in broken.lint():
        print("  ", finding)
    fixed = base(True, now).dynamic("What is the next tool call?", tag="ask").build()
    print(f"lint after the fix: {len(fixed.lint())} finding(s)\n")

    with Client(args.base_url, model=args.model) as client:
        print("timestamp in the system prompt:")
        if not args.keep_cache:
            evict(client)
        bad = run_loop(client, fixed=False, steps=args.steps, max_tokens=args.max_tokens)
        print("timestamp in a dynamic segment:")
        if not args.keep_cache:
            evict(client)
        good = run_loop(client, fixed=True, steps=args.steps, max_tokens=args.max_tokens)
    print(f"\nprompt tokens from cache: {bad:.0%} before the fix, {good:.0%} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
