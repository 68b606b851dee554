"""The private torch ops the engine calls all exist in the installed torch: an upgrade that
drops one fails here, by name, instead of on a user's first request."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from prefixcache.engine.kernels import torch_private

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def test_every_private_op_the_engine_calls_exists() -> None:
    assert torch_private.missing_ops() == [], f"torch {torch.__version__} lacks them"


def test_private_ops_are_called_from_torch_private_only() -> None:
    calls = re.compile(r"torch\.ops\.\w+\.(_\w+)")
    for path in ENGINE.rglob("*.py"):
        if path.name == "torch_private.py":
            continue
        found = calls.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{path.relative_to(ENGINE)} calls private torch ops {found}"
    named = set(calls.findall((ENGINE / "kernels/torch_private.py").read_text()))
    assert named == {name for _, name in torch_private.OPS}, "OPS must list every op it calls"


def test_flash_attention_cpu_returns_the_output_and_its_lse() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    out, lse = torch_private.flash_attention_cpu(q, k, v, True, 0.25)
    scores = (q @ k.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
