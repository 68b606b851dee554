"""KV events: what the prefix cache stores and evicts, in vLLM's wire format.

Wire (vLLM 0.32's ``vllm/distributed/kv_events.py``; ``make test-vllm`` reads real vLLM replicas'
streams with the same decoder that reads ours):

- PUB socket, multipart ``[topic, seq (8-byte big-endian), msgpack(EventBatch)]``.
- ``EventBatch`` is an array ``[ts, events, data_parallel_rank]``; each event a map tagged by
  its ``type`` (vLLM 0.32's ``KVCacheEvent``: ``tag=True``, not array-like):
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
  ``{"type": "AllBlocksCleared"}``.
- ROUTER replay socket: a request ``[seq (8 bytes)]`` (REQ or DEALER with an empty delimiter)
  is answered by one ``[topic, seq, payload]`` message per buffered batch from that number on,
  then ``[b"", -1 (8 bytes, signed), b""]`` (vLLM 0.32's frames).
- ``medium`` (vLLM's strings): ``GPU`` for the engine's own KV pool, whatever the device (vLLM
  says GPU on its CPU build too), ``CPU`` for the host tier, ``STORAGE`` for the disk tier
  (engine/memory/tier_link.py publishes the tier moves).

A block hash is the first 8 bytes of our chained digest (prefix_tree.py) as an unsigned
integer: it depends on the namespace, so one tenant's blocks never share a hash with another's.
``token_ids`` are published only for the namespaces the operator lists, or all (docs/kv-events.md);
elsewhere a ``BlockStored`` carries ``token_ids=[]``.

Publishing never stalls the engine: ``BlockEventRecorder`` (the block manager's listener)
collects a step's events in a list; ``KVEventPublisher.publish`` numbers the batch and puts it
on a bounded queue without waiting; a thread sends it. A full queue drops the batch, so its
number is missing and subscribers see the gap (a replay cannot fill it: they must resync).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Literal

import msgspec

from ..memory.prefix_tree import Node

log = logging.getLogger("prefixcache.engine.kv_events")

ALL = "all"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HASH_BYTES = 8  # a msgpack integer holds 64 bits
MEDIUM_POOL = "GPU"  # vLLM's names: its own pool, host memory, files
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "STORAGE"
TIER_MEDIA = {"host": MEDIUM_HOST, "disk": MEDIUM_DISK}  # KVTier.kind -> medium


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block holds the prompt's first tokens
    token_ids: list[int]  # every block's tokens, in order; [] where the policy withholds them
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # vLLM's newer field


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # wall-clock seconds (time.time()) when the step's events were published
    events: list[KVEvent]
    data_parallel_rank: int | None = 0


def block_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:HASH_BYTES], "big")


class BlockEventRecorder:
    """The block manager's listener: turns tree inserts and removals, and the KV tier's spills
    and drops, into events, kept until ``drain``. Consecutive stores along one chain in one
    medium merge into one ``BlockStored``; consecutive removals in one medium into one
    ``BlockRemoved``. A block spilled to the tier and evicted from the pool is
    ``BlockStored(medium=CPU)`` then ``BlockRemoved(medium=GPU)``: the same hash, now held
    only below the pool (vLLM's offloading connector publishes tier moves the same way)."""

    def __init__(
        self,
        block_size: int,
        token_roots: frozenset[bytes] | Literal["all"] = frozenset(),
        medium: str = MEDIUM_POOL,
    ) -> None:
        """``token_roots``: the namespace roots whose blocks' token ids are published."""
        self.block_size = block_size
        self.token_roots = token_roots
        self.medium = medium
        self._events: list[KVEvent] = []
        self._last_stored: bytes | None = None  # digest the pending BlockStored ends with
        # Engine-internal stores (chunk_reuse's namespaces) are never published: no request's
        # prefix can hit them, so a router told of them would route to a miss.
        self.hidden_roots: set[bytes] = set()
        self._hidden_pool: set[bytes] = set()  # their blocks' digests, in the pool
        self._hidden_tier: set[bytes] = set()  # and in the tier

    # ---- the pool

    def block_stored(self, node: Node, root: bytes) -> None:
        if root in self.hidden_roots:
            self._hidden_pool.add(node.digest)
            return
        self._stored(node, root, self.medium)

    def block_removed(self, node: Node, cause: str = "") -> None:
        if node.digest in self._hidden_pool:
            self._hidden_pool.discard(node.digest)
            return
        self._removed(block_hash(node.digest), self.medium)

    # ---- the KV tier

    def block_spilled(self, node: Node, tier: str) -> None:
        if node.digest in self._hidden_pool:
            self._hidden_tier.add(node.digest)
            return
        root = b""
        if self.token_roots and self.token_roots != ALL:
            root = _root_of(node)
        self._stored(node, root, TIER_MEDIA[tier])

    def tier_dropped(self, digest: bytes, tier: str) -> None:
        if digest in self._hidden_tier:
            self._hidden_tier.discard(digest)
            return
        self._removed(block_hash(digest), TIER_MEDIA[tier])

    def all_cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._last_stored = None

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        self._last_stored = None
        return events

    def _stored(self, node: Node, root: bytes, medium: str) -> None:
        tokens: list[int] = []
        if self.token_roots == ALL or root in self.token_roots:
            tokens = memoryview(node.tokens).cast("I").tolist()
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and self._last_stored == node.parent_digest
            and bool(last.token_ids) == bool(tokens)
        ):
            last.block_hashes.append(block_hash(node.digest))
            last.token_ids.extend(tokens)
        else:
            parent = None if node.parent is None else block_hash(node.parent_digest)
            self._events.append(
                BlockStored(
                    [block_hash(node.digest)],
                    parent,
                    tokens,
                    self.block_size,
                    None,
                    medium,
                    None,
                )
            )
        self._last_stored = node.digest

    def _removed(self, hash_: int, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(hash_)
        else:
            self._events.append(BlockRemoved([hash_], medium))
        self._last_stored = None


def _root_of(node: Node) -> bytes:
    """The namespace root digest a node's chain starts from."""
    *_, top = node.path_up()
    return top.parent_digest


class KVEventPublisher:
    """ZMQ PUB (and optional ROUTER replay) on a thread of its own. Needs pyzmq
    (``pip install 'prefixcache[events]'``)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        max_queue: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        try:
            import zmq
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("KV events need pyzmq: pip install 'prefixcache[events]'") from exc
        self._zmq = zmq
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self.num_dropped = 0  # batches lost to a full queue (their numbers are gaps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="prefixcache-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int:
        """Number the batch and queue it; never waits. Returns its sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        batch = EventBatch(time.time() if ts is None else ts, events, self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            log.warning("KV event queue full: batch %d dropped", seq)
        return seq

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError as exc:  # keep going: the batch stays replayable
                log.warning("KV event batch %d not sent: %r", seq, exc)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames: list[Any] = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid KV event replay request (%d frames)", len(frames))
            return
        client, empty, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, empty, self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, empty, b"", END_SEQ, b""))
