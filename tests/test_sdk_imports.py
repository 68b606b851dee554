"""The SDK's import graph: one-way, with segment.py a leaf under lint, fingerprint and the
renderers, and prompt.py above them.

Built from the source with ``ast``. An edge is any import of another sdk module, wherever it
stands (module level, under ``TYPE_CHECKING``, inside a function), and no module may defer an
import, so a deferral cannot hide a cycle.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

SDK = Path(__file__).resolve().parent.parent / "sdk"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(SDK.glob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, names: set[str]) -> set[str]:
    """The sdk modules an import statement names (relative or ``prefixcache.sdk.*``)."""
    out: set[str] = set()
    if isinstance(node, ast.ImportFrom):
        if node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)  # from . import x
        elif node.level == 0 and node.module:
            if node.module.startswith("prefixcache.sdk."):
                out.add(node.module.split(".")[2])
            elif node.module == "prefixcache.sdk":
                out.update(a.name for a in node.names)
    else:
        for alias in node.names:
            if alias.name.startswith("prefixcache.sdk."):
                out.add(alias.name.split(".")[2])
    return out & names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, names: set[str]) -> tuple[set[str], set[str]]:
    """(eager, deferred) targets: deferred ones sit in a function or under TYPE_CHECKING."""
    eager: set[str] = set()
    deferred: set[str] = set()

    def visit(node: ast.AST, is_deferred: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (deferred if is_deferred else eager).update(_targets(node, names))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            is_deferred = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, is_deferred)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, is_deferred)

    visit(tree, False)
    return eager, deferred


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    names = set(modules)
    eager: dict[str, set[str]] = {}
    deferred: dict[str, set[str]] = {}
    for name, tree in modules.items():
        eager[name], deferred[name] = _imports(tree, names)
        eager[name].discard(name)
    return eager, deferred


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)) is not None:
            return cycle
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_scanner_sees_every_kind_of_import() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from .a import x\n"
        "from . import b\n"
        "import prefixcache.sdk.c\n"
        "if TYPE_CHECKING:\n    from .d import y\n"
        "def f():\n    from prefixcache.sdk.e import z\n"
    )
    eager, deferred = _imports(tree, {"a", "b", "c", "d", "e"})
    assert eager == {"a", "b", "c"} and deferred == {"d", "e"}


def test_sdk_import_graph_is_acyclic() -> None:
    eager, deferred = _graph()
    graph = {n: eager[n] | deferred[n] for n in eager}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"


def test_no_module_defers_an_import() -> None:
    _, deferred = _graph()
    assert {n: d for n, d in deferred.items() if d} == {}


def test_segment_is_a_leaf_under_lint_fingerprint_and_renderers() -> None:
    eager, _ = _graph()
    assert eager["segment"] <= {"canonical", "stability"}
    assert eager["stability"] == set()
    for user in ("lint", "fingerprint", "render_sidecar", "render_openai", "render_anthropic"):
        assert "segment" in eager[user], user
        assert "prompt" not in eager[user], user


def test_stability_order_is_defined_once() -> None:
    """No sdk module but stability.py spells the four classes out as an order."""
    spelled = []
    for path in sorted(SDK.glob("*.py")):
        if path.stem == "stability":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Dict, ast.Set)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                values = [i.value for i in items if isinstance(i, ast.Constant)]
                if {"static", "shared", "session"} <= set(values):
                    spelled.append(f"{path.name}:{node.lineno}")
    assert spelled == []


def test_importing_segment_loads_none_of_its_users() -> None:
    # prefixcache.sdk's __init__ imports everything: stand in an empty package for it
    code = (
        "import json, sys, types\n"
        "pkg = types.ModuleType('prefixcache.sdk')\n"
        f"pkg.__path__ = [{str(SDK)!r}]\n"
        "sys.modules['prefixcache.sdk'] = pkg\n"
        "import prefixcache.sdk.segment\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('prefixcache.sdk.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [
        "prefixcache.sdk.canonical",
        "prefixcache.sdk.segment",
        "prefixcache.sdk.stability",
    ]
