"""``prefixcache serve``: the sidecar over the embedded engine, served by uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.engine.api import EngineAPI
    from prefixcache.engine.config import EngineConfig

    from .router.app import EventSource

from .cli_parser import build_parser
from .http.uvicorn_protocol import HalfCloseHTTPProtocol

MIB = 1024**2


SINGLE_TENANT_SECRET = b"prefixcache: one tenant, no keys"


def read_secret(path: Path | None, keys_enabled: bool = True) -> bytes:
    if path is not None:
        secret = path.read_bytes().strip()
        if len(secret) < 16:
            raise SystemExit(f"{path}: the secret must be at least 16 bytes")
        return secret
    from_env = os.environ.get("PREFIXCACHE_SECRET")
    if from_env:
        return from_env.encode()
    return os.urandom(32) if keys_enabled else SINGLE_TENANT_SECRET


def serve(args: argparse.Namespace) -> None:
    if args.upstream:
        serve_upstream(args)
        return
    import uvicorn

    from prefixcache.engine.config import EngineConfig

    from .http.tenancy import KeyStore
    from .server.app import SidecarSettings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        keys = KeyStore.from_file(args.api_keys_file) if args.api_keys_file else KeyStore()
        secret = read_secret(args.secret_file, keys.enabled)
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_memory_bytes=args.kv_memory_mib * MIB,
            max_num_batched_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_waiting=args.queue_limit,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_offload=args.kv_offload,
            kv_offload_keep_files=args.kv_offload_keep,
            kv_spill_policy=args.kv_spill_policy,
            max_pin_ttl_s=args.max_pin_ttl,
            max_hint_pinned_blocks=args.max_hint_pinned_blocks,
        )
        if args.load_cache and args.cache_dir is None:
            raise ValueError("--load-cache needs --cache-dir")
        secret = read_secret(args.secret_file, keys.enabled)
        set_kv_events(config, args, secret)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"prefixcache serve: {exc}") from None
    settings = SidecarSettings(
        keys=keys,
        secret=secret,
        max_body_bytes=int(args.max_body_mib * MIB),
        max_waiting=args.queue_limit,
        model_aliases=(args.model, *args.served_model_name),
        cache_dir=args.cache_dir,
        load_on_start=tuple(args.load_cache),
        use_generation_config=args.generation_config == "auto",
        tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
    )
    engine = create_engine(config, args.engine)
    app = create_app(engine, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            http=HalfCloseHTTPProtocol,
        )
    )
    sidecar = app.state.sidecar
    sidecar.on_start_failure = lambda: setattr(server, "should_exit", True)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT once it stopped
        server.run()
    if sidecar.start_error is not None:  # as vLLM: a model that cannot load ends the process
        print(
            f"prefixcache serve: the engine failed to start: {sidecar.start_error}", file=sys.stderr
        )
        raise SystemExit(1)


def create_engine(config: EngineConfig, mode: str) -> EngineAPI:
    """``--engine process``: the engine core in a child process (this one never imports torch);
    ``--engine thread``: on a thread of this process."""
    if mode == "process":
        from prefixcache.engine.process_engine import ProcessEngine

        return ProcessEngine(config)
    from prefixcache.engine.async_engine import AsyncEngine

    return AsyncEngine(config)


def set_kv_events(config: EngineConfig, args: argparse.Namespace, secret: bytes) -> None:
    """The --kv-events-* flags on the engine's configuration."""
    from .http.tenancy import cache_namespace

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


def parse_upstream(spec: str) -> tuple[str, EventSource | None]:
    """``URL[,events=ZMQ[,replay=ZMQ]]`` -> (URL, its event source)."""
    from .router.app import EventSource

    url, *options = [part.strip() for part in spec.split(",")]
    fields: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in ("events", "replay") or not value or name in fields:
            raise ValueError(f"--upstream {spec!r}: expected URL[,events=ZMQ[,replay=ZMQ]]")
        fields[name] = value
    if "replay" in fields and "events" not in fields:
        raise ValueError(f"--upstream {spec!r}: replay= needs events=")
    if "events" not in fields:
        return url, None
    return url, EventSource(fields["events"], fields.get("replay"))


def serve_upstream(args: argparse.Namespace) -> None:
    """Upstream mode: a prefix-affinity router in front of OpenAI-compatible servers."""
    import uvicorn

    from .http.tenancy import KeyStore
    from .router.app import UpstreamSettings, create_upstream_app
    from .router.cache_aware import RoutingSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        parsed = [parse_upstream(spec) for spec in args.upstream]
        tokenizer = None
        if args.tokenizer is not None:
            from prefixcache.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_folder(args.tokenizer)
        settings = UpstreamSettings(
            upstreams=tuple(url for url, _ in parsed),
            routing=args.routing,
            events={url: source for url, source in parsed if source is not None},
            tokenizer=tokenizer,
            cache_aware=RoutingSettings(
                match_threshold=args.match_threshold,
                balance_abs_threshold=args.balance_abs_threshold,
                balance_rel_threshold=args.balance_rel_threshold,
                prefill_weight=args.prefill_weight,
                running_weight=args.running_weight,
                host_tier_credit=args.host_tier_credit,
                storage_tier_credit=args.storage_tier_credit,
            ),
            keys=KeyStore.from_file(args.api_keys_file) if args.api_keys_file else KeyStore(),
            upstream_api_key=args.upstream_api_key,
            load_factor=args.load_factor,
            min_load=args.min_load,
            timeout_s=args.upstream_timeout,
            max_body_bytes=int(args.max_body_mib * MIB),
        )
        app = create_upstream_app(settings)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"prefixcache serve: {exc}") from None
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        http=HalfCloseHTTPProtocol,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main(sys.argv[1:])
