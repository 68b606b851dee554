"""Upstream mode: prefix-affinity routing vs round robin over engine replicas.

    .venv/bin/python bench/upstream_routing.py [--replicas 3] [--prompts 12] [--questions 8] [--json]

K engine sidecars (the demo model, one KV pool each) serve as upstreams. The same shuffled
chat workload (P system prompts x Q questions, C requests in flight) runs three times, every
cache evicted in between:
1. ideal: all requests to one replica (each system prompt is computed once),
2. round robin: request i to replica i mod K (each prompt computed on up to K replicas),
3. ours: through the upstream sidecar (``create_upstream_app``), which routes by affinity.
Reports prompt tokens computed (prompt - cached) per run, ours vs round robin, and ours vs the
ideal; then the time the proxy hop adds per request (p50 of paired requests, ours vs direct).
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

import httpx
import uvicorn

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_bar, progress_iter
from prefixcache.engine.serving.async_engine import AsyncEngine
from prefixcache.sidecar.router.app import UpstreamSettings, create_upstream_app
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
]


class Servers:
    """Every app on one background event loop, each on a free loopback port."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers: list[tuple[uvicorn.Server, object]] = []

    def start(self, app: object) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
        done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self.servers.append((server, done))
        root = f"http://127.0.0.1:{sock.getsockname()[1]}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{root}/health").status_code == 200:
                    return f"{root}/v1"
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{root} did not become healthy")

    def close(self) -> None:
        for server, done in self.servers:
            server.should_exit = True
            done.result(timeout=60)  # type: ignore[attr-defined]


def workload(prompts: int, questions: int, seed: int) -> list[tuple[int, list[dict]]]:
    rng = random.Random(seed)
    systems = [
        f"[policy {p}] " + " ".join(rng.choice(WORDS) for _ in range(300)) for p in range(prompts)
    ]
    requests = [
        (p, [{"role": "system", "content": systems[p]}, {"role": "user", "content": f"Q{q}?"}])
        for p in range(prompts)
        for q in range(questions)
    ]
    rng.shuffle(requests)
    return requests


async def run(
    targets: list[str], requests: list[tuple[int, list[dict]]], concurrency: int, desc: str
) -> tuple[int, int, list[float]]:
    """Send request i to targets[i % len(targets)]; (prompt tokens, cached tokens, latencies)."""
    gate = asyncio.Semaphore(concurrency)
    bar = progress_bar(desc, len(requests))
    totals = [0, 0]
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient, i: int, messages: list[dict]) -> None:
        body = {"messages": messages, "max_tokens": 1, "temperature": 0}
        async with gate:
            start = time.perf_counter()
            response = await client.post(f"{targets[i % len(targets)]}/chat/completions", json=body)
            latencies.append(time.perf_counter() - start)
        response.raise_for_status()
        usage = response.json()["usage"]
        totals[0] += usage["prompt_tokens"]
        totals[1] += usage["prompt_tokens_details"]["cached_tokens"]
        bar.update()

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i, m) for i, (_, m) in enumerate(requests)))
    bar.close()
    return totals[0], totals[1], latencies


def evict(replicas: list[str]) -> None:
    for url in replicas:
        httpx.post(f"{url}/cache/evict", json={}).raise_for_status()


def hop_overhead(proxy: str, replicas: list[str], requests: int) -> float:
    """p50 of (through the proxy - straight to the replica it picks), same warm request."""

    async def measure() -> list[float]:
        messages = [{"role": "system", "content": "hop"}, {"role": "user", "content": "x"}]
        body = {"messages": messages, "max_tokens": 1, "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as client:
            await client.post(f"{proxy}/chat/completions", json=body)  # warm + find the owner
            owner = None
            for url in replicas:
                stats = (await client.get(f"{url}/cache/stats")).json()
                if stats["tokens"]["queries"] and owner is None:
                    owner = url
            diffs = []
            for _ in progress_iter(range(requests), "hop overhead: request pairs"):
                t0 = time.perf_counter()
                await client.post(f"{owner}/chat/completions", json=body)
                t1 = time.perf_counter()
                await client.post(f"{proxy}/chat/completions", json=body)
                diffs.append((time.perf_counter() - t1) - (t1 - t0))
            return diffs

    return statistics.median(asyncio.run(measure()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hop-requests", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()

    loaded = load_model("demo", dtype="float32", device="cpu")
    servers = Servers()
    try:
        replicas = []
        for _ in range(args.replicas):
            engine = AsyncEngine(EngineConfig(model="demo", num_blocks=2048), loaded)
            replicas.append(servers.start(create_app(engine, SidecarSettings())))
        proxy = servers.start(create_upstream_app(UpstreamSettings(upstreams=tuple(replicas))))
        requests = workload(args.prompts, args.questions, args.seed)

        results = {}
        for name, targets in (
            ("ideal", replicas[:1]),
            ("round_robin", replicas),
            ("ours", [proxy]),
        ):
            evict(replicas)
            start = time.perf_counter()
            prompt, cached, latencies = asyncio.run(
                run(targets, requests, args.concurrency, f"{name}: requests")
            )
            results[name] = {
                "computed_tokens": prompt - cached,
                "hit_rate": round(cached / prompt, 4),
                "wall_s": round(time.perf_counter() - start, 3),
                "p50_ms": round(statistics.median(latencies) * 1000, 2),
            }
        hop_ms = hop_overhead(proxy, replicas, args.hop_requests) * 1000
    finally:
        servers.close()

    ours, rr, ideal = results["ours"], results["round_robin"], results["ideal"]
    result = {
        "bench": "upstream_routing",
        "replicas": args.replicas,
        "requests": len(requests),
        **{f"{name}_{key}": value for name, r in results.items() for key, value in r.items()},
        "computed_ratio_round_robin_vs_ours": round(
            rr["computed_tokens"] / ours["computed_tokens"], 2
        ),
        "efficiency_vs_ideal": round(ideal["computed_tokens"] / ours["computed_tokens"], 3),
        "proxy_hop_p50_ms": round(hop_ms, 2),
    }
    print(f"{len(requests)} requests, {args.prompts} system prompts, {args.replicas} replicas")
    print(f"{'routing':<14} {'computed tokens':>16} {'hit rate':>9} {'wall s':>8} {'p50 ms':>8}")
    for name in ("ideal", "round_robin", "ours"):
        r = results[name]
        print(
            f"{name:<14} {r['computed_tokens']:>16} {r['hit_rate']:>9.1%} "
            f"{r['wall_s']:>8.2f} {r['p50_ms']:>8.2f}"
        )
    print(
        f"round robin computes {result['computed_ratio_round_robin_vs_ours']}x the tokens ours "
        f"does; ours vs one replica: {result['efficiency_vs_ideal']}; "
        f"the proxy hop adds {hop_ms:.2f} ms p50"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
