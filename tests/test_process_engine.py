"""``ProcessEngine``: the engine core in its own process behaves as ``AsyncEngine`` does.

Same greedy tokens as the in-process engine, refusals as ValueError, abort frees the blocks,
cache admin round-trips, the core's metrics appear on this side, and a core that dies ends
every stream with an error instead of hanging it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from test_engine_api import check_implements

from prefixcache.engine.api import EngineAPI
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.serving.process_engine import EngineProcessError, ProcessEngine

CONFIG = dict(model="demo", dtype="float32", device="cpu", num_blocks=96)
PREFIX = list(range(10, 90))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(EngineConfig(**CONFIG))


@pytest.fixture
async def engine():
    eng = ProcessEngine(EngineConfig(**CONFIG))
    await eng.start()
    yield eng
    await eng.shutdown()


def test_process_engine_implements_engine_api() -> None:
    check_implements(EngineAPI, ProcessEngine)


async def collect(eng: ProcessEngine, request: EngineRequest) -> tuple[list[int], str, object]:
    tokens, text, final = [], "", None
    async for out in eng.generate(request):
        tokens += out.new_token_ids
        text += out.text_delta
        final = out
    return tokens, text, final


async def test_same_tokens_as_the_in_process_engine(
    engine: ProcessEngine, reference: LLMEngine
) -> None:
    prompts = [PREFIX + [100 + i, 7, 8] for i in range(4)]
    want = reference.generate(prompts, greedy(12))
    got = await asyncio.gather(
        *(collect(engine, EngineRequest(f"r{i}", p, greedy(12))) for i, p in enumerate(prompts))
    )
    for (tokens, text, final), ref in zip(got, want, strict=True):
        assert tokens == ref.token_ids and text == ref.text
        assert final.finished and final.finish_reason == "length"
        assert final.usage.completion_tokens == 12 and final.timing is not None
    assert engine.cache_stats().tokens.hits > 0  # the shared prefix was reused
    assert engine.model_name == "demo" and engine.dtype == "float32"
    assert engine.cache_identity == LLMEngine.cache_identity(reference.loaded)
    assert engine.output_identity == engine.cache_identity  # the default head
    assert engine.tokenizer.encode("hello world") == reference.tokenizer.encode("hello world")
    text = generate_latest(engine.registry).decode()
    assert "prefixcache:generation_tokens_total 48.0" in text
    assert 'prefixcache:model_info{dtype="float32",model="demo"} 1.0' in text


async def test_refused_requests_raise_value_error(engine: ProcessEngine) -> None:
    with pytest.raises(ValueError, match="accepts at most"):
        await collect(engine, EngineRequest("long", [5] * 100_000, greedy(2)))
    with pytest.raises(ValueError, match="token ids must be in"):
        await collect(engine, EngineRequest("bad", [10**9], greedy(2)))
    tokens, _, _ = await collect(engine, EngineRequest("ok", [5, 6, 7], greedy(3)))
    assert len(tokens) == 3  # refusals harmed nothing


async def test_leaving_the_stream_early_aborts_and_frees(engine: ProcessEngine) -> None:
    stream = engine.generate(EngineRequest("gone", PREFIX, greedy(10_000)))
    async for _ in stream:
        break
    await stream.aclose()
    # 60 s bounds a hang only: the token count, not how soon the blocks came back (which a
    # loaded box stretches), tells an abort from a run to the end.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = engine.cache_stats()
        if stats.blocks.in_use == 0 and engine.num_running == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.cache_stats().blocks.in_use == 0
    ran = engine.registry.get_sample_value("prefixcache:generation_tokens_total") or 0.0
    assert ran < 10_000, "not aborted: the request ran for all its tokens"


async def test_cache_admin_round_trips(engine: ProcessEngine, tmp_path: Path) -> None:
    warm = await engine.warm(PREFIX, pin=True)
    assert warm.tokens == len(PREFIX) and warm.pinned_blocks == len(PREFIX) // 16
    assert engine.cache_stats().blocks.pinned == warm.pinned_blocks
    key = b"k" * 32  # cache files are signed (HMAC) with a key from the server secret
    saved = await engine.save_pinned(tmp_path / "p.safetensors", key)
    assert saved.blocks == warm.pinned_blocks
    assert await engine.unpin(PREFIX) == warm.pinned_blocks
    assert await engine.evict_all() > 0
    with pytest.raises(ValueError):
        await engine.load_pinned(tmp_path / "p.safetensors", b"another key")
    loaded = await engine.load_pinned(tmp_path / "p.safetensors", key)
    assert loaded.restored_blocks == warm.pinned_blocks
    with pytest.raises(ValueError):
        await engine.load_pinned(tmp_path / "missing.safetensors", key)
    again = await engine.warm(PREFIX)
    assert again.cached_tokens == len(PREFIX) - 1  # all restored; the last token is computed
    tree = await engine.cache_tree()
    assert sum(tree.pinned) == warm.pinned_blocks  # the dashboard's picture, from the core
    assert engine.error is None
    records = engine.cache_activity()
    assert records and records[-1].cached_tokens == len(PREFIX) - 1
    assert engine.cache_activity(records[-1].seq) == []
    pinned = engine.cache_stats().blocks.pinned
    # A TTL pin (in the core's own process: no clock to move). 2 s, so that a loaded box's
    # stall between the pin and the core's next report cannot lapse it before it is seen.
    ttl = await engine.warm(list(range(200, 264)), pin=True, ttl_s=2.0)
    assert ttl.pinned_blocks == 4 and engine.cache_stats().blocks.pinned == pinned + 4
    await asyncio.sleep(2.2)
    await collect(engine, EngineRequest("tick", [1, 2, 3], greedy(1)))  # a step lifts lapsed pins
    assert engine.cache_stats().blocks.pinned == pinned


async def test_a_dead_core_ends_every_stream(engine: ProcessEngine) -> None:
    stream = engine.generate(EngineRequest("x", PREFIX, greedy(10_000)))
    first = await stream.__anext__()
    assert not first.finished
    assert engine.core_pid is not None
    os.kill(engine.core_pid, signal.SIGKILL)
    last = first
    async for out in stream:
        last = out
    assert last.finished and last.error
    assert not engine.is_ready
    with pytest.raises(EngineProcessError):
        await collect(engine, EngineRequest("y", [1, 2, 3], greedy(2)))


async def test_start_failure_is_reported() -> None:
    eng = ProcessEngine(EngineConfig(model="/nonexistent/model", device="cpu"))
    with pytest.raises(EngineProcessError, match="'/nonexistent/model' not found"):
        await eng.start()  # an EngineStartError: the core's own message, once


@pytest.mark.parametrize("source", ["folder", "gguf", "gguf_broken_weights"])
async def test_the_api_side_keeps_the_tokenizer_built_from_the_spec_sent_ahead(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core sends the tokenizer's spec before it loads the weights; the copy the API side
    builds meanwhile is the one it keeps (Ready's fingerprint agrees): no second build after
    Ready. A load that fails after the spec went ahead is still reported as the core said."""
    model = "demo"
    if source != "folder":
        test_gguf = pytest.importorskip("test_gguf")
        checkpoint = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), True)
        path = tmp_path / "tiny.gguf"
        # broken: the header names a layer more than the file holds (found after the tokenizer)
        layers = test_gguf.LAYERS + (source == "gguf_broken_weights")
        test_gguf.write_gguf(path, checkpoint, test_gguf.Q.Q8_0, layers=layers)
        model = str(path)

    def second_build(ready: object) -> None:
        raise AssertionError("the tokenizer was built again after Ready")

    monkeypatch.setattr(ProcessEngine, "_load_tokenizer", staticmethod(second_build))
    eng = ProcessEngine(EngineConfig(**{**CONFIG, "model": model}))
    if source == "gguf_broken_weights":
        with pytest.raises(EngineProcessError, match="missing tensors"):
            await eng.start()
        return
    await eng.start()
    try:
        assert eng.tokenizer.fingerprint == eng._ready.tokenizer_fingerprint  # type: ignore[union-attr]
        tokens, _, _ = await collect(eng, EngineRequest("t", eng.tokenizer.encode("hi"), greedy(3)))
        assert len(tokens) == 3
    finally:
        await eng.shutdown()


