"""``python -m prefixcache.sidecar.cli``: the ``prefixcache`` command."""

from . import main

main()
