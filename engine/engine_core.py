"""The engine core process: ``LLMEngine``'s step loop alone in its own interpreter.

``ProcessEngine`` starts ``run_core`` in a spawned process. Nothing here waits on HTTP work,
and the API side's asyncio loop never competes with the model's torch calls for one GIL (on a
thread beside it, as ``AsyncEngine`` runs it, that contention costs ~1.6x in throughput).

Messages (engine_wire.py) arrive on a reader thread, which only decodes and queues them; the
main thread drains the queue between steps, steps, and sends each step's outputs as one
message together with the stats they leave behind.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from . import engine_wire as wire
from .config import EngineConfig
from .engine import LLMEngine
from .request import RequestOutput

log = logging.getLogger("prefixcache.engine")
METRICS_EVERY_S = 0.25  # the API side's /metrics lags the core by at most this (or a finish)
PARENT_POLL_S = 0.5
PARENT_GONE_GRACE_S = 10.0
_ADMIN = frozenset({"pin", "unpin", "evict_all", "save_pinned", "load_pinned", "cache_tree"})


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


class EngineCore:
    def __init__(self, conn: Connection, engine: LLMEngine) -> None:
        self.conn = conn
        self.engine = engine
        self.inbox: queue.SimpleQueue[wire.ToCore] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.encoder = wire.encoder()
        self.stopping = False
        self.pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self.refused: list[wire.Refusal] = []
        self.metrics_sent_at = 0.0
        self.records_sent = 0  # the seq of the last RequestRecord sent

    def ready(self) -> wire.Ready:
        engine, loaded = self.engine, self.engine.loaded
        return wire.Ready(
            model_name=loaded.name,
            tokenizer=engine.tokenizer.to_spec(),
            tokenizer_fingerprint=engine.tokenizer.fingerprint,
            max_model_len=engine.max_seq_len,
            block_size=engine.config.block_size,
            dtype=str(loaded.dtype).removeprefix("torch."),
            cache_identity=engine.cache_identity(loaded),
            sampling_defaults=dict(loaded.sampling_defaults),
            stats=engine.cache_stats(),
            metrics=metric_families(engine),
        )

    # -- the reader thread -------------------------------------------------------------------

    def read(self) -> None:
        decoder = wire.core_decoder()
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):  # the API side is gone: stop
                self.stop()
                return
            self.inbox.put(decoder.decode(data))
            self.wakeup.set()

    def stop(self) -> None:
        """Stop after the current step, as a Shutdown message would (any thread)."""
        self.inbox.put(wire.Shutdown())
        self.wakeup.set()

    # -- the main thread ---------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self.read, name="prefixcache-core-reader", daemon=True).start()
        engine = self.engine
        while not self.stopping:
            self.wakeup.clear()
            self.drain()
            if self.stopping:
                break
            if engine.has_unfinished:
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug outside the model step: fail everything
                    log.exception("engine step failed")
                    engine.error = f"internal engine error: {type(exc).__name__}: {exc}"
                    outputs = engine.fail_all("engine_error", engine.error)
                self.send_step(outputs)
            elif self.pending or self.refused:
                self.send_step([])
            else:
                self.wakeup.wait(timeout=0.5)
        for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
            engine.abort_request(seq.request_id)

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
            try:
                engine.add_request(msg.request, msg.arrival)
            except ValueError as e:
                self.refused.append(wire.Refusal(msg.request.request_id, str(e)))
        elif isinstance(msg, wire.Abort):
            out = engine.abort_request(msg.request_id)
            if out is not None:
                self.pending.append(out)
        elif isinstance(msg, wire.Call):
            self.reply(msg)
        else:
            self.stopping = True

    def reply(self, call: wire.Call) -> None:
        result: Any = None
        error = None
        try:
            if call.method not in _ADMIN:
                raise ValueError(f"unknown engine call {call.method!r}")
            result = getattr(self.engine, call.method)(*call.args)
        except ValueError as e:
            error = str(e) or type(e).__name__
        except Exception as e:  # reported to the caller as an error, the core keeps running
            log.exception("engine call %s failed", call.method)
            error = f"internal engine error: {e}"
        self.metrics_sent_at = time.monotonic()
        msg = wire.Reply(
            call.call_id,
            msgspec.Raw(self.encoder.encode(result)),
            error,
            self.engine.cache_stats(),
            metric_families(self.engine),
        )
        self.send(msg)

    def send_step(self, outputs: list[RequestOutput]) -> None:
        if self.pending:
            outputs = self.pending + outputs
            self.pending = []
        refused, self.refused = self.refused, []
        engine = self.engine
        now = time.monotonic()
        refresh = any(o.finished for o in outputs) or now - self.metrics_sent_at > METRICS_EVERY_S
        metrics = None
        if refresh:
            metrics = metric_families(engine)
            self.metrics_sent_at = now
        stats = engine.cache_stats() if refresh or outputs else None
        records = engine.activity.records(self.records_sent)
        if records:
            self.records_sent = records[-1].seq
        step = wire.Step(
            outputs,
            refused,
            stats,
            engine.num_waiting,
            engine.num_running,
            metrics,
            engine.error,
            records,
        )
        self.send(step)

    def send(self, msg: Any) -> None:
        try:
            self.conn.send_bytes(self.encoder.encode(msg))
        except (BrokenPipeError, OSError):
            self.stopping = True


def exit_with_parent(parent_pid: int) -> None:
    """End this process once its parent is gone (killed while the model loads, or a step that
    never returns): the pipe's EOF stops a serving core cleanly first, within the grace."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    time.sleep(PARENT_GONE_GRACE_S)
    log.error("the API process is gone: the engine core exits")
    os._exit(1)


