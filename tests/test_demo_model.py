"""The built-in demo model: deterministic, fast to create and load, a real HF folder."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from prefixcache.engine.attention import create_backend
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model import demo_model
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner


def test_two_fresh_creations_are_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fps = []
    for name in ("a", "b"):
        monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path / name))
        t0 = time.perf_counter()
        loaded = load_model("demo")
        assert time.perf_counter() - t0 < 30  # create + load in seconds (generous for CI)
        fps.append((loaded.fingerprint, loaded.tokenizer.fingerprint))
        assert loaded.name == "demo"
    assert fps[0] == fps[1]
    a = (tmp_path / "a" / "demo-v1" / "model.safetensors").read_bytes()
    b = (tmp_path / "b" / "demo-v1" / "model.safetensors").read_bytes()
    assert a == b


def test_demo_is_a_real_hf_folder(tmp_path: Path) -> None:
    folder = demo_model.ensure_demo_model(tmp_path / "demo-v1")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (512, 4, 4)
    assert cfg["max_position_embeddings"] >= 49152
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and tok_cfg["eos_token"] == "<|eot_id|>"
    # A second call reuses the folder.
    assert demo_model.ensure_demo_model(tmp_path / "demo-v1") == folder


def test_concurrent_first_use_does_not_clash(tmp_path: Path) -> None:
    home = tmp_path / "demo-v1"
    results: list[Path] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(demo_model.ensure_demo_model(home))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [home] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v1"]  # no temp folders left


def test_chat_template_and_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    tok = load_model("demo").tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
    )
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.token_to_id("<|eot_id|>") in tok.eos_token_ids
    assert tok.decode(tok.encode("plain text, café")) == "plain text, café"
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_long_prompt_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 48K-token prompt fits the demo's positions; run its tail over a (zero) cached prefix."""
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    loaded = load_model("demo")
    assert loaded.config.max_position_embeddings >= 48 * 1024
    cache = KVCache(loaded.kv_cache_spec(16), num_blocks=2)
    runner = ModelRunner(loaded, cache, create_backend("torch", "cpu"))
    start = 48 * 1024 - 8
    table = [0] * 3071 + [1]  # one physical page stands in for the whole (zero) prefix
    logits = runner.execute([BatchEntry(list(range(8)), start, table)])
    assert logits.shape == (1, loaded.config.vocab_size) and torch.isfinite(logits).all()


def test_shipped_tokenizer_matches_training_on_shipped_corpus() -> None:
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(demo_model.ASSETS / "tokenizer.json"))
    trained = Tokenizer.from_str(demo_model.train_demo_tokenizer())
    assert trained.get_vocab() == shipped.get_vocab()
