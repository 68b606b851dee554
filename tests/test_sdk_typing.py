"""The SDK ships ``py.typed``, so its annotations are part of its contract: ``mypy --strict``
passes on the package itself and on a user's script that uses its public names the way the
README and docs/sdk.md do (re-exports explicit, no ``Any`` leaking out of typed calls)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

SDK = Path(__file__).resolve().parent.parent / "sdk"

USER_SCRIPT = """
from __future__ import annotations

from prefixcache.sdk import (
    AsyncClient, CacheStats, Client, CompletionStream, Delta, Prompt, SessionReport, Timeouts,
)
from prefixcache.sdk.client import AsyncClient as AsyncClientAgain
from prefixcache.sdk.types import CacheStats as StatsAgain


async def ask(client: AsyncClient, prompt: Prompt) -> tuple[str, int]:
    out = await client.complete(prompt, max_tokens=8)
    stats: CacheStats = await client.cache_stats()
    stream: CompletionStream = client.stream(prompt, max_tokens=8)
    async with stream:
        async for delta in stream:
            d: Delta = delta
            print(d.text)
    report: SessionReport = client.cache_report()
    print(report.table(), stats)
    return out.text, out.usage.cached_tokens


def ask_blocking(prompt: Prompt) -> str:
    with Client(timeout=Timeouts(total=30.0)) as client:
        return client.complete(prompt, max_tokens=8).text


prompt = Prompt.builder().static("rules", tag="rules").dynamic("question", tag="question").build()
found: list[str] = [f.rule for f in prompt.lint()]
same: type[AsyncClient] = AsyncClientAgain
again: type[CacheStats] = StatsAgain
"""


def test_sdk_and_a_user_script_pass_mypy_strict(tmp_path: Path) -> None:
    # mypy does not follow an editable install's import hook: give it the package as a tree.
    root = tmp_path / "root"
    (root / "prefixcache").mkdir(parents=True)
    (root / "prefixcache" / "sdk").symlink_to(SDK, target_is_directory=True)
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--explicit-package-bases",
            str(root / "prefixcache" / "sdk"),
            str(script),
        ],
        cwd=root,
        env={"MYPYPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
