"""The engine's environment variables: read in engine/settings.py only, each parsed one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from prefixcache.engine import settings
from prefixcache.engine.kernels import cpu_library
from prefixcache.engine.model import demo_model, named_models, progress

ENGINE = Path(settings.__file__).resolve().parent


def test_home_and_models_follow_the_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(settings.HOME_ENV, raising=False)
    monkeypatch.delenv(settings.MODELS_ENV, raising=False)
    default = Path.home() / ".cache" / "prefixcache"
    assert settings.home_dir() == default
    assert settings.models_dir() == default / "models"
    monkeypatch.setenv(settings.HOME_ENV, str(tmp_path))
    assert settings.models_dir() == tmp_path / "models"
    monkeypatch.setenv(settings.MODELS_ENV, str(tmp_path / "elsewhere"))
    assert settings.models_dir() == tmp_path / "elsewhere"


def test_every_user_of_the_home_expands_the_tilde(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PREFIXCACHE_HOME=~/x`` is one folder for the kernels, the demo model and the models
    (the demo model's copy of the parse once kept the ``~`` literal)."""
    monkeypatch.setenv(settings.HOME_ENV, "~/pc-home")
    monkeypatch.delenv(settings.MODELS_ENV, raising=False)
    home = Path.home() / "pc-home"
    assert settings.home_dir() == home
    assert demo_model.demo_home() == home / demo_model.DEMO_VERSION
    assert named_models.models_dir() == home / "models"
    source = cpu_library.CpuLibrary(Path(__file__), "t", "t", lambda lib: None)
    cxx = cpu_library.compiler()
    if cxx is not None:
        assert source.library_path(cxx).parent == home / "kernels"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("on", True), (" Yes ", True), ("0", False), ("OFF", False), ("", None)],
)
def test_progress_setting(
    value: str, expected: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(progress.PROGRESS_ENV, value)
    assert settings.progress_setting() is expected


def test_cpu_kernels_and_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, "0")
    assert not settings.cpu_kernels_enabled()
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, "1")
    assert settings.cpu_kernels_enabled()
    assert not settings.cpu_kernels_forced_avx2()
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, " AVX2")
    assert settings.cpu_kernels_enabled() and settings.cpu_kernels_forced_avx2()
    monkeypatch.setenv(settings.CPU_AMX_ENV, "off")
    assert not settings.cpu_amx_enabled()
    monkeypatch.delenv(settings.CPU_AMX_ENV)
    assert settings.cpu_amx_enabled()
    monkeypatch.setenv(settings.CXX_ENV, "")
    assert settings.compiler_override() is None
    monkeypatch.setenv(settings.CXX_ENV, "clang++")
    assert settings.compiler_override() == "clang++"


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _reads_environment(node: ast.AST) -> bool:
    """``os.environ.get(...)``, ``os.getenv(...)`` or ``os.environ[...]`` (a read)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "getenv" or (
            node.func.attr == "get" and _is_environ(node.func.value)
        )
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return _is_environ(node.value)
    return False


def test_only_the_settings_module_reads_the_environment() -> None:
    found = {}
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == ENGINE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        reads = [n for n in ast.walk(tree) if isinstance(n, ast.expr) and _reads_environment(n)]
        if lines := [n.lineno for n in reads]:
            found[str(path.relative_to(ENGINE))] = lines
    assert not found, f"environment read outside engine/settings.py: {found}"


def test_settings_is_a_leaf() -> None:
    """Standard library only: importable before torch, by anything in the engine."""
    tree = ast.parse(Path(settings.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "engine/settings.py imports from the package"
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "os", "pathlib"}, imported


def test_the_docs_table_names_every_variable() -> None:
    """docs/settings.md has a row for every ``PREFIXCACHE_*`` name the code mentions."""
    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"PREFIXCACHE_[A-Z0-9_]*[A-Z0-9]")
    names = set()
    for folder in ("engine", "sidecar", "sdk", "tests", "bench", "examples"):
        for path in (root / folder).rglob("*.py"):
            names.update(pattern.findall(path.read_text(encoding="utf-8")))
    table = (root / "docs" / "settings.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(PREFIXCACHE_[A-Z0-9_]+)` \|", table, re.MULTILINE))
    assert names, "no variable found: the scan looks in the wrong place"
    assert names <= rows, f"missing from docs/settings.md: {sorted(names - rows)}"
