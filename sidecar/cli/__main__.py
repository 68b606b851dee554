"""``python -m prefixcache.sidecar.cli``: the ``prefixcache`` command."""

from .main import main

main()
