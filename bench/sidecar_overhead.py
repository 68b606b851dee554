"""What the HTTP sidecar adds on top of the engine, and how it holds 200 concurrent streams.

One engine, with the sidecar served by uvicorn on a background event loop. The same chat
requests go, in rotating order,
1. directly to the engine (pre-tokenized, timed inside the engine's event loop), twice: the
   second copy is an A/A control that shows how noisy a paired difference is here,
2. to the sidecar app as a plain ASGI call in that loop (validation, template rendering,
   tokenization, admission, JSON; no HTTP transport),
3. through HTTP from a minimal keep-alive HTTP/1.1 client in its own process (adds uvicorn's
   parser, the loopback sockets and a client that costs next to nothing itself), and
4. the same through httpx (what the SDK uses; httpx's own request building and parsing,
   about 1.5 ms a request here, counts as added too).

Two measures of "added":
- outside the engine: every response says how long the engine held the request (the last
  output's timing; the sidecar's Server-Timing header). Per request, total minus that span is
  the time spent outside the engine; added = its median minus the direct path's. Engine
  compute jitter (several ms on 2 cores) drops out, so this resolves tenths of a millisecond.
  Target: <= 2 ms at p50 on path 3 (what the sidecar and the wire add, not a client library).
- end to end: the median of paired differences to path 1. It also counts any slowdown the
  server's thread causes the engine, but its noise (see the A/A row) is about +-1 ms.
Then N concurrent streaming requests through HTTP (httpx): throughput, errors.

    .venv/bin/python bench/sidecar_overhead.py [--requests 150] [--streams 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection

import httpx
import uvicorn

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.model.progress import progress_bar, progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.serving.async_engine import AsyncEngine
from prefixcache.sidecar.chat.rendering import PromptRenderer
from prefixcache.sidecar.server.app import create_app

SYSTEM = "You are a concise assistant for a train timetable service. " * 12


def messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"When does train {i % 8} leave?"},
    ]


def chat_body(i: int, max_tokens: int) -> dict:
    return {"messages": messages(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


Timed = tuple[float, float]  # (seconds end to end, seconds the engine held the request)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Bench:
    """The engine and the sidecar on one background loop; requests from the main thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = AsyncEngine(
            EngineConfig(model=args.model, kv_memory_bytes=args.kv_memory_mib * 1024**2)
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self.app = create_app(self.engine)
        config = uvicorn.Config(self.app, log_level="error", access_log=False)
        self.server = uvicorn.Server(config)
        self.serving = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=[sock]), self.loop
        )
        deadline = time.monotonic() + 300
        while not self.engine.is_ready:
            if self.serving.done() or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start")
            time.sleep(0.1)
        renderer = PromptRenderer(self.engine.tokenizer)
        self.prompts = [renderer.render_messages(messages(i)).token_ids for i in range(8)]

    def close(self) -> None:
        self.server.should_exit = True
        self.serving.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def direct(self, i: int) -> Timed:
        async def timed() -> Timed:
            request = EngineRequest(
                f"direct-{i}-{time.perf_counter_ns()}",
                self.prompts[i % 8],
                SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True),
            )
            start = time.perf_counter()
            async for out in self.engine.generate(request):
                last = out
            elapsed = time.perf_counter() - start
            assert last.timing is not None
            return elapsed, last.timing.engine_seconds

        return asyncio.run_coroutine_threadsafe(timed(), self.loop).result()

    def asgi(self, i: int) -> Timed:
        """The sidecar app called as ASGI in its own loop: everything but the HTTP transport."""
        body = json.dumps(chat_body(i, self.args.max_tokens)).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }

        async def timed() -> Timed:
            finished = asyncio.Event()
            pending = [{"type": "http.request", "body": body, "more_body": False}]
            statuses = []
            headers: dict[bytes, bytes] = {}

            async def receive() -> dict:
                if pending:
                    return pending.pop()
                await finished.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])
                    headers.update(message["headers"])

            start = time.perf_counter()
            await self.app(scope, receive, send)
            elapsed = time.perf_counter() - start
            finished.set()
            assert statuses == [200], statuses
            return elapsed, engine_seconds(headers[b"server-timing"].decode())

        return asyncio.run_coroutine_threadsafe(timed(), self.loop).result()

    def latencies(self, client: Connection) -> dict[str, list[Timed]]:
        def http(i: int) -> Timed:
            client.send(("one", i))
            return client.recv()

        def via_httpx(i: int) -> Timed:
            client.send(("httpx", i))
            return client.recv()

        paths = {
            "direct": self.direct,
            "direct_again": self.direct,
            "asgi": self.asgi,
            "http": http,
            "httpx": via_httpx,
        }
        names = list(paths)
        timings: dict[str, list[Timed]] = {name: [] for name in names}
        rounds = range(self.args.warmup + self.args.requests)
        for i in progress_iter(rounds, f"request rounds over {len(names)} paths"):
            k = i % len(names)
            order = names[k:] + names[:k]  # rotate which path goes first
            for name in order:
                elapsed = paths[name](i)
                if i >= self.args.warmup:
                    timings[name].append(elapsed)
        return timings


