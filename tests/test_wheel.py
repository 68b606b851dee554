"""The wheel ships every file the code loads, and a non-editable install of it loads both
CPU kernel libraries.

The other tests run from an editable install, which reads the source folders and so never
sees a file missing from ``[tool.setuptools.package-data]``. Here the tracked files (``git
ls-files``) of the layer folders are copied to a scratch tree, built with ``pip wheel
--no-deps --no-build-isolation`` (offline: the environment's setuptools), the wheel's names
compared with the tracked ones, and the wheel installed into a scratch venv that borrows this
environment's site-packages (torch is not installed again) through a path-only ``.pth`` line,
so this environment's editable ``prefixcache`` finder is not run there. The kernels' build
cache (``$PREFIXCACHE_HOME/kernels``) is keyed by the source's bytes, so a load there reads
the installed ``.cpp`` even when a library built from the same bytes is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Built:
    wheel: Path
    names: frozenset[str]  # every name in the wheel
    expected: dict[str, str]  # tracked file (repo-relative) -> its name in the wheel
    python: Path  # the scratch venv's interpreter, the wheel installed


def _layer_folders() -> dict[str, str]:
    """``pyproject.toml``'s package-dir: folder -> its name in the wheel (``engine`` ->
    ``prefixcache/engine``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {folder: package.replace(".", "/") for package, folder in package_dir.items()}


def _tracked() -> list[str]:
    try:
        done = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"git ls-files failed here ({exc}): no tracked-file list to check against")
    return [name for name in done.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def _expected(tracked: list[str]) -> dict[str, str]:
    """Every tracked file under a layer folder, with where the wheel must hold it."""
    folders = _layer_folders()
    expected = {}
    for name in tracked:
        folder, _, rest = name.partition("/")
        if folder in folders and rest:
            expected[name] = f"{folders[folder]}/{rest}"
    return expected


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    pytest.importorskip("setuptools", reason="building offline needs setuptools here")
    tmp = tmp_path_factory.mktemp("wheel")
    tracked = _tracked()
    expected = _expected(tracked)
    assert expected, "no tracked files under the layer folders"
    # A clean tree of tracked files only, as a fresh clone has: no stale build/ to leak in.
    src = tmp / "src"
    for name in [*expected, "pyproject.toml", "README.md"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src], tmp)
    (wheel,) = dist.glob("prefixcache-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = frozenset(zf.namelist())

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp)
    python = venv / "bin" / "python"
    scratch_site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp
        ).stdout.strip()
    )
    # A path line (not an import line) appends this environment's site-packages after the
    # venv's own; the .pth files there (the editable finder) are not processed.
    (scratch_site / "zz_borrowed_site.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --target installs as files into the venv's site-packages without looking at (or
    # uninstalling) the editable prefixcache this environment's site-packages lists.
    _run([*pip, "install", "--no-deps", "--no-index", "--target", scratch_site, wheel], tmp)
    yield Built(wheel, names, expected, python)


def test_the_wheel_holds_every_tracked_file(built: Built) -> None:
    missing = sorted(
        name for name, in_wheel in built.expected.items() if in_wheel not in built.names
    )
    assert not missing, f"tracked but not in {built.wheel.name}: {missing}"
    data = [name for name in built.expected if not name.endswith(".py")]
    assert any(name.endswith(".cpp") for name in data), data  # the check covers the kernels


# Run in the scratch venv: where each package was imported from, its .cpp sources as
# package resources, and the kernels' load outcome (or why they cannot run on this machine).
PROBE = """
import importlib.resources, json, sys
import prefixcache.engine
from prefixcache.engine.kernels import cpu_gemm, cpu_layer_ops, cpu_qgemm, cpu_replay
from prefixcache.engine.attention import cpu_kernels, row_kernels
cpps = json.loads(sys.argv[1])
libraries = {
    "layer ops": cpu_layer_ops._library, "attention": cpu_kernels._library,
    "row attention": row_kernels._row_library, "gemm": cpu_gemm._library,
    "row attention (fp32)": row_kernels._row_f32_library,
    "quantized gemm": cpu_qgemm._library, "gemm on amx": cpu_gemm._amx_library,
    "replay": cpu_replay._library,
}
report = {
    "engine_file": prefixcache.engine.__file__,
    "resources": {c: importlib.resources.files(p).joinpath(n).is_file() for c, (p, n) in cpps.items()},
    "libraries": {
        name: {"reason": lib.unavailable_reason(), "loaded": lib.load() is not None}
        for name, lib in libraries.items()
    },
}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def probe(built: Built) -> dict[str, object]:
    cpps = {}
    for name, in_wheel in built.expected.items():
        if name.endswith(".cpp"):
            package, _, file_name = in_wheel.rpartition("/")
            cpps[name] = (package.replace("/", "."), file_name)
    # -I: neither the working directory nor PYTHONPATH can put the source folders in reach.
    cmd = [built.python, "-I", "-c", PROBE, json.dumps(cpps)]
    done = _run(cmd, built.python.parent, timeout=900)
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    report["venv"] = str(built.python.parent.parent)
    report["cpps"] = sorted(cpps)
    return report


def test_the_installed_wheel_holds_the_kernel_sources(probe: dict[str, object]) -> None:
    engine_file = str(probe["engine_file"])
    assert engine_file.startswith(str(probe["venv"]) + os.sep), engine_file  # not the sources
    resources = probe["resources"]
    assert isinstance(resources, dict) and sorted(resources) == probe["cpps"]
    assert all(resources.values()), resources


def test_the_installed_wheel_loads_every_kernel_library(probe: dict[str, object]) -> None:
    """Each library that can run on this machine builds and loads from the installed wheel
    (its sources and the headers they include, the AVX2 build's shim among them)."""
    libraries = probe["libraries"]
    assert isinstance(libraries, dict) and len(libraries) == 8
    runnable = {name: lib for name, lib in libraries.items() if lib["reason"] is None}
    if not runnable:
        reasons = sorted({lib["reason"] for lib in libraries.values()})
        pytest.skip(f"no CPU kernel library can run on this machine: {reasons}")
    failed = [name for name, lib in runnable.items() if not lib["loaded"]]
    assert not failed, f"runnable here but not loaded from the installed wheel: {failed}"
