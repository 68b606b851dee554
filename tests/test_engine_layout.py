"""The engine's rooms (docs/internals.md): every folder holds at most 15 modules, no module
over 400 lines, no import cycle between the engine's modules nor between its rooms, deferred
imports included (imports under ``TYPE_CHECKING`` are annotations only and left out), and the
internals map names every module by its path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
MAX_MODULES = 15
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(("prefixcache", "engine", *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if candidate in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {module for module in found if module in modules and module != name}


def test_every_engine_folder_holds_at_most_15_modules() -> None:
    folders = {path.parent for path in ENGINE.rglob("*.py")}
    counts = {str(folder.relative_to(ENGINE)): len(list(folder.glob("*.py"))) for folder in folders}
    assert len(counts) > 1, counts  # the scan found the rooms
    assert all(count <= MAX_MODULES for count in counts.values()), counts


def test_no_engine_module_is_over_400_lines() -> None:
    long = {
        path.relative_to(ENGINE).as_posix()
        for path in ENGINE.rglob("*.py")
        if len(path.read_text(encoding="utf-8").splitlines()) > MAX_LINES
    }
    assert not long, sorted(long)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()
    on_path: list[str] = []

    def walk(name: str) -> list[str] | None:
        on_path.append(name)
        for dep in sorted(graph[name]):
            if dep in on_path:
                return [*on_path[on_path.index(dep) :], dep]
            if dep not in done and (cycle := walk(dep)):
                return cycle
        on_path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if name not in done and (cycle := walk(name)):
            return cycle
    return None


def _room(module: str) -> str:
    """A module's room: its folder; the top level's leaves together, ``engine.py`` apart."""
    parts = module.split(".")[2:]
    if module == "prefixcache.engine.engine":
        return "engine.py"
    if len(parts) > 1 or (parts and (ENGINE / parts[0]).is_dir()):
        return parts[0]
    return "top-level leaves"


def test_the_engine_has_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["prefixcache.engine.engine"], "the scan finds no imports"
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_imports_between_rooms_flow_one_way() -> None:
    modules = _modules()
    rooms: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {_room(dep) for dep in _imports(name, path, modules)}
        rooms.setdefault(_room(name), set()).update(deps - {_room(name)})
    assert {"memory", "serving", "top-level leaves"} <= set(rooms), sorted(rooms)
    assert not rooms["top-level leaves"], rooms["top-level leaves"]  # leaves import no room
    cycle = _find_cycle(rooms)
    assert cycle is None, " -> ".join(cycle)


def test_the_internals_map_names_every_engine_module_with_its_room() -> None:
    """docs/internals.md's engine table has a row per module, named by its path in engine/
    (a room's ``__init__.py`` that holds only its docstring aside)."""
    doc = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    missing = []
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE).as_posix()
        body = ast.parse(path.read_text(encoding="utf-8")).body
        only_docstring = len(body) <= 1 and all(isinstance(node, ast.Expr) for node in body)
        if path.name == "__init__.py" and rel != "__init__.py" and only_docstring:
            continue
        if f"| `{rel}`" not in doc:
            missing.append(rel)
    assert not missing, f"not in docs/internals.md's engine table: {missing}"
