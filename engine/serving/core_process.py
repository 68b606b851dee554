"""The engine core process: ``EngineCore`` alone in a spawned interpreter, serving a pipe.

``ProcessEngine`` starts ``run_core`` in a spawned process. Nothing here waits on HTTP work,
and the API side's asyncio loop never competes with the model's torch calls for one GIL (on a
thread beside it, as ``AsyncEngine`` runs it, that contention costs ~1.6x in throughput).

Messages (engine_wire.py) arrive on a reader thread, which only decodes and submits them; the
core's thread drains them between steps, steps, and sends each step's outputs as one message
together with the stats they leave behind.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..engine import LLMEngine
from ..step.engine_hooks import EngineHooks
from ..text.tokenizer import TokenizerSpec
from . import engine_wire as wire
from .engine_core import EngineCore
from .errors import start_failure

log = logging.getLogger("prefixcache.engine")
PARENT_POLL_S = 0.5
PARENT_GONE_GRACE_S = 10.0


class PipeOutput:
    """The core's messages as msgpack down the pipe (a ``CoreOutput``)."""

    mirrors_metrics = True

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.encoder = wire.encoder()

    def send(self, msg: wire.ToApi) -> bool:
        try:
            self.conn.send_bytes(self.encoder.encode(msg))
        except (BrokenPipeError, OSError):
            return False
        return True


def read_pipe(conn: Connection, core: EngineCore) -> None:
    """The reader thread: decode and submit; the API side gone (EOF) stops the core."""
    decoder = wire.core_decoder()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            core.stop()
            return
        core.submit(decoder.decode(data))


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
        # SIGTERM to the whole group (systemd's default, some containers' stop): the API side
        # drains its requests and sends Shutdown; a SIGTERM it did not get (this process's
        # alone) stops the core STOP_GRACE_S later, as Shutdown does. Stopping at once cut the
        # API side's graceful drain and logged the engine's exit as an error.
        signal.signal(signal.SIGTERM, lambda signum, frame: _stop_later(served[0]))
    loop.join()


STOP_GRACE_S = 10.0  # past the server's own graceful shutdown (5 s)


def _stop_later(core: EngineCore) -> None:
    timer = threading.Timer(STOP_GRACE_S, core.stop)
    timer.daemon = True
    timer.start()


def _load_and_serve(
    conn: Connection, config: EngineConfig, served: list[EngineCore], ready: threading.Event
) -> None:
    out = PipeOutput(conn)

    def send_ahead(spec: TokenizerSpec) -> None:  # the API side builds its copy meanwhile
        out.send(wire.TokenizerAhead(spec))

    try:
        engine = LLMEngine(config, hooks=EngineHooks(on_tokenizer=send_ahead))
    except Exception as e:
        known = start_failure(e)
        if known is None:  # a bug: its traceback, here, once (the API side says one line)
            log.exception("engine start failed")
        out.send(wire.Failed(str(known) if known else f"{type(e).__name__}: {e}"))
        ready.set()
        return
    # What loading made (modules, weights' wrappers, tokenizer tables: some 300K objects) is
    # kept for good: out of the collector's sight, a full collection no longer walks it, which
    # took 60-90 ms of a step's time whenever one ran (2 vCPUs, the bench model).
    gc.collect()
    gc.freeze()
    core = EngineCore(engine, out)
    served.append(core)
    ready.set()
    try:
        if not out.send(core.ready()):  # the API side went away while the model loaded
            return
        reader = threading.Thread(
            target=read_pipe, args=(conn, core), name="prefixcache-core-reader", daemon=True
        )
        reader.start()
        core.run()
    finally:
        engine.close()  # the tier's writer and file (unless kept), queued KV events
