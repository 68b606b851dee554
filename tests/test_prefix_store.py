"""Pinned prefixes saved to disk and loaded into a fresh engine: hits, same outputs, refusals."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory import prefix_store
from prefixcache.engine.memory.prefix_store import PrefixStoreError
from prefixcache.engine.request import EngineRequest, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def loaded(demo_loaded):  # the session's demo model (tests/conftest.py)
    return demo_loaded


def make_engine(loaded, **overrides) -> LLMEngine:
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=256)
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(engine: LLMEngine, prompt: list[int], namespace: str = "") -> tuple[list[int], int]:
    request = EngineRequest(f"r{random.random()}", prompt, SamplingParams(8, ignore_eos=True))
    request.namespace = namespace
    result = engine.generate([request])[0]
    return result.token_ids, result.usage.cached_tokens


def logprobs(engine: LLMEngine, prompt: list[int]) -> list[float]:
    sampling = SamplingParams(4, ignore_eos=True, logprobs=5)
    result = engine.generate([EngineRequest(f"l{random.random()}", prompt, sampling)])[0]
    return [lp for entry in result.logprobs for _, lp in entry.top]


def pages(engine: LLMEngine, prompt: list[int], namespace: str = "") -> list[torch.Tensor]:
    blocks = engine.block_manager.match(prompt, namespace, len(prompt)).blocks
    index = torch.tensor(blocks, dtype=torch.long)
    return [layer.index_select(0, index) for layer in engine.kv_cache.layers]


def pinned_engine(loaded, prefixes: dict[str, list[int]]) -> LLMEngine:
    """An engine that computed and pinned each namespace's prefix."""
    engine = make_engine(loaded)
    for namespace, prefix in prefixes.items():
        run(engine, prefix, namespace)
        assert engine.pin(prefix, namespace) == len(prefix) // BS
    return engine


