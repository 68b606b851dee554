"""One thread per upstream that reads its KV events into a ``ReplicaIndex``.

- SUB socket on the upstream's PUB endpoint (every topic); a DEALER on its replay endpoint
  when one is known.
- Sequence numbers: a batch numbered past ``last + 1`` is a gap. With a replay endpoint the
  subscriber asks for ``last + 1`` onward and applies the replayed batches it lacks, in
  order; a gap the replay cannot fill (too old for the publisher's buffer, a dropped batch, no
  replay endpoint, no answer in time) clears the index: an index that under-predicts only
  costs a hit, one that over-predicts routes to a replica that no longer holds the prefix.
- A number at or below ``last`` (not a batch already applied) means the publisher restarted
  (its numbers start at 0): the index is cleared before the batch is applied, even if its
  AllBlocksCleared was missed.
- On every (re)connection (a ZMQ monitor event) ``resync`` replays from the last applied batch:
  the same publisher sends that batch back byte for byte and the rest follows; a restarted one
  does not, so the index is cleared and rebuilt from its batch 0. A router that starts after
  its replicas learns what they hold the same way. Without a replay endpoint a reconnection
  clears the index.

Liveness, for the router (``is_live``): events are stale once a request the router sent has
finished ``stale_after_s`` ago with no event since (``expect`` marks such a request), or
before the first batch arrived. Idle replicas publish nothing, so silence alone is not stale.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from .kv_event_wire import EventBatch, decode_batch
from .kv_index import ReplicaIndex

log = logging.getLogger("prefixcache.sidecar.kv_events")

END_SEQ = -1
RECENT_BATCHES = 256


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    missed: int = 0  # sequence numbers found missing
    replayed: int = 0  # of those, batches a replay filled in
    unfilled_gaps: int = 0  # gaps that cleared the index
    restarts: int = 0  # publisher numbering started over
    decode_errors: int = 0


class EventSubscriber:
    def __init__(
        self,
        endpoint: str,
        index: ReplicaIndex,
        replay_endpoint: str | None = None,
        stale_after_s: float = 3.0,
        replay_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.on_lag = on_lag  # seconds from a batch's ts to its arrival (a metric)
        self.stats = SubscriberStats()
        self.last_seq: int | None = None
        self.last_event_at: float | None = None  # clock time of the last batch
        self._expected_at: float | None = None  # oldest finished request not yet followed by events
        self._anchor: tuple[int, bytes] | None = None  # the last batch applied
        self._recent: dict[int, bytes] = {}  # recently applied batches, to skip duplicates
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- liveness

    def expect(self) -> None:
        """A request that should have stored blocks just finished on this replica."""
        if self._expected_at is None:
            self._expected_at = self.clock()

    def is_live(self) -> bool:
        if self.last_event_at is None:
            return False
        expected = self._expected_at
        return expected is None or self.clock() - expected < self.stale_after_s

    # ---- the thread

    def start(self) -> None:
        import zmq  # optional: pip install 'prefixcache[events]'

        self._zmq = zmq
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events {self.endpoint}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    monitor.recv_multipart()
                    self.resync(ctx)  # a (re)connection: the publisher may be a new process
                if sub not in ready:
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.decode_errors += 1
                    continue
                self.on_message(int.from_bytes(frames[1], "big"), frames[2], ctx)
        except Exception:  # pragma: no cover - a bug here must not kill routing
            log.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            ctx.term()

    def resync(self, ctx: object | None = None) -> None:
        """After a (re)connection: same publisher, catch up; a new one (restart), start over.

        The replay from the last applied batch tells them apart: the same publisher sends that
        very batch back (same bytes, its timestamp included), a restarted one does not."""
        anchor = self._anchor
        if not self.replay_endpoint:
            if anchor is not None:  # cannot tell: forget rather than over-predict
                self.index.clear()
                self.last_seq, self._anchor = None, None
            return
        replayed = self._replay(anchor[0] if anchor else 0, None, ctx)
        if anchor is not None and replayed and replayed[0] == anchor:
            self._apply_run(replayed[1:])
            return
        if anchor is not None:
            self.stats.restarts += 1
            self.index.clear()
            self.last_seq, self._anchor = None, None
            if anchor[0] != 0:
                replayed = self._replay(0, None, ctx)
        if replayed and replayed[0][0] == 0:
            self._apply_run(replayed)

    def _apply_run(self, batches: list[tuple[int, bytes]]) -> None:
        for seq, payload in batches:
            if self.last_seq is None or seq == self.last_seq + 1:
                self._apply(seq, payload)

    def on_message(self, seq: int, payload: bytes, ctx: object | None = None) -> None:
        """Apply one live batch, resolving a gap or a restart first."""
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == payload:
                return  # already applied (from a replay)
            self.stats.restarts += 1  # the publisher's numbers started over
            self.index.clear()
            last = self.last_seq = None
        if last is None:
            if seq > 0:  # joined late (or after a restart): learn what came before
                self._fill_gap(0, seq, ctx, joining=True)
        elif seq > last + 1:
            self._fill_gap(last + 1, seq, ctx, joining=False)
        self._apply(seq, payload)

    def _fill_gap(self, start: int, end: int, ctx: object | None, joining: bool) -> None:
        if not joining:
            self.stats.missed += end - start
        replayed = self._replay(start, end, ctx) if self.replay_endpoint else []
        if [seq for seq, _ in replayed] == list(range(start, end)):
            for seq, payload in replayed:
                self._apply(seq, payload)
            if not joining:
                self.stats.replayed += len(replayed)
            return
        if not joining:
            log.warning(
                "KV events from %s: batches %d..%d lost; index cleared",
                self.endpoint,
                start,
                end - 1,
            )
            self.stats.unfilled_gaps += 1
        self.index.clear()

    def _replay(self, start: int, end: int | None, ctx: object | None) -> list[tuple[int, bytes]]:
        """Batches ``start`` up to ``end`` (exclusive; None: all) from the replay socket."""
        zmq = self._zmq
        own = ctx is None
        context = zmq.Context() if own else ctx
        dealer = context.socket(zmq.DEALER)  # type: ignore[attr-defined]
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000) + 1):
                # [b"", topic, seq, payload] (vLLM 0.32) or [b"", seq, payload] (older)
                frames = dealer.recv_multipart()
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ or not frames[-1]:
                    break
                if start <= seq and (end is None or seq < end):
                    out.append((seq, frames[-1]))
        finally:
            dealer.close(0)
            if own:
                context.term()  # type: ignore[attr-defined]
        out.sort()
        return out

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch: EventBatch = decode_batch(payload)
        except msgspec.DecodeError:
            self.stats.decode_errors += 1
            self.last_seq = seq
            return
        self.index.apply(batch.events)
        self.last_seq, self._anchor = seq, (seq, payload)
        self._recent[seq] = payload
        if len(self._recent) > RECENT_BATCHES:
            del self._recent[next(iter(self._recent))]
        self.last_event_at = self.clock()
        self._expected_at = None
        self.stats.batches += 1
        if self.on_lag is not None:
            self.on_lag(max(0.0, time.time() - batch.ts))
