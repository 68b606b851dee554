"""``[serve]`` stays a CPU install: nothing it pulls in (past torch, whose build the user
picks) is a GPU compiler or a model library the engine does not use. xgrammar brought in
triton (999 MB) and transformers (129 MB); llguidance, its replacement, needs neither."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
NEVER = {"triton", "transformers", "xgrammar"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def serve_requirements() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [_name(r) for r in config["project"]["optional-dependencies"]["serve"]]


def test_serve_names_no_gpu_compiler_or_model_library() -> None:
    assert not NEVER & set(serve_requirements())


def test_nothing_serve_installs_past_torch_needs_triton_or_transformers() -> None:
    """The installed closure of [serve]'s requirements (their own requirements, extras left
    out, markers evaluated here; torch's subtree skipped) holds none of NEVER."""
    seen: set[str] = set()
    todo = [name for name in serve_requirements() if name != "torch"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} ([serve]) is not installed")
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra's, or another platform's
            dep = _name(requirement.name)
            if dep != "torch":
                todo.append(dep)
    assert not NEVER & seen, sorted(NEVER & seen)
