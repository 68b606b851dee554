import importlib


def test_layers_install_under_one_import_name() -> None:
    for name in ("prefixcache.sdk", "prefixcache.sidecar", "prefixcache.engine"):
        assert importlib.import_module(name).__name__ == name
