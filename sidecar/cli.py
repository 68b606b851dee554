"""``prefixcache serve``: the sidecar over the embedded engine, served by uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

MIB = 1024**2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="Prefix-caching LLM server: an OpenAI-compatible sidecar over the embedded "
        "engine. Requests that start with the same tokens share their cached KV blocks.",
        epilog="Run 'prefixcache serve --help' for every server option. Docs: docs/sidecar.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/cache/*, "
        "/health and /metrics over the embedded engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--model",
        default="demo",
        help="'demo' (the built-in small model, made locally on first use) or the path of a "
        "local Hugging Face folder (config.json, *.safetensors, tokenizer.json)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name requests may use for the model (repeatable); the model's folder "
        "name and the --model value itself are always accepted",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block (a power of two); prefixes are shared in whole blocks",
    )
    serve.add_argument(
        "--kv-memory-mib",
        type=int,
        default=512,
        help="memory for the KV block pool in MiB; more blocks keep more prefixes cached",
    )
    serve.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (wins over --kv-memory-mib)",
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step; long prompts are prefilled in chunks of this size",
    )
    serve.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences that run at the same time"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's own)",
    )
    serve.add_argument(
        "--queue-limit",
        type=int,
        default=1024,
        help="requests allowed to wait for the engine; beyond it the server answers 429 with "
        "Retry-After",
    )
    serve.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "flashinfer"],
        default="auto",
        help="attention kernels: flashinfer needs CUDA; torch runs anywhere; auto picks",
    )
    serve.add_argument(
        "--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if present)"
    )
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights and KV dtype; auto: bfloat16 on CUDA and on CPUs that compute it natively "
        "(AVX512_BF16, AMX, Arm BF16), else float32",
    )
    serve.add_argument(
        "--engine",
        choices=["process", "thread"],
        default="process",
        help="where the engine's step loop runs: its own process (the HTTP server never "
        "competes with the model for one interpreter lock) or a thread of the server's",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn prefix caching off (every request computes its whole prompt)",
    )
    serve.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help='JSON file {"keys": [{"key": "sk-...", "tenant": "acme", "admin": false}]}; each '
        "key's tenant gets its own cache namespace; admin keys may use /v1/cache/*. Without "
        "it, no key is needed and all clients share one namespace",
    )
    serve.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="file holding the server secret that cache namespaces are derived from (HMAC); "
        "default: $PREFIXCACHE_SECRET, else random per start with --api-keys-file and fixed "
        "without it (one tenant)",
    )
    serve.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: requests that leave temperature, top_p, top_k or repetition_penalty unset "
        "get the model's generation_config.json values (as vLLM does); none: OpenAI's defaults",
    )
    serve.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="upstream mode (repeatable): no embedded engine; route each request to one of "
        "these OpenAI-compatible servers (vLLM, SGLang, other sidecars; base URLs like "
        "http://10.0.0.7:8000/v1) by prefix affinity: requests sharing a system prompt go to "
        "the replica that already holds it, within --load-factor",
    )
    serve.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="upstream mode: an upstream takes a request while its in-flight count is under "
        "load-factor x the average; past that the next-best replica does",
    )
    serve.add_argument(
        "--min-load",
        type=int,
        default=8,
        help="upstream mode: an upstream with fewer requests in flight than this always takes "
        "the requests whose prefix it owns (the load bound applies above it)",
    )
    serve.add_argument(
        "--upstream-api-key",
        default=os.environ.get("PREFIXCACHE_UPSTREAM_API_KEY"),
        help="upstream mode: bearer key sent to the upstreams (default: "
        "$PREFIXCACHE_UPSTREAM_API_KEY); clients' own keys are never forwarded",
    )
    serve.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        help="upstream mode: longest wait, in seconds, for an upstream's answer or next "
        "stream chunk (504 after it)",
    )
    serve.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder for pinned-prefix files: POST /v1/cache/save writes every pinned prefix "
        "with its KV there, /v1/cache/load reads one back (same model, tokenizer, dtype and "
        "block size only); off without it",
    )
    serve.add_argument(
        "--load-cache",
        action="append",
        default=[],
        metavar="NAME",
        help="load NAME.safetensors from --cache-dir once the model is up (repeatable), so "
        "pinned prefixes survive a restart without their prefill; tenants' prefixes hit only "
        "with the same --secret-file",
    )
    serve.add_argument(
        "--max-body-mib",
        type=float,
        default=4.0,
        help="largest request body accepted, in MiB; larger ones get 413",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log verbosity",
    )
    return parser


# Without keys there is one tenant: nothing to keep apart, and a fixed key keeps its namespace
# (so pinned prefixes loaded from --cache-dir) the same across restarts.
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

    from prefixcache.engine.async_engine import AsyncEngine
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.process_engine import ProcessEngine

    from .app import SidecarSettings, create_app
    from .tenancy import KeyStore

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
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
        )
        keys = KeyStore.from_file(args.api_keys_file) if args.api_keys_file else KeyStore()
        if args.load_cache and args.cache_dir is None:
            raise ValueError("--load-cache needs --cache-dir")
    except (ValueError, OSError) as exc:
        raise SystemExit(f"prefixcache serve: {exc}") from None
    settings = SidecarSettings(
        keys=keys,
        secret=read_secret(args.secret_file, keys.enabled),
        max_body_bytes=int(args.max_body_mib * MIB),
        max_waiting=args.queue_limit,
        model_aliases=(args.model, *args.served_model_name),
        cache_dir=args.cache_dir,
        load_on_start=tuple(args.load_cache),
        use_generation_config=args.generation_config == "auto",
    )
    engine = ProcessEngine(config) if args.engine == "process" else AsyncEngine(config)
    app = create_app(engine, settings)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )


def serve_upstream(args: argparse.Namespace) -> None:
    """Upstream mode: a prefix-affinity router in front of OpenAI-compatible servers."""
    import uvicorn

    from .tenancy import KeyStore
    from .upstream_app import UpstreamSettings, create_upstream_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = UpstreamSettings(
            upstreams=tuple(args.upstream),
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
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main(sys.argv[1:])