def test_loaded_prefix_hits_and_gives_the_same_tokens(loaded, tmp_path: Path) -> None:
    vocab = loaded.config.vocab_size
    system, other = tokens(1, 100, vocab), tokens(2, 40, vocab)
    saved = pinned_engine(loaded, {"": system, "tenant-b": other})
    run(saved, tokens(9, 64, vocab))  # cached but not pinned: not saved
    result = saved.save_pinned(tmp_path / "pinned.safetensors")
    assert (result.prefixes, result.blocks) == (2, 100 // BS + 40 // BS)

    fresh = make_engine(loaded)
    loaded_result = fresh.load_pinned(tmp_path / "pinned.safetensors")
    assert loaded_result.restored_blocks == result.blocks
    assert loaded_result.pinned_prefixes == 2 and loaded_result.skipped_blocks == 0
    fresh.block_manager.check_invariants()
    assert fresh.block_manager.num_pinned_blocks == result.blocks
    assert fresh.block_manager.num_used_blocks == 0

    for before, after in zip(pages(saved, system), pages(fresh, system), strict=True):
        assert after.shape[0] == 100 // BS and torch.equal(before, after)  # the very KV
    question = system + tokens(3, 20, vocab)
    uncached = make_engine(loaded, enable_prefix_caching=False)
    expected, _ = run(uncached, question)
    got, cached = run(fresh, question)
    assert cached == (100 // BS) * BS  # the loaded blocks, no recompute
    assert got == expected
    got_logprobs, expected_logprobs = logprobs(fresh, question), logprobs(uncached, question)
    torch.testing.assert_close(got_logprobs, expected_logprobs, atol=1e-4, rtol=1e-4)
    # Namespaces survive: tenant-b's prefix hits only under tenant-b.
    assert run(fresh, other + [5, 6, 7], "tenant-b")[1] == (40 // BS) * BS
    assert run(fresh, other + [5, 6, 7], "")[1] == 0
    assert fresh.block_manager.num_used_blocks == 0


def test_loading_twice_reuses_blocks_and_pins_once(loaded, tmp_path: Path) -> None:
    prefix = tokens(4, 80, loaded.config.vocab_size)
    pinned_engine(loaded, {"": prefix}).save_pinned(tmp_path / "p.safetensors")
    engine = make_engine(loaded)
    first = engine.load_pinned(tmp_path / "p.safetensors")
    second = engine.load_pinned(tmp_path / "p.safetensors")
    assert (second.restored_blocks, second.reused_blocks) == (0, first.restored_blocks)
    assert second.pinned_prefixes == 0  # already pinned here: not pinned twice
    assert engine.unpin(prefix, "") == 80 // BS
    assert engine.block_manager.num_pinned_blocks == 0
    engine.block_manager.check_invariants()


def test_a_small_pool_restores_what_fits_and_never_takes_pinned_or_running_blocks(
    loaded, tmp_path: Path
) -> None:
    vocab = loaded.config.vocab_size
    pinned_engine(loaded, {"": tokens(5, 160, vocab)}).save_pinned(tmp_path / "big.safetensors")
    engine = make_engine(loaded, num_blocks=12)
    mine = tokens(6, 48, vocab)
    run(engine, mine)
    engine.pin(mine, "")  # 3 blocks pinned here
    result = engine.load_pinned(tmp_path / "big.safetensors")
    assert result.restored_blocks == 12 - 3  # every unpinned page, no more
    assert result.skipped_blocks == 10 - result.restored_blocks
    assert result.pinned_prefixes == 0  # the saved pin was on the last, skipped block
    assert run(engine, mine + [9])[1] == 48  # our own pinned prefix is intact
    engine.block_manager.check_invariants()


def test_files_from_elsewhere_or_damaged_are_refused_untouched(loaded, tmp_path: Path) -> None:
    prefix = tokens(7, 64, loaded.config.vocab_size)
    path = tmp_path / "p.safetensors"
    pinned_engine(loaded, {"": prefix}).save_pinned(path)

    bf16 = LLMEngine(EngineConfig(model="demo", dtype="bfloat16", device="cpu", num_blocks=64))
    with pytest.raises(PrefixStoreError, match="another model, tokenizer or dtype"):
        bf16.load_pinned(path)
    with pytest.raises(PrefixStoreError, match="block size"):
        make_engine(loaded, block_size=32).load_pinned(path)

    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a bit of KV
    damaged.write_bytes(bytes(data))
    engine = make_engine(loaded)
    with pytest.raises(PrefixStoreError, match="checksum"):
        engine.load_pinned(damaged)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PrefixStoreError, match="not a readable"):
        engine.load_pinned(tmp_path / "junk.safetensors")
    with pytest.raises(PrefixStoreError, match="no such file"):
        engine.load_pinned(tmp_path / "missing.safetensors")
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks  # nothing was touched


def test_saving_nothing_pinned_writes_an_empty_file_that_loads(loaded, tmp_path: Path) -> None:
    engine = make_engine(loaded)
    run(engine, tokens(8, 40, loaded.config.vocab_size))  # cached, not pinned
    result = engine.save_pinned(tmp_path / "empty.safetensors")
    assert (result.prefixes, result.blocks) == (0, 0)
    again = make_engine(loaded).load_pinned(tmp_path / "empty.safetensors")
    assert (again.restored_blocks, again.skipped_blocks) == (0, 0)


def test_a_crafted_file_with_a_valid_checksum_is_refused_without_a_leak(
    loaded, tmp_path: Path
) -> None:
    """The checksum guards against damage, not against a file made to pass it."""
    path = tmp_path / "p.safetensors"
    pinned_engine(loaded, {"": tokens(11, 64, loaded.config.vocab_size)}).save_pinned(path)
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["kv.0"] = tensors["kv.0"][:2]  # fewer KV rows than blocks
    metadata.pop("hmac")
    metadata["hmac"] = prefix_store.sign(b"", metadata, tensors)  # the test engines' key
    crafted = tmp_path / "crafted.safetensors"
    save_file(tensors, str(crafted), metadata=metadata)
    engine = make_engine(loaded)
    with pytest.raises(PrefixStoreError, match="disagree"):
        engine.load_pinned(crafted)
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.stats().num_free_blocks == engine.block_manager.num_blocks


def test_concurrent_saves_to_one_name_all_succeed(loaded, tmp_path: Path) -> None:
    engine = pinned_engine(loaded, {"": tokens(12, 48, loaded.config.vocab_size)})
    snap = engine.snapshot_pinned()
    path = tmp_path / "same.safetensors"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: prefix_store.write(snap, path, b""), range(8)))
    assert all(r.blocks == 3 for r in results)
    assert make_engine(loaded).load_pinned(path).restored_blocks == 3
    assert [p.name for p in tmp_path.iterdir()] == ["same.safetensors"]  # no temporary left
