"""bench/gpu_check.py stays runnable between GPU loans: without CUDA it skips with a JSON line,
and its timing code runs end to end over the CPU stand-in (``--cpu-standin``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def _last_json(args: list[str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script runs for real")
def test_gpu_check_says_it_skips_without_cuda() -> None:
    assert _last_json([]) == {"skipped": True, "reason": "cuda not available"}


def test_gpu_check_timing_code_runs_over_the_standin() -> None:
    report = _last_json(["--cpu-standin"])
    assert report["ok"] is True and report["standin"] is True
    attention, model = report["attention"], report["model"]
    assert isinstance(attention, dict) and isinstance(model, dict)
    assert attention["max_diff_vs_fixed_split"] < 2e-2  # bf16: cascade and splits agree
    for key in ("fixed_split_us", "flashinfer_split_us", "cascade_us", "plan_cascade_ms"):
        assert attention[key] > 0
    window = report["window"]
    assert isinstance(window, dict) and window["ok"] is True and window["max_abs_err"] < 3e-2
    assert window["reads_null_pages"] is False  # the stand-in reads no page before a window
    for key in ("decode_step_plain_ms", "decode_step_cascade_ms", "ttft_cold_ms", "ttft_warm_ms"):
        assert model[key] > 0
