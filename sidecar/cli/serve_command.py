"""``prefixcache serve``: the engine-mode sidecar over the embedded engine, served by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..environment import SidecarEnvironment
from ..http.redaction import redacted_log_config
from ..http.uvicorn_protocol import HalfCloseHTTPProtocol
from .shared_options import MIB, configure_logging

if TYPE_CHECKING:
    from prefixcache.engine.api import EngineAPI
    from prefixcache.engine.config import EngineConfig

# Without keys there is one tenant: nothing to keep apart, and a fixed key keeps its namespace
# (so pinned prefixes loaded from --cache-dir) the same across restarts.
SINGLE_TENANT_SECRET = b"prefixcache: one tenant, no keys"


UNSIGNABLE = (
    "{} with --api-keys-file needs --secret-file (or $PREFIXCACHE_SECRET): cache files are "
    "signed with a key derived from the secret, and without one it is random per start, so a "
    "file saved now cannot be loaded after a restart"
)


def read_secret(
    path: Path | None, keys_enabled: bool = True, environment: SidecarEnvironment | None = None
) -> bytes:
    """The namespace secret: --secret-file, else $PREFIXCACHE_SECRET, else random per start
    with keys and fixed without."""
    if path is not None:
        secret = path.read_bytes().strip()
        if len(secret) < 16:
            raise SystemExit(f"{path}: the secret must be at least 16 bytes")
        return secret
    environment = environment or SidecarEnvironment.read()
    if environment.secret is not None:
        return environment.secret
    return os.urandom(32) if keys_enabled else SINGLE_TENANT_SECRET


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself where it reads as a template
    (has a brace or a newline) with its backslash escapes decoded, as vLLM decides; compiled
    here, at start."""
    if value is None:
        return None
    try:  # a long one-line template is no path (ENAMETOOLONG): it reads as a template
        text: str | None = Path(value).expanduser().read_text(encoding="utf-8")
    except OSError:
        text = None
    if text is None and not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r}: no such file, and not a template")
    if text is None:  # its escapes (\n, \t) read as vLLM reads them; other text kept
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    from jinja2 import TemplateError

    from prefixcache.engine.text.tokenizer import compile_template

    try:
        compile_template(text)  # as the engine will: its extensions and filters
    except TemplateError as exc:
        raise ValueError(f"--chat-template: {exc}") from exc
    return text


def serve(args: argparse.Namespace, environment: SidecarEnvironment | None = None) -> None:
    import uvicorn

    from prefixcache.engine.config import EngineConfig

    from ..http.tenancy import KeyStore
    from ..server.app import SidecarSettings, create_app

    configure_logging(args)
    try:
        keys = KeyStore.from_file(args.api_keys_file) if args.api_keys_file else KeyStore()
        secret = read_secret(args.secret_file, keys.enabled, environment)
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            gguf_weights=args.gguf_weights,
            chat_template=read_chat_template(args.chat_template),
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_memory_bytes=args.kv_memory_mib * MIB,
            max_num_batched_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            batch_invariant=not args.no_batch_invariance,
            kv_offload=args.kv_offload,
            kv_offload_keep_files=args.kv_offload_keep,
            kv_spill_policy=args.kv_spill_policy,
            swa_pool_ratio=args.swa_pool_ratio,
            reuse_repair_tokens=args.reuse_repair_tokens,
            max_pin_ttl_s=args.max_pin_ttl,
            max_hint_pinned_blocks=args.max_hint_pinned_blocks,
        )
        if args.load_cache and args.cache_dir is None:
            raise ValueError("--load-cache needs --cache-dir")
        random_secret = keys.enabled and args.secret_file is None and environment.secret is None
        if random_secret and args.load_cache:
            raise ValueError(UNSIGNABLE.format("--load-cache"))
        if random_secret and args.cache_dir is not None:
            logging.getLogger("prefixcache.sidecar").warning(UNSIGNABLE.format("--cache-dir"))
        set_kv_events(config, args, secret)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"prefixcache serve: {exc}") from None
    if args.build_kernels:
        build_kernels(config)
        return
    settings = SidecarSettings(
        keys=keys,
        secret=secret,
        max_body_bytes=int(args.max_body_mib * MIB),
        max_waiting=args.queue_limit,
        model_aliases=(*args.served_model_name, args.model),  # vLLM's order: served names first
        cache_dir=args.cache_dir,
        load_on_start=tuple(args.load_cache),
        use_generation_config=args.generation_config == "auto",
        tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
    )
    listener = listen(args.host, args.port)  # before the model loads: a port in use fails now
    # uvicorn says where it runs only for a socket it binds itself: this one is bound here
    logging.getLogger("prefixcache.sidecar").info("listening on %s", listen_url(listener))
    engine = create_engine(config, args.engine)
    app = create_app(engine, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=GRACEFUL_S,
            http=HalfCloseHTTPProtocol,
            log_config=redacted_log_config(),  # the access log never shows a key
        )
    )
    sidecar = app.state.sidecar
    sidecar.on_start_failure = lambda: setattr(server, "should_exit", True)
    drain_on_exit(server, engine, GRACEFUL_S)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT once it stopped
        server.run(sockets=[listener])
    if sidecar.start_error is not None:  # as vLLM: a model that cannot load ends the process
        print(
            f"prefixcache serve: the engine failed to start: {sidecar.start_error}", file=sys.stderr
        )
        raise SystemExit(1)


