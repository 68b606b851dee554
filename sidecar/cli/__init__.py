"""The ``prefixcache`` command line: ``serve`` (engine mode, serve_command.py) and ``route``
(upstream mode, route_command.py), their options (serve_options.py, route_options.py and
shared_options.py), parsed and dispatched by main.py; ``main`` here is the console script,
which says what to install where the server's dependencies are missing."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["build_parser", "main"]


def main() -> None:
    try:
        from .main import main as run

        run()
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.startswith("prefixcache"):
            raise
        sys.exit(
            f"prefixcache: the command needs the server's dependencies ({exc.name} is not "
            "installed): pip install 'prefixcache[serve]'"
        )


def build_parser() -> argparse.ArgumentParser:
    from .main import build_parser as build

    return build()