def test_the_api_side_never_imports_torch() -> None:
    """The server process of `prefixcache serve` (process mode) holds no torch: only the core
    process loads the model."""
    code = (
        "import sys\n"
        "import prefixcache.engine.serving.process_engine, prefixcache.sidecar.server.app, prefixcache.sidecar.cli\n"
        "from prefixcache.engine.config import EngineConfig\n"
        "from prefixcache.sidecar.cli.serve_command import create_engine\n"
        "create_engine(EngineConfig(), 'process')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


async def test_kv_events_and_a_disk_tier_run_in_the_core(tmp_path: Path) -> None:
    """The --kv-events-* and --kv-offload flags reach the core: its events are published, a
    spilled prefix comes back from its tier, and shutdown flushes the events and removes the
    tier's file."""
    zmq = pytest.importorskip("zmq")
    from test_kv_events import subscriber

    from prefixcache.sidecar.router.kv_event_wire import BlockRemoved, BlockStored, decode_batch

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    config = EngineConfig(
        **CONFIG,
        kv_events_endpoint=endpoint,
        kv_events_token_ids="all",
        kv_offload=f"disk:{tmp_path}:0.01",
    )
    eng = ProcessEngine(config)
    await eng.start()
    ctx = zmq.Context()
    # PUB/SUB: a subscriber sees only what is sent after it joined (the handshake, not a
    # fixed sleep: test_kv_events.subscriber)
    sub = await asyncio.to_thread(subscriber, ctx, endpoint)
    try:
        assert [p.name for p in tmp_path.iterdir()], "the disk tier's file is missing"
        first, _, _ = await collect(eng, EngineRequest("a", PREFIX, greedy(2)))
        assert await eng.evict_all(keep_tier=True) > 0  # spilled into the tier
        again, _, final = await collect(eng, EngineRequest("b", PREFIX, greedy(2)))
        assert again == first
        assert (
            final.usage.cached_tokens >= 64
            and (final.usage.cached_tokens_by_tier or {}).get("disk", 0) >= 64
        )
    finally:
        await eng.shutdown()
    events = []
    while sub.poll(2000):
        events += decode_batch(sub.recv_multipart()[2]).events
    sub.close(0)
    ctx.term()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].token_ids[:16] == PREFIX[:16]
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert list(tmp_path.iterdir()) == []  # the engine closed its tier
    assert eng.core_pid is None


