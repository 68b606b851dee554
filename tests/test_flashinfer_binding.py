"""Every FlashInfer call FlashInferBackend makes binds to the installed flashinfer-python's
signatures: the exact arguments (recorded by the stand-in while the backend plans and runs
prefills, decodes, cascade groups, batch invariance on and off, a sliding window) go through
``inspect.signature(...).bind`` on the real package, so an API change fails here, not on a
user's first GPU run.

flashinfer-python is a test-only install: each version below is installed once, without its
CUDA dependencies (it imports on CPU), into ``$PREFIXCACHE_HOME/test-deps``; the signatures
are read in a subprocess (one version per process). Where no wheel can be installed (no
registry), the test skips and says why. 0.7.2.post1 is what the GPU kit carries
(../shared/tools/flashinfer_kit.sh, bench/gpu_check.py); 0.7.4 is the newest checked.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import flashinfer_standin
import pytest
import torch
from test_flashinfer_standin import GROUPED, MIXED, make_case, run, standin_backend

from prefixcache.engine.settings import home_dir

VERSIONS = ("0.7.2.post1", "0.7.4")
# What `import flashinfer` needs beyond the engine's own dependencies, on CPU.
IMPORT_DEPS = ("nvidia-ml-py", "einops", "tabulate", "apache-tvm-ffi>=0.1.11,<0.2")
TARGETS = {
    "BatchPrefillWithPagedKVCacheWrapper": "BatchPrefillWithPagedKVCacheWrapper.__init__",
    "BatchDecodeWithPagedKVCacheWrapper": "BatchDecodeWithPagedKVCacheWrapper.__init__",
    "MultiLevelCascadeAttentionWrapper": "MultiLevelCascadeAttentionWrapper.__init__",
}
# Fronts that take ``**kwargs`` and pass them on: the call is bound to where they go as well.
FORWARDS = {
    "BatchDecodeWithPagedKVCacheWrapper.plan": "BatchDecodeWithPagedKVCacheWrapper._plan_impl",
}
EXPECTED_CALLS = {
    "append_paged_kv_cache",
    *TARGETS,
    *(f"{w}.{m}" for w in TARGETS for m in ("plan", "run")),
}
SIGNATURES = r"""
import inspect, json, sys
import flashinfer
names = json.loads(sys.argv[1])
out = {"__version__": flashinfer.__version__}
for name in names:
    obj = flashinfer
    for part in name.split("."):
        obj = getattr(obj, part)
    out[name] = [(p.name, int(p.kind), p.default is not inspect.Parameter.empty)
                 for p in inspect.signature(obj).parameters.values()]
print(json.dumps(out))
"""


def _install(version: str) -> Path:
    """The folder holding flashinfer-python ``version`` (installed on first use), or skip."""
    target = home_dir() / "test-deps" / f"flashinfer-{version}"
    stamp = target / ".installed"
    if stamp.exists():
        return target
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    cmd += ["--target", str(target), f"flashinfer-python=={version}", *IMPORT_DEPS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing flashinfer-python=={version} took over 15 minutes")
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "WARNING" not in ln]
        pytest.skip(
            f"no flashinfer-python=={version} wheel could be installed from the registry: "
            f"{lines[-1] if lines else proc.returncode}"
        )
    stamp.touch()
    return target


def _signatures(version: str) -> dict[str, Any]:
    target = _install(version)
    names = sorted({TARGETS.get(n, n) for n in EXPECTED_CALLS} | set(FORWARDS.values()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-c", SIGNATURES, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, f"import flashinfer=={version} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _signature(spec: list[tuple[str, int, bool]]) -> inspect.Signature:
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                inspect._ParameterKind(kind),
                default=None if has_default else inspect.Parameter.empty,
            )
            for name, kind, has_default in spec
        ]
    )


def _recorded_calls() -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Every call the backend makes to flashinfer over steps of every kind."""
    flashinfer_standin.calls.clear()
    for kwargs in ({"batch_invariant": True}, {"batch_invariant": False}, {"window_left": 31}):
        for spec, shared in ((MIXED, 0), (GROUPED + MIXED, 64)):
            for dtype in (torch.float32, torch.bfloat16):
                case = make_case(spec, 8, 2, shared=shared, seed=1, dtype=dtype)
                run(standin_backend(**kwargs), case, 8, 2, cascade=True)
    return list(flashinfer_standin.calls)


def test_the_backend_makes_every_expected_call() -> None:
    assert {name for name, _, _ in _recorded_calls()} == EXPECTED_CALLS


@pytest.mark.parametrize("version", VERSIONS)
def test_every_call_binds_to_the_installed_flashinfer(version: str) -> None:
    sigs = _signatures(version)
    assert sigs["__version__"] == version
    calls = _recorded_calls()
    for name, args, kwargs in calls:
        target = TARGETS.get(name, name)
        _bind(version, name, sigs, target, args, kwargs)
        if target in FORWARDS:  # where its **kwargs go
            _bind(version, name, sigs, FORWARDS[target], args, kwargs)


def _bind(
    version: str,
    name: str,
    sigs: dict[str, Any],
    target: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    sig = _signature(sigs[target])
    bind_args = (None, *args) if "." in target else args  # methods: a stand-in self
    try:
        bound = sig.bind(*bind_args, **kwargs)
    except TypeError as e:
        pytest.fail(f"flashinfer {version}: {name}(...) does not bind to {target}: {e}\n  {sig}")
    for param in sig.parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:  # nothing through legacy *args
            assert not bound.arguments.get(param.name), f"{name}: positional {param.name}"
        if param.kind is inspect.Parameter.VAR_KEYWORD and target not in FORWARDS:
            assert not bound.arguments.get(param.name), (
                f"{target} takes **{param.name}: add where it forwards them to FORWARDS"
            )
