"""Soak: `prefixcache serve` under mixed hostile traffic at ~4x its capacity, for N minutes.

The server is a real `prefixcache serve --model demo` subprocess on a loopback port (API keys
for two tenants and an admin, a cache dir, a small waiting queue). The client first measures
the server's capacity (closed loop, completed requests per second), then sends requests
open-loop at 4x that rate for the rest of the time:

- chats and segment prompts of two tenants (shared system prompts, some with a cache_salt),
  completions, streams read to the end, streams dropped after a few chunks, non-streaming
  requests abandoned mid-flight, half-closed clients (request sent, write side shut);
- bad inputs: malformed and deeply nested JSON, wrong types, extreme sampling values, too many
  segments, over-long prompts, bad salts, bad cache file names;
- cache admin: stats, warm and pin, unpin, evict, save and load.

At the end (traffic stopped, in-flight requests drained) it asserts:
no 5xx but 503 during start-up; every 200 finished (non-streaming: a finish reason; streams
read to the end: [DONE]) or was aborted by us; no request failed in the engine
(`prefixcache:request_failure`); 0 blocks in use, nothing running or waiting; the pool
invariant (free + cached_idle + in_use == total, pinned <= cached_idle + in_use); the gauges
equal /v1/cache/stats; the server's RSS (with its engine core's) grew less than
--rss-bound-mib after warm-up.

    .venv/bin/python bench/soak.py --minutes 10 --json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serving import stop_server

from prefixcache.engine.model.progress import progress_bar

KEYS = {
    "admin": {"key": "sk-soak-admin-00001", "tenant": "ops", "admin": True},
    "a": {"key": "sk-soak-tenant-a-001", "tenant": "tenant-a", "admin": False},
    "b": {"key": "sk-soak-tenant-b-001", "tenant": "tenant-b", "admin": False},
}
SYSTEMS = [
    f"You are assistant number {i}. " + "Answer briefly and politely. " * 12 for i in range(4)
]


def auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]['key']}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    """The RSS of ``pid`` and its children (the engine core runs in one), in MiB."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            continue
    return total if total else float("nan")


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


class Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.started_at = 0.0  # when /health first said ok

    def status(self, kind: str, code: int) -> None:
        self.kinds[kind] += 1
        self.statuses[str(code)] += 1
        if code >= 500:
            self.problems.append(f"{kind}: HTTP {code}")

    def problem(self, message: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(message)


def chat_body(rng: random.Random, **extra: Any) -> dict[str, Any]:
    system = rng.choice(SYSTEMS)
    question = f"Question {rng.randrange(10**6)}: what is {rng.randrange(100)} plus 1?"
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": rng.randrange(1, 12),
        "temperature": rng.choice([0, 0, 0.7, 1.0]),
    }
    if rng.random() < 0.3:
        body["cache_salt"] = rng.choice(["s1", "s2"])
    if rng.random() < 0.4:  # the same prompt as tagged segments
        body.pop("messages")
        body["segments"] = [
            {"role": "system", "tag": "sys", "content": system, "stability": "static"},
            {"role": "user", "tag": "q", "content": question},
        ]
    body.update(extra)
    return body


BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x'),
    ("/v1/chat/completions", b'{"messages": [], "metadata": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    ("/v1/chat/completions", json.dumps({"messages": "nope"}).encode()),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "cache_salt": "abc\n"}
        ).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"segments": [{"role": "user", "tag": f"t{i}", "content": "x"} for i in range(2000)]}
        ).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 2}
        ).encode(),
    ),
    ("/v1/completions", json.dumps({"prompt": [10**9], "max_tokens": 2}).encode()),
    ("/v1/cache/save", json.dumps({"name": "../etc/passwd"}).encode()),
]
EXTREME = [
    {"temperature": 1e-300},
    {"temperature": 1, "top_p": 5e-324},
    {"temperature": 1, "repetition_penalty": 1e-300},
    {"temperature": 1e-40, "top_p": 1e-46},
]


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, port: int, tally: Tally
) -> None:
    roll = rng.random()
    who = rng.choice(["a", "b"])
    try:
        if roll < 0.30:  # plain chat, read in full
            extra = rng.choice(EXTREME) if rng.random() < 0.1 else {}
            r = await client.post(
                "/v1/chat/completions", json=chat_body(rng, **extra), headers=auth(who)
            )
            tally.status("chat", r.status_code)
            if r.status_code == 200 and not r.json()["choices"][0]["finish_reason"]:
                tally.problem("a 200 chat without a finish reason")
        elif roll < 0.45:  # a stream read to the end
            await stream(client, rng, who, tally, drop_after=None)
        elif roll < 0.60:  # a stream dropped after a few chunks
            await stream(client, rng, who, tally, drop_after=rng.randrange(0, 3))
        elif roll < 0.68:  # a non-streaming request abandoned mid-flight
            body = chat_body(rng, max_tokens=20)
            with contextlib.suppress(asyncio.TimeoutError):
                r = await asyncio.wait_for(
                    client.post("/v1/chat/completions", json=body, headers=auth(who)),
                    timeout=rng.uniform(0.01, 0.3),
                )
                tally.status("abandoned", r.status_code)
        elif roll < 0.72:  # a half-closed client: must get its whole response
            await half_closed(port, rng, who, tally)
        elif roll < 0.77:  # a completion
            body = {"prompt": f"Count: {rng.randrange(1000)}", "max_tokens": rng.randrange(1, 8)}
            r = await client.post("/v1/completions", json=body, headers=auth(who))
            tally.status("completion", r.status_code)
        elif roll < 0.90:  # bad input
            path, raw = rng.choice(BAD_BODIES)
            headers = {
                **auth("admin" if "cache" in path else who),
                "content-type": "application/json",
            }
            r = await client.post(path, content=raw, headers=headers)
            tally.status("bad", r.status_code)
            if r.status_code < 400:
                tally.problem(f"bad input to {path} answered {r.status_code}")
            elif "error" not in r.json():
                tally.problem(f"bad input to {path}: no OpenAI error shape")
        else:  # cache admin
            await admin_call(client, rng, tally)
    except (httpx.TransportError, OSError) as exc:
        tally.problem(f"transport error: {type(exc).__name__}: {exc}")


