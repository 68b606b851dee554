"""Serving benchmark for any OpenAI-compatible server: shared-prefix traffic and TTFT A/B/C/D.

The same minimal HTTP/1.1 streaming client (asyncio sockets, no client library) drives every
server, so the client's own cost is the same for all. Prompts are token ids (``prompt`` as a
list of ints on ``/v1/completions``), drawn from a fixed seed, so both servers see the very
same tokens; ``ignore_eos`` makes every request produce exactly ``--output`` tokens.

Workloads:
- ``shared`` (SGLang's generated-shared-prefix, scaled down): ``--groups`` groups of
  ``--per-group`` requests; each group has a ``--system``-token prompt, each request adds a
  ``--question``-token question; shuffled with ``--seed``; ``--concurrency`` in flight.
  ``--prewarm`` sends each group's prefix alone first (untimed, not counted), so the figures
  are those of requests that find their prefix cached (decode over a long shared prefix).
  Reports output tok/s, TTFT p50/p90, mean inter-token latency and the token hit rate (from
  the server's own prefix-cache counters on /metrics: vLLM's or ours).
- ``lengths``: for each ``--lengths`` L, A = L tokens and a ``--tail``-token ending, then B =
  A's first L tokens and another ending; one output token each. The tokens the server reports
  cached for B (``usage.prompt_tokens_details.cached_tokens``; vLLM: start it with
  ``--enable-prompt-tokens-details``) against L, and A's and B's TTFT: how fine the server's
  prefix reuse is.
- ``ttft``: A = a cold ``--prompt``-token prompt; B shares A's first ``--shared`` tokens;
  C is unrelated; D shares A's ``--shared`` tokens and is sent after C (does the prefix survive
  unrelated traffic?). One output token each, sent one at a time; ``--repeat`` rounds with
  fresh tokens, medians reported.

Point it at a running server (``--url``) or let it start ``prefixcache serve`` (``--serve``,
extra flags after ``--``); the server it starts is stopped at the end.

    .venv/bin/python bench/serving.py --serve /tmp/bench-llama55m --groups 8 --per-group 8 \\
        --system 1024 --question 64 --output 32 --concurrency 16 [--json]
    .venv/bin/python bench/serving.py --url http://127.0.0.1:8100 --workload ttft --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prefixcache.engine.model.progress import progress_bar, progress_iter

FIRST_ID = 3  # ids below this are the bench model's special tokens


@dataclass(slots=True)
class Result:
    ok: bool
    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens (usage), else text chunks seen
    cached: int = 0  # prompt tokens the server reports cached (usage.prompt_tokens_details)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


async def stream_completion(host: str, port: int, body: dict) -> Result:
    """POST /v1/completions with stream=true; times every SSE event that carries text."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Accept: text/event-stream\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.perf_counter()
    result = Result(ok=False, sent=sent)
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(head + payload)
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if status != 200:
            result.error = f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}"
            return result
        buffer = b""
        async for data in _body(reader, chunked):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    text = line[5:].strip()
                    if text == b"[DONE]":
                        result.ok = True
                        continue
                    now = time.perf_counter()
                    msg = json.loads(text)
                    if msg.get("error"):
                        result.error = str(msg["error"])
                    for choice in msg.get("choices") or ():
                        if choice.get("text"):
                            result.token_times.append(now)
                    usage = msg.get("usage")
                    if usage:
                        result.tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached = int(details.get("cached_tokens") or 0)
        if not result.tokens:
            result.tokens = len(result.token_times)
        result.ok = result.ok and not result.error and bool(result.token_times)
        return result
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


