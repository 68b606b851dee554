"""``EngineCore``: the one serving loop around ``LLMEngine``, whatever carries its messages.

The loop drains the commands that arrived (engine_wire's ``Add``/``Abort``/``Call``/
``Shutdown``), runs one step, fails what a step broke, and publishes the step's outputs with
the stats they leave behind as one ``Step``. Idle, it sleeps until the next TTL pin is due, and
a pin that lapsed there is published at once as a ``Step`` with fresh stats. ``AsyncEngine`` runs it on a thread of the API
process (its ``CoreOutput`` hands messages to the event loop); the core process
(core_process.py) runs it in a child, sending them down a pipe. Commands may be submitted
from any thread; everything else runs on the loop's own thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..engine import LLMEngine
from ..request import RequestOutput
from . import engine_wire as wire

log = logging.getLogger("prefixcache.engine")
METRICS_EVERY_S = 0.25  # a mirrored /metrics lags the core by at most this (or a finish)
IDLE_WAIT_S = 0.5
ADMIN_CALLS = frozenset({"pin", "unpin", "evict_all", "save_pinned", "load_pinned", "cache_tree"})
# In one process a call may also pass objects that never cross a pipe: a Snapshot's tensors
# (the client does a cache file's I/O itself, the core only touches the pages), or a function
# to run on the engine ("apply").
THREAD_CALLS = ADMIN_CALLS | {"snapshot_pinned", "restore_pinned", "apply"}


class CoreOutput(Protocol):
    """Where the core's messages go (the API side's event loop, or a pipe)."""

    @property
    def mirrors_metrics(self) -> bool:
        """Whether messages carry the registry's samples (the client cannot read it live)."""
        ...

    def send(self, msg: wire.ToApi) -> bool:
        """Deliver ``msg``; False once the API side is gone (the core then stops)."""
        ...


def metric_families(engine: LLMEngine) -> list[wire.MetricFamily]:
    return [
        wire.MetricFamily(
            m.name,
            m.documentation,
            m.type,
            m.unit,
            [wire.Sample(s.name, dict(s.labels), s.value) for s in m.samples],
        )
        for m in engine.metrics.registry.collect()
    ]


def ready_message(engine: LLMEngine, with_metrics: bool) -> wire.Ready:
    """What a client is built from: the model card, the tokenizer, the first stats."""
    loaded = engine.loaded
    identity = engine.cache_identity(loaded, engine.config.kv_cache_dtype)
    variant = loaded.output_variant.encode()
    return wire.Ready(
        model_name=loaded.name,
        tokenizer=engine.tokenizer.to_spec(),
        tokenizer_fingerprint=engine.tokenizer.fingerprint,
        max_model_len=engine.max_seq_len,
        block_size=engine.config.block_size,
        dtype=str(loaded.dtype).removeprefix("torch."),
        cache_identity=identity,
        # the cache's root, and what else changes the logits (the sidecar's fingerprint)
        output_identity=hashlib.sha256(identity + b"|" + variant).digest() if variant else identity,
        sampling_defaults=dict(loaded.sampling_defaults),
        stats=engine.cache_stats(),
        metrics=metric_families(engine) if with_metrics else [],
    )