async def stream(
    client: httpx.AsyncClient, rng: random.Random, who: str, tally: Tally, drop_after: int | None
) -> None:
    body = chat_body(rng, stream=True, max_tokens=rng.randrange(4, 16))
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(who)) as r:
        tally.status("stream" if drop_after is None else "dropped", r.status_code)
        if r.status_code != 200:
            await r.aread()
            return
        frames = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            frames += 1
            if line == "data: [DONE]":
                done = True
            elif '"error"' in line:
                tally.problem(f"in-band stream error: {line[:200]}")
            if drop_after is not None and frames > drop_after:
                return  # leaving the block closes the connection: the server aborts it
        if not done:
            tally.problem("a stream ended without [DONE]")


async def half_closed(port: int, rng: random.Random, who: str, tally: Tally) -> None:
    body = json.dumps(chat_body(rng, max_tokens=4)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        f"{KEYS[who]['key']}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        "\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    writer.write_eof()
    data = await asyncio.wait_for(reader.read(), timeout=120)
    writer.close()
    data = data.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")  # the server's probe
    code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    tally.status("half_closed", code)
    if code == 0:
        tally.problem("a half-closed client got no response")
    elif code == 200 and b'"finish_reason"' not in data:
        tally.problem("a half-closed client got a partial response")


async def admin_call(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    headers = auth("admin")
    roll = rng.random()
    system = rng.choice(SYSTEMS)
    warm = {"messages": [{"role": "system", "content": system}], "pin": rng.random() < 0.5}
    if roll < 0.3:
        r = await client.get("/v1/cache/stats", headers=headers)
    elif roll < 0.55:
        r = await client.post("/v1/cache/warm", json=warm, headers=headers)
    elif roll < 0.7:
        r = await client.post("/v1/cache/unpin", json=warm, headers=headers)
    elif roll < 0.8:
        r = await client.post(
            "/v1/cache/evict", json={"include_pinned": rng.random() < 0.3}, headers=headers
        )
    elif roll < 0.9:
        r = await client.post("/v1/cache/save", json={"name": "soak"}, headers=headers)
        if r.status_code == 409 and r.json()["error"]["code"] == "nothing_pinned":
            tally.status("admin", 200)  # an evict unpinned everything: keeping the file is right
            return
    else:
        r = await client.post("/v1/cache/load", json={"name": "soak"}, headers=headers)
        if r.status_code == 400 and r.json()["error"]["code"] == "cache_file_refused":
            tally.status("admin", 200)  # nothing saved yet: a 400 is right
            return
    tally.status("admin", r.status_code)
    if r.status_code >= 400 and r.status_code != 429:
        tally.problem(f"admin call answered {r.status_code}: {r.text[:200]}")


async def measure_capacity(client: httpx.AsyncClient, seconds: float) -> float:
    """Completed plain chats per second with 8 clients in a closed loop."""
    rng = random.Random(1)
    done = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            r = await client.post("/v1/chat/completions", json=chat_body(rng), headers=auth("a"))
            done += r.status_code == 200

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(8)))
    return done / (time.monotonic() - started)


