"""The ``prefixcache`` command line: ``serve`` (engine mode, serve_command.py) and ``route``
(upstream mode, route_command.py), their options (serve_options.py, route_options.py and
shared_options.py), parsed and dispatched by main.py."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
