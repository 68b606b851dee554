"""KV events: vLLM's wire format, the pool's and the tier's real changes, replay.

The subscriber structs below are written from vLLM 0.32's published schema
(``vllm/distributed/kv_events.py``): an array-like batch whose events are maps tagged by
``type``, the same field order, defaults omitted. They are not imported from our code on
purpose.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import invariant
from test_block_manager_state_machine import BlockManagerMachine

from prefixcache.engine.memory.prefix_tree import Node, root_digest
from prefixcache.engine.observability.kv_events import (
    BlockEventRecorder,
    KVEventPublisher,
    block_hash,
)
from prefixcache.sidecar.router.kv_event_wire import decode_batch
from prefixcache.sidecar.router.kv_index import ReplicaIndex

zmq = pytest.importorskip("zmq")


# --- vLLM 0.32's schema --------------------------------------------------------------------


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


# Older vLLM (and its example subscriber): the events array-like too.
class OKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OBlockStored(OKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OBlockRemoved(OKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class OAllBlocksCleared(OKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OBlockStored | OBlockRemoved | OAllBlocksCleared]


V_DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rebuilt:
    """A subscriber's view: (block hash, medium) -> (parent hash, token ids), from
    vLLM-schema events (a BlockRemoved takes its own medium away)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[Any, str | None], tuple[Any, tuple[int, ...]]] = {}

    def apply(self, batch: VKVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, VBlockStored):
                parent = event.parent_block_hash
                bs = event.block_size
                for i, h in enumerate(event.block_hashes):
                    key = (h, event.medium)
                    assert key not in self.blocks, "stored twice without a removal"
                    tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
                    self.blocks[key] = (parent, tokens)
                    parent = h
            elif isinstance(event, VBlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[(h, event.medium)]  # KeyError: never stored there
            else:
                self.blocks.clear()

    def medium(self, medium: str) -> dict[Any, tuple[Any, tuple[int, ...]]]:
        return {h: v for (h, m), v in self.blocks.items() if m == medium}


def tree_blocks(nodes: list[Node]) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    out = {}
    for node in nodes:
        parent = None if node.parent is None else block_hash(node.parent.digest)
        tokens = tuple(memoryview(node.tokens).cast("I").tolist())
        out[block_hash(node.digest)] = (parent, tokens)
    return out


def tier_blocks(tier: Any, roots: set[bytes]) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    """The host tier's entries as a subscriber sees them: hash -> (parent hash, tokens)."""
    return {
        block_hash(digest): (
            None if entry.parent in roots else block_hash(entry.parent),
            tuple(memoryview(entry.tokens).cast("I").tolist()),
        )
        for digest, entry in tier._entries.items()
    }


def tree_paths(nodes: list[Node]) -> set[tuple[int, ...]]:
    paths = set()
    for node in nodes:
        blocks = [memoryview(n.tokens).cast("I").tolist() for n in node.path_up()]
        paths.add(tuple(t for block in reversed(blocks) for t in block))
    return paths


# --- the pool's changes, step by step -----------------------------------------------------


class EventedMachine(BlockManagerMachine):
    """The block manager state machine, with a subscriber rebuilding the tree from events."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = BlockEventRecorder(self.bm.block_size, "all")
        self.bm.listener = self.recorder
        self.rebuilt = Rebuilt()
        self.index = ReplicaIndex()
        self.encoder = msgspec.msgpack.Encoder()

    @invariant()
    def events_rebuild_the_tree(self) -> None:
        from prefixcache.engine.observability.kv_events import EventBatch

        events = self.recorder.drain()
        payload = self.encoder.encode(EventBatch(time.time(), events))
        self.rebuilt.apply(V_DECODER.decode(payload))
        self.index.apply(decode_batch(payload).events)
        nodes = self.bm._tree.nodes()
        assert self.rebuilt.medium("GPU") == tree_blocks(nodes)
        assert self.rebuilt.medium("CPU") == tier_blocks(self.tier, set(self.bm._roots.values()))
        assert {m for _, m in self.rebuilt.blocks} <= {"GPU", "CPU"}
        assert self.index.cached_paths("GPU") == tree_paths(nodes)
        held = {block_hash(n.digest) for n in nodes} | {block_hash(d) for d in self.tier._entries}
        assert len(self.index) == len(held)
        for node in nodes:  # a pool block is matched, and served by the pool
            path = tree_paths([node]).pop()
            match = self.index.match_by_medium(path)
            assert match.tokens == len(path) and match.by_medium == {"GPU": len(path)}


TestEventedMachine = EventedMachine.TestCase
TestEventedMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_token_ids_follow_the_policy() -> None:
    from prefixcache.engine.memory.block_manager import BlockManager

    policies: list[tuple[Any, set[str]]] = [
        (frozenset(), set()),
        (frozenset({root_digest(b"id", "tenant")}), {"tenant"}),
        ("all", {"", "tenant"}),
    ]
    for roots, shown in policies:
        bm = BlockManager(16, 4, b"id")
        recorder = BlockEventRecorder(4, roots)
        bm.listener = recorder
        for ns in ("", "tenant"):
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
            table = bm.allocate(prompt, ns, bm.match(prompt, ns, 8), 9)
            bm.commit(table, prompt, 9)
            (event,) = recorder.drain()
            assert event.block_hashes == [block_hash(d) for d in bm.block_hashes(prompt, ns)]
            assert event.token_ids == (prompt[:8] if ns in shown else [])
    # the same tokens in two namespaces never share a hash
    assert set(bm.block_hashes(prompt, "")).isdisjoint(bm.block_hashes(prompt, "tenant"))


# --- over ZMQ -----------------------------------------------------------------------------


def recv_batches(sub: Any, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
    """The batches that arrive: the first within ``timeout_ms`` (a hang bound), each next one
    within a second of the last (the publisher's thread sends them in a burst; a second is
    slack for a loaded box)."""
    out = []
    while sub.poll(timeout_ms):
        _topic, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), payload))
        timeout_ms = 1000
    return out


def subscriber(ctx: Any, endpoint: str) -> Any:
    """A SUB socket on ``endpoint``, returned once it has joined. PUB/SUB delivers only what is
    sent after the subscription reached the publisher; a fixed sleep made that so on an idle
    box only. This waits for the ZMTP handshake (30 s bounds a hang), then 0.3 s more for the
    subscription, the first message after it, to cross."""
    from zmq.utils.monitor import recv_monitor_message

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(30_000), f"no ZMTP handshake with {endpoint} in 30 s"
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(0)
    time.sleep(0.3)
    return sub


def sent_through(publisher: KVEventPublisher, seq: int, timeout: float = 30) -> None:
    """Until the publisher's thread has sent batch ``seq`` (it keeps what it sent for replay):
    what a subscriber joining after this must not see."""
    deadline = time.monotonic() + timeout
    while not (publisher._buffer and publisher._buffer[-1][0] >= seq):
        assert time.monotonic() < deadline, f"batch {seq} not sent in {timeout} s"
        time.sleep(0.01)


def test_an_engine_stream_decodes_with_vllms_schema() -> None:
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import SamplingParams

    port, replay_port = free_port(), free_port()
    config = EngineConfig(
        num_blocks=64,
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        kv_events_token_ids="all",
    )
    engine = LLMEngine(config)
    ctx = zmq.Context()
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")  # joined: sees what is sent from now on
    try:
        prompt = list(range(5, 5 + 40))
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        engine.evict_all()
        got = recv_batches(sub)
        assert got, "no event batch arrived"
        seqs = [seq for seq, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        rebuilt = Rebuilt()
        for _, payload in got:
            batch = V_DECODER.decode(payload)
            rebuilt.apply(batch)
            assert batch.data_parallel_rank == 0
        stored = [
            e for _, p in got for e in V_DECODER.decode(p).events if isinstance(e, VBlockStored)
        ]
        assert stored[0].parent_block_hash is None
        assert stored[0].token_ids[:32] == prompt[:32] and stored[0].block_size == 16
        assert {e.medium for e in stored} == {"GPU"}  # the engine's own pool, on any device
        assert rebuilt.blocks == {}  # everything stored was removed again by evict_all
    finally:
        sub.close(0)
        ctx.term()
        engine.close()


def test_replay_after_a_dropped_subscriber_fills_the_gap() -> None:
    from prefixcache.engine.memory.block_manager import BlockManager

    port, replay_port = free_port(), free_port()
    bm = BlockManager(64, 4, b"id")
    recorder = BlockEventRecorder(4, "all")
    bm.listener = recorder
    publisher = KVEventPublisher(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv"
    )
    ctx = zmq.Context()

    def cache(prompt: list[int]) -> None:
        table = bm.allocate(prompt, "", bm.match(prompt, "", len(prompt) - 1), len(prompt))
        bm.commit(table, prompt, len(prompt))
        bm.free(table)
        publisher.publish(recorder.drain())

    try:
        recorder.all_cleared()
        publisher.publish(recorder.drain())
        sent_through(publisher, 0)  # batch 0 is sent before anyone subscribes
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
        rebuilt = Rebuilt()
        cache([1, 2, 3, 4, 5, 6, 7, 8, 9])
        first = recv_batches(sub)
        assert [seq for seq, _ in first] == [1]
        for _, payload in first:
            rebuilt.apply(V_DECODER.decode(payload))
        sub.close(0)  # the subscriber drops out; the cache changes meanwhile
        cache([1, 2, 3, 4, 50, 60, 70, 80, 90])
        bm.evict_all()
        sent_through(publisher, publisher.publish(recorder.drain()))  # 2 and 3: while away
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
        cache([7, 7, 7, 7, 8])
        (live,) = recv_batches(sub)
        assert live[0] == 4  # batches 2 and 3 are missing
        replay = ctx.socket(zmq.REQ)  # as vLLM's example subscriber asks
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send((1 + 1).to_bytes(8, "big"))
        topic, seq_bytes, payload = replay.recv_multipart()  # vLLM 0.32's replay frames
        replay.close(0)
        assert topic == b"kv"
        assert int.from_bytes(seq_bytes, "big") == 2  # REQ reads the first reply only
        dealer = ctx.socket(zmq.DEALER)  # a DEALER reads the whole replay
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            _, topic, seq_bytes, payload = dealer.recv_multipart()
            if not payload:
                assert topic == b"" and int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(0)
        assert [seq for seq, _ in replayed] == [2, 3, 4]
        for seq, payload in replayed:
            if seq < live[0]:
                rebuilt.apply(V_DECODER.decode(payload))
        rebuilt.apply(V_DECODER.decode(live[1]))
        assert rebuilt.medium("GPU") == tree_blocks(bm._tree.nodes())
        assert rebuilt.blocks  # the last prompt's block is cached
        sub.close(0)
    finally:
        publisher.close()
        ctx.term()


def test_a_full_queue_drops_a_batch_and_leaves_a_gap_in_the_numbers() -> None:
    port = free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", max_queue=1)
    try:
        # The thread may take the first batch at once; keep publishing until one drops.
        seqs = [publisher.publish([]) for _ in range(2000)]
        assert seqs == list(range(2000))
        assert publisher.num_dropped > 0
    finally:
        publisher.close()


# --- tier moves -----------------------------------------------------------------------------


def tiered_manager(kind: str, slots: int, tmp_path: Any) -> Any:
    from test_kv_tier import Pages

    from prefixcache.engine.memory.block_manager import BlockManager
    from prefixcache.engine.memory.kv_tier import DiskSlots, HostSlots, KVTier

    pages = Pages(8)
    storage = (
        HostSlots(slots, Pages.bytes_per_block, False)
        if kind == "host"
        else DiskSlots(slots, Pages.bytes_per_block, str(tmp_path), keep=False)
    )
    return BlockManager(8, 4, b"id", tier=KVTier(storage, pages, writer=False))


def stream(recorder: BlockEventRecorder) -> list[Any]:
    from prefixcache.engine.observability.kv_events import EventBatch

    payload = msgspec.msgpack.encode(EventBatch(1.0, recorder.drain()))
    return V_DECODER.decode(payload).events


@pytest.mark.parametrize(("kind", "medium"), [("host", "CPU"), ("disk", "STORAGE")])
def test_a_spill_is_stored_below_and_removed_from_the_pool_and_a_tier_drop_removed(
    kind: str, medium: str, tmp_path: Any
) -> None:
    bm = tiered_manager(kind, slots=2, tmp_path=tmp_path)
    recorder = BlockEventRecorder(4, "all")
    bm.listener = recorder
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table = bm.allocate(prompt, "", bm.match(prompt, "", 8), 9)
    bm.commit(table, prompt, 9)
    bm.free(table)
    hashes = [block_hash(d) for d in bm.block_hashes(prompt, "")]
    (stored,) = stream(recorder)
    assert (stored.block_hashes, stored.medium) == (hashes, "GPU")
    bm.evict_all(keep_tier=True)  # both blocks spill: the deeper first
    events = stream(recorder)
    got = [(type(e).__name__, e.medium, e.block_hashes) for e in events]
    assert got == [
        ("VBlockStored", medium, [hashes[1]]),
        ("VBlockRemoved", "GPU", [hashes[1]]),
        ("VBlockStored", medium, [hashes[0]]),
        ("VBlockRemoved", "GPU", [hashes[0]]),
    ]
    assert events[0].parent_block_hash == hashes[0] and events[0].token_ids == [5, 6, 7, 8]
    assert events[2].parent_block_hash is None and events[2].token_ids == [1, 2, 3, 4]
    index = ReplicaIndex()
    index.apply(decode_batch(msgspec.msgpack.encode(VKVEventBatch(1.0, [stored]))).events)
    index.apply(decode_batch(msgspec.msgpack.encode(VKVEventBatch(1.0, events))).events)
    match = index.match_by_medium(prompt)
    assert (match.tokens, match.by_medium) == (8, {medium: 8})  # still cached, one level down
    # a reload brings them back into the pool: stored there again, still held below
    table = bm.allocate(prompt, "", bm.match(prompt, "", 8), 9)
    assert table.num_reloaded_tokens == 8
    bm.free(table)
    reloaded = stream(recorder)
    assert [(type(e).__name__, e.medium) for e in reloaded] == [("VBlockStored", "GPU")]
    # the tier's LRU makes room for other blocks: its drops are removals in its medium
    other = [9, 9, 9, 9, 8, 8, 8, 8, 7]
    table = bm.allocate(other, "", bm.match(other, "", 8), 9)
    bm.commit(table, other, 9)
    bm.free(table)
    bm.evict_all(keep_tier=True)
    moves = stream(recorder)
    dropped = [h for e in moves if isinstance(e, VBlockRemoved) and e.medium == medium
               for h in e.block_hashes]  # fmt: skip
    assert sorted(dropped) == sorted(hashes)
    bm.tier.clear()  # type: ignore[union-attr]
    cleared = stream(recorder)
    assert {(type(e).__name__, e.medium) for e in cleared} == {("VBlockRemoved", medium)}
    assert bm.tier is not None and len(bm.tier) == 0
    bm.tier.close()


def test_an_engine_with_a_host_tier_publishes_its_spills_over_zmq() -> None:
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import SamplingParams

    port = free_port()
    config = EngineConfig(
        num_blocks=8,
        kv_offload="host:0.05",
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_token_ids="all",
    )
    engine = LLMEngine(config)
    ctx = zmq.Context()
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
    try:
        first, second = list(range(5, 5 + 96)), list(range(900, 900 + 96))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        engine.generate([first], params)
        engine.generate([second], params)  # 6 + 6 blocks in a pool of 8: the first spills
        rebuilt, index = Rebuilt(), ReplicaIndex()  # a vLLM-schema subscriber; the router
        for _, payload in recv_batches(sub):
            rebuilt.apply(V_DECODER.decode(payload))
            index.apply(decode_batch(payload).events)
        manager = engine.block_manager
        assert manager.tier is not None
        spilled = {block_hash(d) for d in manager.tier._entries}
        assert spilled and set(rebuilt.medium("CPU")) == spilled
        assert set(rebuilt.medium("GPU")) == {block_hash(n.digest) for n in manager._tree.nodes()}
        assert {t for _, tokens in rebuilt.medium("CPU").values() for t in tokens} <= set(first)
        held = index.match_by_medium(first)  # the first prompt is still cached, one level down
        assert held.by_medium.get("CPU", 0) > 0 and held.tokens == sum(held.by_medium.values())
    finally:
        sub.close(0)
        ctx.term()
        engine.close()


def test_tier_stores_follow_the_token_policy() -> None:
    bm = tiered_manager("host", slots=4, tmp_path=None)
    shown = frozenset({root_digest(b"id", "tenant")})
    recorder = BlockEventRecorder(4, shown)
    bm.listener = recorder
    for ns in ("", "tenant"):
        prompt = [1, 2, 3, 4, 5]
        table = bm.allocate(prompt, ns, bm.match(prompt, ns, 4), 5)
        bm.commit(table, prompt, 5)
        bm.free(table)
    recorder.drain()
    bm.evict_all(keep_tier=True)
    spills = [e for e in stream(recorder) if isinstance(e, VBlockStored)]
    assert sorted(e.token_ids for e in spills) == [[], [1, 2, 3, 4]]
    assert {e.medium for e in spills} == {"CPU"}


def test_the_router_decodes_every_form_vllm_has_published() -> None:
    stored = dict(block_hashes=[5, 6], parent_block_hash=None, token_ids=[1] * 8, block_size=4)
    current = VKVEventBatch(
        2.0,
        [
            VBlockStored(**stored, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
            VBlockRemoved([6], "GPU"),
            VAllBlocksCleared(),
        ],
    )
    older = OKVEventBatch(
        2.0, [OBlockStored(**stored, lora_id=None, medium="GPU"), OBlockRemoved([6], "GPU"),
              OAllBlocksCleared()],
    )  # fmt: skip
    as_map = msgspec.json.decode(msgspec.json.encode(current))  # vLLM 0.32's events ...
    all_maps = {"ts": 2.0, "events": as_map[1]}  # ... in a map batch too
    from prefixcache.sidecar.router import kv_event_wire as w

    kinds = (w.BlockStored, w.BlockRemoved, w.AllBlocksCleared)
    seen = []
    for wire_payload in (
        msgspec.msgpack.encode(current),
        msgspec.msgpack.encode(older),
        msgspec.msgpack.encode(all_maps),
    ):
        batch = decode_batch(wire_payload)
        assert batch.ts == 2.0
        seen.append(
            [
                (next(k.__name__ for k in kinds if isinstance(e, k)), getattr(e, "medium", None))
                for e in batch.events
            ]
        )
        stored_event = batch.events[0]
        assert isinstance(stored_event, w.BlockStored)
        assert (stored_event.block_hashes, stored_event.token_ids) == ([5, 6], [1] * 8)
    assert seen[0] == seen[1] == seen[2]
    assert seen[0] == [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("AllBlocksCleared", None)]