class EngineCore:
    def __init__(
        self, engine: LLMEngine, out: CoreOutput, calls: frozenset[str] = ADMIN_CALLS
    ) -> None:
        self.engine = engine
        self.out = out
        self.calls = calls
        self.inbox: queue.SimpleQueue[wire.ToCore] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.stopping = False
        self.pending: list[RequestOutput] = []  # outputs of aborts, sent with the next Step
        self.refused: list[wire.Refusal] = []
        self.metrics_sent_at = 0.0
        self.records_sent = 0  # the seq of the last RequestRecord sent
        self._compiler: ThreadPoolExecutor | None = None
        self._compiling: set[str] = set()  # requests whose grammar compiles off the loop
        self._dropped: set[str] = set()  # ... and were aborted meanwhile

    def ready(self) -> wire.Ready:
        return ready_message(self.engine, self.out.mirrors_metrics)

    # -- any thread --------------------------------------------------------------------------

    def submit(self, msg: wire.ToCore) -> None:
        self.inbox.put(msg)
        self.wakeup.set()

    def stop(self) -> None:
        """Stop after the current step, as a Shutdown message would."""
        self.submit(wire.Shutdown())

    # -- the loop's thread -------------------------------------------------------------------

    def run(self) -> None:
        """Serve until Shutdown (or the API side is gone); requests left then are aborted."""
        engine = self.engine
        while not self.stopping:
            self.wakeup.clear()
            self.drain()
            if self.stopping:
                break
            if engine.has_unfinished:
                self.send_step(self.step())
            elif self.pending or self.refused:
                self.send_step([])
            else:
                self.wakeup.wait(timeout=self.idle_wait())
                if engine.block_manager.expire_pins():  # lapsed with no traffic: report it now
                    self.send_step([], refresh=True)
        for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
            engine.abort_request(seq.request_id)
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def idle_wait(self) -> float:
        """How long an idle loop sleeps: until the next TTL pin lapses, at most IDLE_WAIT_S."""
        left = self.engine.block_manager.next_pin_lapse()
        return IDLE_WAIT_S if left is None else min(IDLE_WAIT_S, left + 0.001)

    def step(self) -> list[RequestOutput]:
        """One engine step; a bug outside the model step (which ``LLMEngine.step`` contains
        itself) fails every request rather than the loop."""
        engine = self.engine
        try:
            return engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            engine.error = f"internal engine error: {type(exc).__name__}: {exc}"
            return engine.fail_all("engine_error", engine.error)

    def drain(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(msg)

    def handle(self, msg: wire.ToCore) -> None:
        engine = self.engine
        if isinstance(msg, wire.Add):
            if self.compiles_first(msg):
                return
            try:
                engine.add_request(msg.request, msg.arrival)
            except ValueError as e:
                self.refused.append(wire.Refusal(msg.request.request_id, str(e)))
        elif isinstance(msg, wire.Abort):
            if msg.request_id in self._compiling:
                self._dropped.add(msg.request_id)
                return
            out = engine.abort_request(msg.request_id)
            if out is not None:
                self.pending.append(out)
        elif isinstance(msg, wire.Call):
            self.reply(msg)
        else:
            self.stopping = True

    def compiles_first(self, msg: wire.Add) -> bool:
        """Whether ``msg`` waits for its grammar: one not compiled yet in its namespace is
        compiled on a worker thread, and the Add comes back through the inbox when it is (a
        big schema held every running request's next step for up to a second). A kept
        refusal, or a grammar that is back, goes on to ``add_request`` now."""
        request = msg.request
        rid = request.request_id
        if rid in self._compiling:  # back from its compile
            self._compiling.discard(rid)
            if rid in self._dropped:  # aborted meanwhile: never added (the Refusal, which
                self._dropped.discard(rid)  # no one reads, sends the counts on)
                self.refused.append(wire.Refusal(rid, "aborted while its grammar compiled"))
                return True
            return False
        spec = request.sampling.grammar
        structured = self.engine.structured
        if spec is None:
            return False
        try:
            if structured.grammars.lookup(spec, request.namespace) is not None:
                return False
        except ValueError:
            return False  # refused before: add_request refuses it at once
        structured.prepare()  # the vocabulary's trie, built on this thread
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-grammar")
        self._compiling.add(rid)

        def compile_then_add() -> None:
            with contextlib.suppress(Exception):  # a refusal is kept: add_request raises it
                structured.compile(spec, request.namespace)
            self.submit(msg)

        self._compiler.submit(compile_then_add)
        return True

    def reply(self, call: wire.Call) -> None:
        result: Any = None
        error = None
        try:
            result = self.method(call.method)(*call.args)
        except ValueError as e:
            error = str(e) or type(e).__name__
        except Exception as e:  # reported to the caller as an error, the core keeps running
            log.exception("engine call %s failed", call.method)
            error = f"internal engine error: {e}"
        self.metrics_sent_at = time.monotonic()
        stats = self.engine.cache_stats()  # visible before the caller resumes
        self.send(wire.Reply(call.call_id, result, error, stats, self.metrics()))

    def method(self, name: str) -> Callable[..., Any]:
        if name not in self.calls:
            raise ValueError(f"unknown engine call {name!r}")
        if name == "apply":
            return lambda fn: fn(self.engine)
        return getattr(self.engine, name)

    def send_step(self, outputs: list[RequestOutput], refresh: bool = False) -> None:
        if self.pending:
            outputs = self.pending + outputs
            self.pending = []
        refused, self.refused = self.refused, []
        engine = self.engine
        now = time.monotonic()
        refresh = (
            refresh
            or any(o.finished for o in outputs)
            or now - self.metrics_sent_at > METRICS_EVERY_S
        )
        metrics = None
        if refresh:
            metrics = self.metrics()
            self.metrics_sent_at = now
        stats = engine.cache_stats() if refresh or outputs else None
        records = engine.activity.records(self.records_sent)
        if records:
            self.records_sent = records[-1].seq
        self.send(
            wire.Step(
                outputs,
                refused,
                stats,
                engine.num_waiting + len(self._compiling),  # a grammar compiling waits too
                engine.num_running,
                metrics,
                engine.error,
                records,
            )
        )

    def metrics(self) -> list[wire.MetricFamily] | None:
        return metric_families(self.engine) if self.out.mirrors_metrics else None

    def send(self, msg: wire.ToApi) -> None:
        if not self.out.send(msg):
            self.stopping = True