async def drive(
    port: int, seconds: float, overload: float, max_in_flight: int, tally: Tally, pid: int
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits
    ) as client:
        calibrate = min(20.0, seconds / 6)
        began, shown = time.monotonic(), 0  # whole seconds on the bar
        bar = progress_bar("soak: calibrate, then overload", int(seconds), unit="s")
        capacity = await measure_capacity(client, calibrate)
        rate = max(1.0, capacity * overload)
        rng = random.Random(7)
        tasks: set[asyncio.Task[None]] = set()
        deadline = time.monotonic() + seconds - calibrate
        warm_rss = None
        warm_at = time.monotonic() + min(60.0, (seconds - calibrate) / 4)
        sent = skipped = 0
        while time.monotonic() < deadline:
            if warm_rss is None and time.monotonic() >= warm_at:
                warm_rss = rss_mib(pid)
            if len(tasks) < max_in_flight:
                task = asyncio.create_task(one_request(client, rng, port, tally))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            else:
                skipped += 1  # the client's own cap: keeps the client from melting down
            await asyncio.sleep(rng.expovariate(rate))
            if (elapsed := int(time.monotonic() - began)) > shown:
                bar.update(elapsed - shown)
                shown = elapsed
        bar.close()
        if tasks:
            await asyncio.wait(tasks, timeout=180)
        return {
            "capacity_rps": round(capacity, 2),
            "offered_rps": round(rate, 2),
            "sent": sent,
            "client_cap_skips": skipped,
            "rss_after_warmup_mib": round(warm_rss or rss_mib(pid), 1),
        }


def final_checks(
    root: str, pid: int, tally: Tally, result: dict[str, Any], rss_bound: float
) -> None:
    headers = auth("admin")
    deadline = time.monotonic() + 60
    while True:  # aborts land on the engine thread a moment after the clients leave
        stats = httpx.get(f"{root}/v1/cache/stats", headers=headers, timeout=30).json()
        text = httpx.get(f"{root}/metrics", timeout=30).text
        idle = (
            stats["blocks"]["in_use"] == 0 and metric(text, "prefixcache:num_requests_running") == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    blocks = stats["blocks"]
    result["final_blocks"] = blocks
    result["rss_end_mib"] = round(rss_mib(pid), 1)
    result["rss_growth_mib"] = round(result["rss_end_mib"] - result["rss_after_warmup_mib"], 1)
    gauges = {
        state: metric(text, "prefixcache:kv_blocks", f'state="{state}"')
        for state in ("in_use", "free", "cached_idle")
    }
    result["gauges"] = gauges
    result["engine_failures"] = metric(text, "prefixcache:request_failure_total")
    result["finished_by_reason"] = {
        reason: metric(text, "prefixcache:request_success_total", f'finished_reason="{reason}"')
        for reason in ("stop", "length", "abort")
    }
    checks = {
        "no_5xx": not any(code.startswith("5") for code in tally.statuses),
        "no_client_problems": not tally.problems,
        "zero_blocks_in_use": blocks["in_use"] == 0,
        "nothing_running_or_waiting": metric(text, "prefixcache:num_requests_running") == 0
        and metric(text, "prefixcache:num_requests_waiting") == 0,
        "pool_invariant": blocks["free"] + blocks["cached_idle"] + blocks["in_use"]
        == blocks["total"]
        and blocks["pinned"] <= blocks["cached_idle"] + blocks["in_use"],
        "gauges_equal_stats": all(gauges[s] == blocks[s] for s in gauges),
        "no_engine_failures": result["engine_failures"] == 0,
        "rss_growth_under_bound": result["rss_growth_mib"] < rss_bound,
        "healthy": httpx.get(f"{root}/health", timeout=10).status_code == 200,
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--overload", type=float, default=4.0, help="offered load / capacity")
    parser.add_argument("--max-in-flight", type=int, default=256, help="client-side cap")
    parser.add_argument("--num-blocks", type=int, default=384)
    parser.add_argument("--queue-limit", type=int, default=32)
    parser.add_argument("--rss-bound-mib", type=float, default=200.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps({"keys": list(KEYS.values())}))
        secret = Path(tmp) / "secret"
        secret.write_bytes(os.urandom(32))
        cmd = [
            sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--model", "demo",
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
            "--attention-backend", "torch", "--num-blocks", str(args.num_blocks),
            "--queue-limit", str(args.queue_limit), "--max-model-len", "2048",
            "--api-keys-file", str(keys), "--secret-file", str(secret),
            "--cache-dir", str(Path(tmp) / "cache"), "--log-level", "error",
        ]  # fmt: skip
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tally = Tally()
        started = time.monotonic()
        try:
            while True:  # start-up: 503 (or no answer yet) is expected here, and only here
                if server.poll() is not None:
                    raise SystemExit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
                with contextlib.suppress(httpx.TransportError):
                    r = httpx.get(f"{root}/health", timeout=5)
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503, r.text
                if time.monotonic() - started > 300:
                    raise SystemExit("the server did not start in 300 s")
                time.sleep(0.2)
            result: dict[str, Any] = {
                "minutes": args.minutes,
                "startup_s": round(time.monotonic() - started, 1),
            }
            result.update(
                asyncio.run(
                    drive(
                        port,
                        args.minutes * 60,
                        args.overload,
                        args.max_in_flight,
                        tally,
                        server.pid,
                    )
                )
            )
            final_checks(root, server.pid, tally, result, args.rss_bound_mib)
            result["statuses"] = dict(sorted(tally.statuses.items()))
            result["kinds"] = dict(sorted(tally.kinds.items()))
            result["problems"] = tally.problems[:20]
        finally:
            stop_server(server)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