GRACEFUL_S = 5  # uvicorn's wait for requests in flight at a stop, then it cancels them


def drain_on_exit(server: Any, engine: Any, graceful_s: float) -> None:
    """At a stop (SIGTERM, Ctrl-C), requests in flight get a second less than uvicorn's
    graceful wait to finish; those left then end as aborted ("the server is shutting down": a
    stream's error event and [DONE], a 503 otherwise) instead of a connection cut mid-chunk
    when uvicorn cancels them."""
    handle_exit = server.handle_exit

    def on_exit(sig: int, frame: Any) -> None:
        first = not server.should_exit
        handle_exit(sig, frame)
        try:
            loop = asyncio.get_running_loop()  # the signal lands on the loop's thread
        except RuntimeError:  # before the loop runs or after it stopped: nothing in flight
            return
        if first:
            loop.call_soon_threadsafe(
                loop.call_later, max(0.0, graceful_s - 1.0), engine.abort_all, SHUTTING_DOWN
            )

    server.handle_exit = on_exit


SHUTTING_DOWN = "the server is shutting down"


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads: uvicorn binds after the
    app's start-up, so a port in use loaded the model first and then exited 3 mid-log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets a TCP-proto listener accepts
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"prefixcache serve: cannot listen on {host}:{port}: {exc.strerror}"
        ) from None
    return sock


def listen_url(sock: socket.socket) -> str:
    """The URL a bound socket serves at (its real port where 0 asked for any)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_kernels(config: EngineConfig) -> None:
    """``--build-kernels``: the engine's CPU kernels built for ``config``, the model unloaded."""
    from prefixcache.engine import settings
    from prefixcache.engine.step.model_setup import build_kernels as build

    seconds = build(config)  # each library logs where it is, or why it is off
    print(
        f"prefixcache serve: CPU kernels ready in {settings.home_dir() / 'kernels'} ({seconds:.1f} s)"
    )


def create_engine(config: EngineConfig, mode: str) -> EngineAPI:
    """``--engine process``: the engine core in a child process (this one never imports torch);
    ``--engine thread``: on a thread of this process."""
    if mode == "process":
        from prefixcache.engine.serving.process_engine import ProcessEngine

        return ProcessEngine(config)
    from prefixcache.engine.serving.async_engine import AsyncEngine

    return AsyncEngine(config)


def set_kv_events(config: EngineConfig, args: argparse.Namespace, secret: bytes) -> None:
    """The --kv-events-* flags on the engine's configuration."""
    from ..http.tenancy import cache_namespace

    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    config.kv_events_endpoint = args.kv_events_endpoint
    config.kv_events_replay_endpoint = args.kv_events_replay_endpoint
    config.kv_events_topic = args.kv_events_topic
    policy = args.kv_events_token_ids.strip()
    if policy in ("none", "all"):
        config.kv_events_token_ids = policy
        return
    tenants = [t.strip() for t in policy.split(",") if t.strip()]
    if not tenants:
        raise ValueError("--kv-events-token-ids: none, all, or a comma-separated tenant list")
    config.kv_events_token_ids = "listed"
    config.kv_events_token_namespaces = tuple(cache_namespace(secret, t) for t in tenants)
