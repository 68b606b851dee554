"""The options ``prefixcache serve`` and ``prefixcache route`` share: where to listen, client
keys, the body limit and the log level; and the logging set-up they drive."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from ..http.redaction import redact_root_handlers

MIB = 1024**2


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound without ``high``); a value
    outside is a usage error, not a silent default (``--num-blocks 0`` took the default)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: {bound}")
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value" for what int() refuses
    return parse


def add_shared_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server", "listening, client keys and limits")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int_in(0, 65535), default=8000, help="TCP port to listen on")
    group.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help='JSON file {"keys": [{"key": "sk-...", "tenant": "acme", "admin": false}]}; each '
        "key's tenant gets its own cache namespace; admin keys may use /v1/cache/*. Without "
        "it, no key is needed and all clients share one namespace",
    )
    group.add_argument(
        "--max-body-mib",
        type=float,
        default=4.0,
        help="largest request body accepted, in MiB; larger ones get 413",
    )
    group.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log verbosity",
    )


def configure_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    redact_root_handlers()  # no secret-looking query value in any log line