def run_core(
    conn: Connection, config: EngineConfig, log_level: int = logging.INFO, parent_pid: int = 0
) -> None:
    """The spawned process's entry point: load, say Ready (or Failed), then serve the pipe;
    on Shutdown, EOF or SIGTERM, stop and release the KV tier and the event publisher."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (core): %(message)s")
    # Ctrl-C reaches the whole process group: the API side handles it and sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parent = parent_pid or os.getppid()
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    # Load and step on one thread of its own, never on the main thread: libgomp gives each
    # thread that opens parallel regions a team of its own, and once two teams together hold
    # more threads than there are CPUs it cuts every worker's spin before sleeping to almost
    # nothing, so each parallel region of a step waits for a woken worker (measured here,
    # 2 vCPUs: the core used 1.2 CPUs and stepped 40 % slower than the same engine in one
    # thread). The main thread only takes signals and waits.
    served: list[EngineCore] = []
    ready = threading.Event()
    loop = threading.Thread(
        target=_load_and_serve, args=(conn, config, served, ready), name="prefixcache-core"
    )
    loop.daemon = True
    loop.start()
    while loop.is_alive() and not ready.wait(timeout=0.5):
        pass
    if served:
        # SIGTERM to the whole group (systemd, a container's stop) stops it as Shutdown does.
        signal.signal(signal.SIGTERM, lambda signum, frame: served[0].stop())
    loop.join()


def _load_and_serve(
    conn: Connection, config: EngineConfig, served: list[EngineCore], ready: threading.Event
) -> None:
    encoder = wire.encoder()
    try:
        engine = LLMEngine(config)
    except Exception as e:
        log.exception("engine start failed")
        conn.send_bytes(encoder.encode(wire.Failed(f"{type(e).__name__}: {e}")))
        ready.set()
        return
    core = EngineCore(conn, engine)
    served.append(core)
    ready.set()
    try:
        conn.send_bytes(encoder.encode(core.ready()))
    except OSError:  # the API side went away while the model loaded
        engine.close()
        return
    core.run()
    engine.close()  # the tier's writer and file (unless kept), queued KV events
