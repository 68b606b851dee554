"""The ``prefixcache`` command: ``serve`` (engine mode) and ``route`` (upstream mode), each
with its own options; and ``serve --upstream``, upstream mode's old spelling, kept for now."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from ..environment import SidecarEnvironment
from .route_options import add_route_options
from .serve_options import add_serve_options
from .shared_options import add_shared_options

DESCRIPTION = (
    "Prefix-caching LLM server: an OpenAI-compatible sidecar over the embedded engine "
    "(serve), or a cache-aware router in front of OpenAI-compatible servers (route). "
    "Requests that start with the same tokens share their cached KV blocks."
)
SERVE_DESCRIPTION = (
    "Serve /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, /v1/models, "
    "/v1/cache/*, /tokenize, /health and /metrics over the embedded engine."
)
ROUTE_DESCRIPTION = (
    "Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics by routing "
    "each request to one of several OpenAI-compatible servers (vLLM, SGLang, prefixcache "
    "serve), to the one that already caches its prefix, within a load bound."
)
DEPRECATED_UPSTREAM = (
    "prefixcache serve: --upstream is deprecated and will be removed; use "
    "'prefixcache route --upstream URL ...' (same options, without the engine's)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description=DESCRIPTION,
        epilog="Run 'prefixcache serve --help' or 'prefixcache route --help' for a command's "
        "options. Docs: docs/sidecar.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible server over the embedded engine",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_options(serve)
    add_shared_options(serve)
    route = commands.add_parser(
        "route",
        help="run a cache-aware router in front of OpenAI-compatible servers",
        description=ROUTE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_route_options(route)
    add_shared_options(route)
    return parser


def build_deprecated_upstream_parser() -> argparse.ArgumentParser:
    """``prefixcache serve --upstream ...``: every option both modes had, as before the split
    (the engine's are accepted and unused)."""
    parser = argparse.ArgumentParser(
        prog="prefixcache serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_serve_options(parser)
    add_route_options(parser)
    add_shared_options(parser)
    return parser


def is_deprecated_upstream(argv: Sequence[str]) -> bool:
    return (
        bool(argv)
        and argv[0] == "serve"
        and any(arg == "--upstream" or arg.startswith("--upstream=") for arg in argv[1:])
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    environment = SidecarEnvironment.read()
    # The commands (uvicorn, starlette) load only once the arguments parsed: --help needs
    # none of them, so an SDK-only install shows it too.
    if is_deprecated_upstream(argv):
        print(DEPRECATED_UPSTREAM, file=sys.stderr)
        args = build_deprecated_upstream_parser().parse_args(argv[1:])
        from .route_command import route

        route(args, environment, command="prefixcache serve")
        return
    args = build_parser().parse_args(argv)
    raise_open_file_limit()
    if args.command == "serve":
        from .serve_command import serve

        serve(args, environment)
    elif args.command == "route":
        from .route_command import route

        route(args, environment)


def raise_open_file_limit() -> None:
    """Every connection is a file descriptor: the soft limit (often 1,024) raised to the hard
    one, as vLLM and nginx do, so that many clients (or idle ones, until their deadline)
    exhaust it later."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