def test_a_core_whose_parent_is_gone_exits() -> None:
    """The backstop for a server killed while its core loads the model (no pipe reader yet):
    the core notices the parent is gone and exits after a grace period."""
    core = (
        "import sys, prefixcache.engine.serving.core_process as c\n"
        "c.PARENT_GONE_GRACE_S = 0.2\n"
        "c.exit_with_parent(int(sys.argv[1]))\n"
    )
    parent = (
        "import os, subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {core!r}, str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
    )  # exits at once, leaving the child to watch a parent that is gone
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True)
    pid = int(done.stdout)
    deadline = time.monotonic() + 60  # a hang bound: the grace is 0.2 s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) has exited
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def test_under_uvloop_large_messages_keep_the_pipe() -> None:
    """`prefixcache serve` runs on uvloop, which makes a watched fd non-blocking: the pipe
    must stay blocking, or a message larger than the socket buffer is cut (BlockingIOError)
    and the engine is taken for dead."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        eng = ProcessEngine(EngineConfig(**CONFIG))
        await eng.start()
        try:
            for i in range(3):  # an Add of ~600 KB: more than the socket's buffer
                with pytest.raises(ValueError, match="accepts at most"):
                    await collect(eng, EngineRequest(f"long{i}", [300] * 200_000, greedy(2)))
            got = await asyncio.gather(
                *(collect(eng, EngineRequest(f"r{i}", PREFIX, greedy(40))) for i in range(8))
            )
            assert all(len(tokens) == 40 for tokens, _, _ in got)
            assert eng.error is None and eng.is_ready
        finally:
            await eng.shutdown()

    uvloop.run(main())
