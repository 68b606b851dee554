"""KV events: vLLM's wire format, the pool's real changes, replay.

The subscriber structs below are written from vLLM's published schema
(``vllm/distributed/kv_events.py``, ``examples/online_serving/kv_events_subscriber.py``): same
field order, same tags, array-like. They are not imported from our code on purpose.
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

from prefixcache.engine.kv_events import BlockEventRecorder, KVEventPublisher, block_hash
from prefixcache.engine.prefix_tree import Node, root_digest
from prefixcache.sidecar.kv_event_wire import decode_batch
from prefixcache.sidecar.kv_index import ReplicaIndex

zmq = pytest.importorskip("zmq")


# --- vLLM's schema, as its example subscriber declares it ---------------------------------


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


# The newer schema: EventBatch gains data_parallel_rank, BlockStored lora_name and more.
class NBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class NKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[NBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


V_DECODER = msgspec.msgpack.Decoder(VKVEventBatch)
N_DECODER = msgspec.msgpack.Decoder(NKVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rebuilt:
    """A subscriber's view: block hash -> (parent hash, token ids), from vLLM-schema events."""

    def __init__(self) -> None:
        self.blocks: dict[Any, tuple[Any, tuple[int, ...]]] = {}

    def apply(self, batch: VKVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, VBlockStored):
                parent = event.parent_block_hash
                bs = event.block_size
                for i, h in enumerate(event.block_hashes):
                    assert h not in self.blocks, "stored twice without a removal"
                    tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
                    self.blocks[h] = (parent, tokens)
                    parent = h
            elif isinstance(event, VBlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[h]  # KeyError: removal of a block never stored
            else:
                self.blocks.clear()


def tree_blocks(nodes: list[Node]) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    out = {}
    for node in nodes:
        parent = None if node.parent is None else block_hash(node.parent.digest)
        tokens = tuple(memoryview(node.tokens).cast("I").tolist())
        out[block_hash(node.digest)] = (parent, tokens)
    return out


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
        from prefixcache.engine.kv_events import EventBatch

        events = self.recorder.drain()
        payload = self.encoder.encode(EventBatch(time.time(), events))
        self.rebuilt.apply(V_DECODER.decode(payload))
        self.index.apply(decode_batch(payload).events)
        nodes = self.bm._tree.nodes()
        assert self.rebuilt.blocks == tree_blocks(nodes)
        assert self.index.cached_paths() == tree_paths(nodes)
        assert len(self.index) == len(nodes)


TestEventedMachine = EventedMachine.TestCase
TestEventedMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_token_ids_follow_the_policy() -> None:
    from prefixcache.engine.block_manager import BlockManager

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


def recv_batches(sub: Any, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    out = []
    while sub.poll(timeout_ms):
        _topic, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), payload))
        timeout_ms = 300
    return out


def subscriber(ctx: Any, endpoint: str) -> Any:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


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
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # PUB/SUB: a subscriber sees only what is sent after it joined
        prompt = list(range(5, 5 + 40))
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        engine.evict_all()
        got = recv_batches(sub)
        assert got, "no event batch arrived"
        seqs = [seq for seq, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        rebuilt = Rebuilt()
        for _, payload in got:
            rebuilt.apply(V_DECODER.decode(payload))
            newer = N_DECODER.decode(payload)
            assert newer.data_parallel_rank == 0
        stored = [
            e for _, p in got for e in V_DECODER.decode(p).events if isinstance(e, VBlockStored)
        ]
        assert stored[0].parent_block_hash is None
        assert stored[0].token_ids[:32] == prompt[:32] and stored[0].block_size == 16
        assert {e.medium for e in stored} == {"CPU"}
        assert rebuilt.blocks == {}  # everything stored was removed again by evict_all
    finally:
        sub.close(0)
        ctx.term()
        engine.close()


def test_replay_after_a_dropped_subscriber_fills_the_gap() -> None:
    from prefixcache.engine.block_manager import BlockManager

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
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        rebuilt = Rebuilt()
        cache([1, 2, 3, 4, 5, 6, 7, 8, 9])
        first = recv_batches(sub)
        assert [seq for seq, _ in first] == [1]
        for _, payload in first:
            rebuilt.apply(V_DECODER.decode(payload))
        sub.close(0)  # the subscriber drops out; the cache changes meanwhile
        cache([1, 2, 3, 4, 50, 60, 70, 80, 90])
        bm.evict_all()
        publisher.publish(recorder.drain())
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        cache([7, 7, 7, 7, 8])
        (live,) = recv_batches(sub)
        assert live[0] == 4  # batches 2 and 3 are missing
        replay = ctx.socket(zmq.REQ)  # as vLLM's example subscriber asks
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send((1 + 1).to_bytes(8, "big"))
        seq_bytes, payload = replay.recv_multipart()
        replay.close(0)
        assert int.from_bytes(seq_bytes, "big") == 2  # REQ reads the first reply only
        dealer = ctx.socket(zmq.DEALER)  # a DEALER reads the whole replay
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            _, seq_bytes, payload = dealer.recv_multipart()
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(0)
        assert [seq for seq, _ in replayed] == [2, 3, 4]
        for seq, payload in replayed:
            if seq < live[0]:
                rebuilt.apply(V_DECODER.decode(payload))
        rebuilt.apply(V_DECODER.decode(live[1]))
        assert rebuilt.blocks == tree_blocks(bm._tree.nodes())
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