# -- the server --------------------------------------------------------------------------


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def prefix_cache_counters(base: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) from /metrics, vLLM's names or prefixcache's; zeros where
    the server has none (llama-server without --metrics): the hit rate is then NaN."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except urllib.error.HTTPError:
        return 0.0, 0.0
    values = {"hits": 0.0, "queries": 0.0}
    pattern = r"^(?:vllm|prefixcache):prefix_cache_(hits|queries)_total(?:\{[^}]*\})? (\S+)$"
    for m in re.finditer(pattern, text, re.MULTILINE):
        values[m.group(1)] += float(m.group(2))
    return values["hits"], values["queries"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (a server's graceful stop: it drains and exits), then a kill after 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--model", model]
    cmd += ["--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        try:
            urllib.request.urlopen(base + "/health", timeout=2).read()
            return proc, base
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in 300 s")


# -- workloads ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def shared_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """The shared workload's group prefixes and its prompts (shuffled), from --seed."""
    rng = random.Random(args.seed)
    systems = [random_ids(rng, args.system, args.vocab) for _ in range(args.groups)]
    prompts = [
        systems[g] + random_ids(rng, args.question, args.vocab)
        for g in range(args.groups)
        for _ in range(args.per_group)
    ]
    rng.shuffle(prompts)
    return systems, prompts


async def prewarm(args: argparse.Namespace, host: str, port: int, model: str) -> None:
    """Each group's prefix sent alone (one output token), before the counters are read."""
    systems, _ = shared_prompts(args)
    for system in progress_iter(systems, "pre-warming group prefixes"):
        r = await stream_completion(host, port, completion_body(model, system, 1))
        if not r.ok:
            raise SystemExit(f"pre-warm request failed: {r.error}")


async def run_shared(args: argparse.Namespace, host: str, port: int, model: str) -> dict:
    _, prompts = shared_prompts(args)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []
    bar = progress_bar("shared-prefix requests", len(prompts))

    async def worker() -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                body = completion_body(model, prompt, args.output)
                results.append(await stream_completion(host, port, body))
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                results.append(Result(ok=False, sent=time.perf_counter(), error=repr(e)))
            bar.update()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    bar.close()
    good = [r for r in results if r.ok]
    gaps = [g for r in good for g in r.gaps]
    ttfts = [r.ttft for r in good]
    out_tokens = sum(r.tokens for r in good)
    return {
        "requests": len(results),
        "errors": len(results) - len(good),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "duration_s": elapsed,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
        "request_s": len(good) / elapsed,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
        "ttft_p90_ms": pct(ttfts, 0.9) * 1e3,
        "itl_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else float("nan"),
        "itl_p50_ms": pct(gaps, 0.5) * 1e3,
        "itl_p90_ms": pct(gaps, 0.9) * 1e3,
    }


async def run_ttft(args: argparse.Namespace, host: str, port: int, model: str) -> dict:
    rng = random.Random(args.seed + 1)
    rounds: dict[str, list[float]] = {"A_cold": [], "B_warm": [], "C_unrelated": [], "D_after": []}
    for _ in progress_iter(range(args.repeat), "TTFT rounds A/B/C/D"):
        a = random_ids(rng, args.prompt, args.vocab)
        b = a[: args.shared] + random_ids(rng, args.prompt - args.shared, args.vocab)
        c = random_ids(rng, args.prompt, args.vocab)
        d = a[: args.shared] + random_ids(rng, args.prompt - args.shared, args.vocab)
        for name, prompt in zip(rounds, (a, b, c, d), strict=True):
            r = await stream_completion(host, port, completion_body(model, prompt, 1))
            if not r.ok:
                raise SystemExit(f"request {name} failed: {r.error}")
            rounds[name].append(r.ttft)
    med = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in rounds.items()}
    med["runs"] = {k: [round(x * 1e3, 1) for x in v] for k, v in rounds.items()}
    return med


async def run_lengths(args: argparse.Namespace, host: str, port: int, model: str) -> dict:
    rng = random.Random(args.seed + 2)
    rows = []
    for shared in progress_iter(args.lengths, "prefix lengths A/B"):
        a = random_ids(rng, shared + args.tail, args.vocab)
        b = a[:shared] + random_ids(rng, args.tail, args.vocab)
        ra = await stream_completion(host, port, completion_body(model, a, 1))
        rb = await stream_completion(host, port, completion_body(model, b, 1))
        if not (ra.ok and rb.ok):
            raise SystemExit(f"request over {shared} shared tokens failed: {ra.error or rb.error}")
        rows.append(
            {
                "shared": shared,
                "prompt_tokens": shared + args.tail,
                "cached": rb.cached,
                "cold_ms": round(ra.ttft * 1e3, 1),
                "warm_ms": round(rb.ttft * 1e3, 1),
            }
        )
    return {
        "rows": rows,
        "cached_of_shared": round(sum(r["cached"] for r in rows) / sum(args.lengths), 4),
        "zero_hit_lengths": [r["shared"] for r in rows if r["cached"] == 0],
    }


async def warm_up(args: argparse.Namespace, host: str, port: int, model: str) -> None:
    """Unrelated requests first: compile/allocate paths so the first measured one is fair."""
    rng = random.Random(args.seed + 99)
    with progress_bar("warm-up requests", 2 * args.warmup) as bar:
        for n in (args.warmup_tokens, 16):
            for _ in range(args.warmup):
                body = completion_body(model, random_ids(rng, n, args.vocab), 4)
                r = await stream_completion(host, port, body)
                if not r.ok:
                    raise SystemExit(f"warm-up request failed: {r.error}")
                bar.update()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8100")
    where.add_argument("--serve", metavar="MODEL", help="start `prefixcache serve --model MODEL`")
    ap.add_argument("--model-name", default=None, help="model field (default: /v1/models' first)")
    ap.add_argument("--workload", choices=["shared", "ttft", "lengths"], default="shared")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens per group")
    ap.add_argument("--question", type=int, default=64, help="question tokens per request")
    ap.add_argument("--output", type=int, default=32, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument(
        "--prewarm",
        action="store_true",
        help="shared: send each group's prefix alone first (untimed), so every timed request "
        "finds it cached and the figures are the warm requests' own",
    )
    ap.add_argument("--prompt", type=int, default=4000, help="ttft: prompt tokens")
    ap.add_argument("--shared", type=int, default=3900, help="ttft: tokens B and D share with A")
    ap.add_argument("--repeat", type=int, default=3, help="ttft: rounds (medians reported)")
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[17, 31, 64, 100, 200, 300, 500, 1000, 2000],
        help="lengths: shared tokens of each A/B pair",
    )
    ap.add_argument("--tail", type=int, default=8, help="lengths: tokens after the shared ones")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="unrelated warm-up requests per size")
    ap.add_argument("--warmup-tokens", type=int, default=1100)
    ap.add_argument("--label", default="", help="free text copied into the JSON")
    ap.add_argument("--json", action="store_true", help="last line: the result as JSON")
    ap.add_argument("server_args", nargs="*", help="after --: flags for `prefixcache serve`")
    args = ap.parse_args()

    proc = None
    if args.serve:
        proc, base = start_server(args.serve, args.server_args)
    else:
        base = args.url.rstrip("/")
    try:
        url = urlsplit(base)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        models = get_json(base + "/v1/models")["data"]
        model = args.model_name or models[0]["id"]
        asyncio.run(warm_up(args, host, port, model))
        if args.prewarm and args.workload == "shared":
            asyncio.run(prewarm(args, host, port, model))
        hits0, queries0 = prefix_cache_counters(base)
        runner = {"shared": run_shared, "ttft": run_ttft, "lengths": run_lengths}[args.workload]
        result = asyncio.run(runner(args, host, port, model))
        hits1, queries1 = prefix_cache_counters(base)
        queried = queries1 - queries0
        result["hit_rate"] = (hits1 - hits0) / queried if queried else float("nan")
        result["model"] = model
        result["server"] = {k: v for k, v in models[0].items() if k in ("id", "owned_by", "dtype")}
    finally:
        if proc is not None:
            stop_server(proc)
    result["workload"] = args.workload
    result["label"] = args.label
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("json", "server_args")}
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key:>16}: {value:,.3f}")
        elif key not in ("args", "runs", "rows"):
            print(f"{key:>16}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
