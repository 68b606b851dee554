"""The GGUF header index (``engine/text/gguf_index.py``): a file's second load reads no header
with the ``gguf`` reader and gives the same model, tokenizer and fingerprints as its first; a
changed file, a corrupt entry or a full cache folder never serve a stale or broken index."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gguf import (  # noqa: E402
    PROMPT,
    Q,
    demo_vocab,
    random_checkpoint,
    run_logits,
    spm_vocab,
    write_gguf,
)

from prefixcache.engine.model import gguf_loader  # noqa: E402
from prefixcache.engine.model.loader import ModelLoadError, load_model  # noqa: E402
from prefixcache.engine.text import gguf_index  # noqa: E402
from prefixcache.engine.text.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return random_checkpoint(Path(folder), len(demo_vocab()[0]), tied=False)


def count_parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    parsed: list[Path] = []
    real = gguf_loader.open_gguf

    def counting(path: Path):  # type: ignore[no-untyped-def]
        parsed.append(path)
        return real(path)

    monkeypatch.setattr(gguf_loader, "open_gguf", counting)
    return parsed


@pytest.mark.parametrize(("qtype", "tokenizer"), [(Q.F32, "gpt2"), (Q.Q4_K, "spm")])
def test_a_cached_index_loads_the_same_model(
    home: Path,
    tmp_path: Path,
    model: transformers.PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
    qtype: gguf.GGMLQuantizationType,
    tokenizer: str,
) -> None:
    path = tmp_path / "m.gguf"
    if tokenizer == "spm":  # a SentencePiece vocabulary (Gemma's kind), its own vocab size
        model = random_checkpoint(tmp_path / "hf", len(spm_vocab()[0]), tied=True)
    write_gguf(path, model, qtype, tokenizer=tokenizer)
    parsed = count_parses(monkeypatch)
    first = load_model(str(path), dtype="float32", device="cpu")
    assert len(parsed) == 1 and len(list((home / "gguf-index").glob("*.msgpack"))) == 1
    second = load_model(str(path), dtype="float32", device="cpu")
    assert len(parsed) == 1, "the second load read the header from the index"
    assert second.fingerprint == first.fingerprint
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    rebuilt = Tokenizer.from_gguf(  # as the loader built it before the index
        gguf_loader.read_metadata(gguf.GGUFReader(path)), extra_eos_ids=first.config.eos_token_ids
    )
    assert rebuilt.fingerprint == first.tokenizer.fingerprint
    assert rebuilt.eos_token_ids == first.tokenizer.eos_token_ids
    text = "Hello there, caching world! 123" if tokenizer == "gpt2" else "ab ba abc"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    ids = [t % first.config.vocab_size for t in PROMPT]
    assert torch.equal(run_logits(second, ids), run_logits(first, ids))
    # the same file under another name is the same identity only through its resolved path
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    assert gguf_index.file_identity(link) == gguf_index.file_identity(path)


def test_a_changed_file_is_parsed_again(
    home: Path, tmp_path: Path, model: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, model, Q.F32)
    parsed = count_parses(monkeypatch)
    first = load_model(str(path), dtype="float32", device="cpu")
    write_gguf(path, model, Q.Q8_0)  # rewritten in place: size, mtime and bytes differ
    second = load_model(str(path), dtype="float32", device="cpu")
    assert len(parsed) == 2
    assert second.fingerprint != first.fingerprint
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(path), device="cpu")


def test_same_size_and_mtime_but_other_bytes_is_another_identity(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 200_000)
    st = path.stat()
    before = gguf_index.file_identity(path)
    with open(path, "r+b") as fh:
        fh.seek(199_990)
        fh.write(b"b")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_index.file_identity(path) != before


def test_a_corrupt_entry_is_ignored_and_rewritten(
    home: Path, tmp_path: Path, model: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, model, Q.F16)
    first = load_model(str(path), dtype="float32", device="cpu")
    (entry,) = (home / "gguf-index").glob("*.msgpack")
    entry.write_bytes(entry.read_bytes()[:100])
    parsed = count_parses(monkeypatch)
    second = load_model(str(path), dtype="float32", device="cpu")
    assert len(parsed) == 1 and second.fingerprint == first.fingerprint
    assert gguf_index.read_cached(entry.stem) is not None


def test_the_cache_keeps_at_most_max_entries(
    home: Path, tmp_path: Path, model: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_index, "MAX_ENTRIES", 2)
    for i in range(4):
        path = tmp_path / f"m{i}.gguf"
        write_gguf(path, model if i == 0 else None, Q.F32)
        gguf_index.open_index(path, gguf_loader.open_gguf)
    assert len(list((home / "gguf-index").glob("*.msgpack"))) == 2


def test_an_unwritable_home_still_loads(
    tmp_path: Path, model: transformers.PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    monkeypatch.setenv("PREFIXCACHE_HOME", str(blocked))
    path = tmp_path / "m.gguf"
    write_gguf(path, model, Q.F32)
    loaded = gguf_loader.load_gguf(path, torch.float32, torch.device("cpu"))
    assert loaded.config.num_layers > 0
