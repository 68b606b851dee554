"""Routing over replicas: round robin vs approximate (tree) vs precise (KV events).

    .venv/bin/python bench/routing.py [--replicas 3] [--tenants 12] [--conversations 2]
        [--turns 4] [--num-blocks 160] [--json] [--plot docs/routing.png]
    .venv/bin/python bench/routing.py --upstreams 'URL,events=ZMQ,replay=ZMQ;...' \
        --upstream-kind vllm --tokenizer DIR   # replicas started elsewhere (vLLM)

K engine sidecars (the demo model, a KV pool of --num-blocks blocks each, KV events on) are
the replicas. The workload: T tenants, each with its own long system prompt, and C
conversations per tenant of N turns whose histories grow (each turn appends the reply and a
new question); every conversation runs at once (a saturating closed loop), so turns of
different tenants interleave. Three runs, every cache evicted in between:

- round_robin: the client sends request i straight to replica i mod K;
- approximate: through an upstream-mode sidecar without events (``--routing cache_aware``,
  no tokenizer): the approximate radix tree of what it sent where;
- precise: the same sidecar with each replica's event endpoint and the demo tokenizer.

``--routers N`` puts N router instances in front of the same replicas (an HA pair of
sidecars, say) and sends conversation k through router k mod N: each approximate tree sees
only its router's share of the traffic, while every precise router reads every replica's
events. ``--upstreams`` (with ``--upstream-kind vllm`` and ``--tokenizer``) routes over
replicas started elsewhere instead (tests/vllm_replicas.py ``--bench``).

Per run: TTFT p50/p90 (time to the first streamed content byte), token hit rate (cached /
prompt tokens, from each reply's usage), and max/min requests per replica. ``ideal_hit_rate``
is one replica with an unbounded cache: each prompt's longest common prefix with any earlier
prompt of the run (token ids, as the demo tokenizer renders them), over all prompt tokens.
The last line with --json is {"round_robin": {...}, "approximate": {...}, "precise": {...},
"ideal_hit_rate": x}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import uvicorn

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.model.demo_model import ensure_demo_model
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.serving.async_engine import AsyncEngine
from prefixcache.engine.text.tokenizer import Tokenizer
from prefixcache.sidecar.router.app import EventSource, UpstreamSettings, create_upstream_app
from prefixcache.sidecar.router.route_input import RouteReader
from prefixcache.sidecar.server.app import SidecarSettings, create_app

WORDS = [
    "train",
    "platform",
    "ticket",
    "delay",
    "station",
    "timetable",
    "route",
    "fare",
    "card",
    "seat",
    "window",
    "harbour",
    "ferry",
    "island",
    "bridge",
    "market",
    "village",
    "terminal",
    "schedule",
    "transfer",
    "coach",
    "luggage",
    "refund",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """Every app on one background event loop, each on a loopback port."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers: list[tuple[uvicorn.Server, Any]] = []

    def start(self, app: Any) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        server = uvicorn.Server(config)
        done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self.servers.append((server, done))
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                    return f"{root}/v1"
            except httpx.TransportError:
                pass
            if done.done() or time.monotonic() > deadline:
                raise RuntimeError(f"{root} did not start")
            time.sleep(0.1)

    def stop_last(self) -> None:
        server, done = self.servers.pop()
        server.should_exit = True
        done.result(30)

    def close(self) -> None:
        while self.servers:
            self.stop_last()


def system_prompts(tenants: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"[tenant {t}] You answer travel questions. "
        + " ".join(rng.choice(WORDS) for _ in range(words))
        for t in range(tenants)
    ]