def engine_seconds(server_timing: str) -> float:
    """The engine's span of a request, from the sidecar's Server-Timing header."""
    for metric in server_timing.split(","):
        name, _, duration = metric.strip().partition(";dur=")
        if name == "engine":
            return float(duration) / 1000.0
    raise ValueError(f"no engine span in Server-Timing: {server_timing!r}")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop `prefixcache serve` runs on: uvicorn picks uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class MinimalClient:
    """HTTP/1.1 over one keep-alive socket, for Content-Length responses: the wire, no library."""

    def __init__(self, base: str) -> None:
        host, port = base.split("//")[1].split("/")[0].split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def request(self, method: str, path: str, body: bytes = b"") -> dict[bytes, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nhost: bench\r\ncontent-length: {len(body)}\r\n"
        if body:
            head += "content-type: application/json\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)
        status = self.reader.readline()
        headers = {}
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        payload = self.reader.read(int(headers.get(b"content-length", 0)))
        if status.split()[1:2] != [b"200"]:
            raise RuntimeError(f"{method} {path}: {status!r} {payload[:200]!r}")
        return headers

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def client_process(conn: Connection, base: str, args: argparse.Namespace) -> None:
    """The HTTP clients, in their own process so that they never compete for our GIL."""
    minimal = MinimalClient(base)
    with httpx.Client(base_url=base, timeout=120) as client:
        while True:
            command, i = conn.recv()
            if command == "stop":
                minimal.close()
                return
            if command == "streams":
                conn.send(asyncio.run(concurrent_streams(base, args)))
                continue
            if command == "floor":  # GET /health: the wire and uvicorn by themselves
                floors = {}
                for name in ("http", "httpx"):
                    times = []
                    for _ in range(i):
                        start = time.perf_counter()
                        if name == "http":
                            minimal.request("GET", "/health")
                        else:
                            client.get(base.removesuffix("/v1") + "/health").raise_for_status()
                        times.append(time.perf_counter() - start)
                    floors[name] = statistics.median(times)
                conn.send(floors)
                continue
            start = time.perf_counter()
            if command == "one":
                body = json.dumps(chat_body(i, args.max_tokens)).encode()
                headers = minimal.request("POST", "/v1/chat/completions", body)
                elapsed = time.perf_counter() - start
                conn.send((elapsed, engine_seconds(headers[b"server-timing"].decode())))
            else:
                response = client.post("/chat/completions", json=chat_body(i, args.max_tokens))
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                conn.send((elapsed, engine_seconds(response.headers["server-timing"])))


async def concurrent_streams(base: str, args: argparse.Namespace) -> dict:
    errors: list[str] = []
    tokens = 0
    bar = progress_bar("concurrent streams finished", args.streams)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {
            "messages": messages(i),
            "max_tokens": args.stream_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    errors.append(f"HTTP {response.status_code}")
                    return
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors.append(chunk["error"]["message"])
                        elif chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]
                if not done:
                    errors.append("stream ended without [DONE]")
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
        finally:
            bar.update()

    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(args.streams)))
        wall = time.perf_counter() - start
    bar.close()
    return {
        "streams": args.streams,
        "stream_errors": len(errors),
        "stream_error_kinds": sorted(set(errors))[:5],
        "stream_wall_s": round(wall, 3),
        "stream_tokens_per_s": round(tokens / wall, 1),
        "stream_requests_per_s": round(args.streams / wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=150, help="timed requests per path")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=16)
    parser.add_argument("--kv-memory-mib", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()

    bench = Bench(args)
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    client = multiprocessing.get_context("spawn").Process(
        target=client_process, args=(theirs, bench.base, args), daemon=True
    )
    client.start()
    try:
        timings = bench.latencies(ours)
        ours.send(("floor", args.requests))
        floor = ours.recv()
        streams = {}
        if args.streams:
            ours.send(("streams", 0))
            streams = ours.recv()
        ours.send(("stop", 0))
        client.join(30)
    finally:
        if client.is_alive():
            client.kill()
        bench.close()

    result = summarize(args, timings, floor)
    result.update(streams)
    result["meets_target"] = (
        result["http_added_outside_engine_p50_ms"] <= 2.0 and result.get("stream_errors", 0) == 0
    )
    print_table(result)
    if streams:
        print(
            f"{args.streams} concurrent streams: {streams['stream_wall_s']:.2f} s, "
            f"{streams['stream_tokens_per_s']:.0f} tokens/s, "
            f"{streams['stream_requests_per_s']:.1f} requests/s, "
            f"{streams['stream_errors']} errors"
        )
    if args.json:
        print(json.dumps(result))


def summarize(
    args: argparse.Namespace, timings: dict[str, list[Timed]], floor: dict[str, float]
) -> dict:
    result: dict = {"bench": "sidecar_overhead", "requests": args.requests}
    result["max_tokens"] = args.max_tokens
    direct_total = [total for total, _ in timings["direct"]]
    direct_outside = [total - engine for total, engine in timings["direct"]]
    for name, values in timings.items():
        totals = [total for total, _ in values]
        outside = [total - engine for total, engine in values]
        result[f"{name}_p50_ms"] = ms(statistics.median(totals))
        result[f"{name}_p99_ms"] = ms(percentile(totals, 0.99))
        result[f"{name}_outside_engine_p50_ms"] = ms(statistics.median(outside))
        if name == "direct":
            continue
        # median of paired differences: the engine's jitter hits both sides of a pair
        paired = [t - d for t, d in zip(totals, direct_total, strict=True)]
        result[f"{name}_added_p50_ms"] = ms(statistics.median(paired))
        result[f"{name}_added_outside_engine_p50_ms"] = ms(
            statistics.median(outside) - statistics.median(direct_outside)
        )
        result[f"{name}_added_outside_engine_p99_ms"] = ms(
            percentile(outside, 0.99) - percentile(direct_outside, 0.99)
        )
    result["http_floor_p50_ms"] = ms(floor["http"])
    result["httpx_floor_p50_ms"] = ms(floor["httpx"])
    result["ratio_p50_http_vs_direct"] = round(result["http_p50_ms"] / result["direct_p50_ms"], 3)
    result["target_added_p50_ms"] = 2.0
    return result


def print_table(result: dict) -> None:
    print(
        f"{'path':<34} {'p50 ms':>8} {'p99 ms':>8} {'outside engine':>15} "
        f"{'added p50':>10} {'added p99':>10} {'end-to-end added p50':>21}"
    )
    rows = [
        ("direct to the engine", "direct"),
        ("direct again (A/A noise control)", "direct_again"),
        ("sidecar app, no HTTP (ASGI call)", "asgi"),
        ("through HTTP (minimal client)", "http"),
        ("through HTTP (httpx client)", "httpx"),
    ]
    for label, name in rows:
        line = (
            f"{label:<34} {result[f'{name}_p50_ms']:>8.2f} {result[f'{name}_p99_ms']:>8.2f} "
            f"{result[f'{name}_outside_engine_p50_ms']:>15.2f}"
        )
        if name != "direct":
            line += (
                f" {result[f'{name}_added_outside_engine_p50_ms']:>10.2f}"
                f" {result[f'{name}_added_outside_engine_p99_ms']:>10.2f}"
                f" {result[f'{name}_added_p50_ms']:>21.2f}"
            )
        print(line)
    print(
        f"bare GET /health round trip: {result['http_floor_p50_ms']:.2f} ms minimal client, "
        f"{result['httpx_floor_p50_ms']:.2f} ms httpx; HTTP/direct p50 ratio "
        f"{result['ratio_p50_http_vs_direct']:.3f}; target: added p50 <= 2 ms "
        "(outside the engine, minimal client)"
    )


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


if __name__ == "__main__":
    main()