async def run_policy(
    target: Any,
    systems: list[str],
    conversations: int,
    turns: int,
    max_tokens: int,
    seed: int,
    desc: str = "requests",
) -> dict[str, Any]:
    """``target(i, conversation) -> base URL`` for request i of a conversation (numbered
    across tenants). Every conversation at once, turns in order."""
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    sent: list[list[dict[str, str]]] = []
    counter = iter(range(1_000_000))
    rng = random.Random(seed)
    bar = progress_bar(desc, len(systems) * conversations * turns)

    async def conversation(client: httpx.AsyncClient, tenant: int, c: int) -> None:
        nonlocal prompt_tokens, cached_tokens
        key = tenant * conversations + c
        await asyncio.sleep(rng.random() * 0.5)  # staggered starts
        messages = [{"role": "system", "content": systems[tenant]}]
        for turn in range(turns):
            messages.append(
                {
                    "role": "user",
                    "content": f"Conversation {c}, question {turn}: which {rng.choice(WORDS)}?",
                }
            )
            body = {
                "model": "demo",
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent.append(list(messages))
            start = time.perf_counter()
            first = None
            text = []
            async with client.stream(
                "POST", f"{target(next(counter), key)}/chat/completions", json=body
            ) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta", {}).get("content")
                        if delta:
                            if first is None:
                                first = time.perf_counter() - start
                            text.append(delta)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        prompt_tokens += usage["prompt_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        cached_tokens += details.get("cached_tokens") or 0
            ttfts.append(first if first is not None else time.perf_counter() - start)
            bar.update()
            messages.append({"role": "assistant", "content": "".join(text)})

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(
            *(conversation(client, t, c) for t in range(len(systems)) for c in range(conversations))
        )
    bar.close()
    ttfts.sort()
    return {
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1),
        "hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "requests": len(ttfts),
        "wall_s": round(time.perf_counter() - started, 1),
        "_sent": sent,
    }


def ideal_hit_rate(reader: RouteReader, sent: list[list[dict[str, str]]]) -> float:
    """One unbounded cache: longest common prefix with any earlier prompt, token-granular."""
    prompts = [reader.chat({"model": "demo", "messages": m}).token_ids or [] for m in sent]
    total = hit = 0
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            limit = min(len(prompt) - 1, len(earlier))
            while n < limit and prompt[n] == earlier[n]:
                n += 1
            best = max(best, n)
        total += len(prompt)
        hit += best
    return round(hit / total, 4) if total else 0.0


def requests_per_replica(proxies: list[Any]) -> list[float]:
    counts: dict[str, float] = {}
    for proxy in proxies:
        for metric in proxy.metrics.decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    url = sample.labels["upstream"]
                    counts[url] = counts.get(url, 0) + sample.value
    return list(counts.values())


def reasons(proxies: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for proxy in proxies:
        for metric in proxy.metrics.decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    reason = sample.labels["reason"]
                    out[reason] = out.get(reason, 0) + sample.value
    return out


def predicted_vs_reported(proxies: list[Any]) -> tuple[float, float]:
    totals = []
    for name in ("predicted_cached", "reported_cached"):
        totals.append(
            sum(
                s.value
                for proxy in proxies
                for m in getattr(proxy.metrics, name).collect()
                for s in m.samples
                if s.name.endswith("_total")
            )
        )
    return totals[0], totals[1]


def load_ratio(counts: list[float]) -> float:
    return round(max(counts) / min(counts), 2) if min(counts) else float("inf")


def evict(replicas: list[str], kind: str = "prefixcache") -> None:
    """Empty every replica's prefix cache: our admin route, or vLLM's dev-mode reset
    (``VLLM_SERVER_DEV_MODE=1``; it publishes AllBlocksCleared)."""
    for url in replicas:
        if kind == "vllm":
            root = url.removesuffix("/v1")
            reply = httpx.post(f"{root}/reset_prefix_cache", timeout=60)
            reply.raise_for_status()
            if not reply.json().get("success"):
                raise RuntimeError(f"{root} refused to reset its prefix cache")
        else:
            httpx.post(f"{url}/cache/evict", json={}, timeout=60).raise_for_status()


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = ["round_robin", "approximate", "precise"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    x = range(len(policies))
    axes[0].bar(
        [i - 0.2 for i in x], [results[p]["ttft_p50_ms"] for p in policies], 0.4, label="p50"
    )
    axes[0].bar(
        [i + 0.2 for i in x], [results[p]["ttft_p90_ms"] for p in policies], 0.4, label="p90"
    )
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(x, [results[p]["hit_rate"] for p in policies], color="tab:green")
    axes[1].axhline(results["ideal_hit_rate"], color="black", linestyle="--", label="ideal")
    axes[1].set_title("token hit rate")
    axes[1].set_ylim(0, 1)
    axes[1].legend()
    axes[2].bar(x, [results[p]["load_max_over_min"] for p in policies], color="tab:orange")
    axes[2].axhline(1.5, color="black", linestyle="--", label="target 1.5")
    axes[2].set_title("max/min requests per replica")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(list(x), policies)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--conversations", type=int, default=2, help="per tenant")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=160, help="KV pool per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--running-weight", type=float, default=None, help="precise cost knob")
    parser.add_argument("--prefill-weight", type=float, default=None, help="precise cost knob")
    parser.add_argument("--balance-abs-threshold", type=int, default=None)
    parser.add_argument("--policies", default="round_robin,approximate,precise")
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router instances in front of the same replicas; conversation k goes through "
        "router k mod N (each approximate tree sees 1/N of the traffic; events reach all)",
    )
    parser.add_argument("--plot", default=None, help="write a PNG of the results here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--upstreams", default=None, help="replicas started elsewhere: ';'-joined upstream specs"
    )
    parser.add_argument("--upstream-kind", choices=["prefixcache", "vllm"], default="prefixcache")
    parser.add_argument("--tokenizer", default=None, help="their model folder (default: demo)")
    args = parser.parse_args()

    tokenizer = Tokenizer.from_folder(args.tokenizer or ensure_demo_model())
    servers = Servers()
    replicas, sources = [], []
    if args.upstreams:
        from prefixcache.sidecar.cli.route_command import parse_upstream

        for spec in args.upstreams.split(";"):
            url, source = parse_upstream(spec)
            assert source is not None, f"{spec}: precise routing needs events=..."
            replicas.append(url)
            sources.append(source)
    loaded = None if args.upstreams else load_model("demo", dtype="float32", device="cpu")
    for _ in range(0 if args.upstreams else args.replicas):
        events, replay = free_port(), free_port()
        config = EngineConfig(
            model="demo",
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            num_blocks=args.num_blocks,
            kv_events_endpoint=f"tcp://127.0.0.1:{events}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
            kv_events_token_ids="all",
        )
        url = servers.start(create_app(AsyncEngine(config, loaded), SidecarSettings()))
        replicas.append(url)
        sources.append(EventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
    systems = system_prompts(args.tenants, args.system_words, args.seed)
    results: dict[str, Any] = {}
    try:
        for policy in args.policies.split(","):
            evict(replicas, args.upstream_kind)
            proxies: list[Any] = []
            if policy == "round_robin":
                target = lambda i, key: replicas[i % len(replicas)]  # noqa: E731
            else:
                settings = UpstreamSettings(tuple(replicas))
                if args.running_weight is not None:
                    settings.cache_aware.running_weight = args.running_weight
                if args.prefill_weight is not None:
                    settings.cache_aware.prefill_weight = args.prefill_weight
                if args.balance_abs_threshold is not None:
                    settings.cache_aware.balance_abs_threshold = args.balance_abs_threshold
                if policy == "precise":
                    settings.events = dict(zip(replicas, sources, strict=True))
                    settings.tokenizer = tokenizer
                router_urls = []
                for _ in range(args.routers):  # each sees only its share of the traffic
                    app = create_upstream_app(settings)
                    router_urls.append(servers.start(app))
                    proxies.append(app.state.upstream)
                target = lambda i, key, us=router_urls: us[key % len(us)]  # noqa: E731
                time.sleep(0.5)  # subscribers connect and replay what the replicas hold
            result = asyncio.run(
                run_policy(
                    target,
                    systems,
                    args.conversations,
                    args.turns,
                    args.max_tokens,
                    args.seed,
                    desc=f"{policy}: requests",
                )
            )
            sent = result.pop("_sent")
            if not proxies:
                n = result["requests"]
                counts = [float(len(range(i, n, len(replicas)))) for i in range(len(replicas))]
            else:
                counts = requests_per_replica(proxies)
                result["reasons"] = reasons(proxies)
                result["predicted_cached_tokens"], result["reported_cached_tokens"] = (
                    predicted_vs_reported(proxies)
                )
                for _ in proxies:
                    servers.stop_last()
            result["requests_per_replica"] = counts
            result["load_max_over_min"] = load_ratio(counts)
            results[policy] = result
            if policy == "precise":
                results["ideal_hit_rate"] = ideal_hit_rate(RouteReader(tokenizer), sent)
            if not args.json:
                print(policy, result, flush=True)
    finally:
        servers.close()
    if args.plot and len(results) == 4:
        plot(results, args.plot)
    if not args.json:
        print("ideal_hit_rate", results.get("ideal_hit_rate"))
    else:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
