"""Mistral's, Phi-3's and Qwen2/Qwen3's sliding windows, applied as transformers applies them:
Mistral and Phi-3 slide on every layer (no global layer at all), Qwen2/Qwen3 with
``use_sliding_window`` on the layers from ``max_window_layers`` on. Tiny random checkpoints
written by transformers, served by the whole engine on the CPU kernels: greedy tokens equal
transformers' past the window (float32), and cached, uncached, chunked and batched runs give
the same tokens at the default dtype (hypothesis), with running sequences holding only their
window of local pages."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager  # noqa: E402
from prefixcache.engine.model.demo_model import ASSETS  # noqa: E402
from prefixcache.engine.model.loader import LoadedModel, load_model  # noqa: E402
from prefixcache.engine.model.model_config import ModelConfig  # noqa: E402
from prefixcache.engine.request import EngineRequest, SamplingParams  # noqa: E402

WINDOW = 24  # a page and a half
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # the CPU kernels' head sizes
    max_position_embeddings=512,
)
KINDS = ("mistral", "qwen2", "phi3")


def make_hf(kind: str, window: int | None = WINDOW, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=window, **TINY)
        )
    elif kind == "phi3":  # every layer slides (Phi-3-mini-4k: 2047 of 4096)
        model = transformers.Phi3ForCausalLM(
            transformers.Phi3Config(sliding_window=window, pad_token_id=0, **TINY)
        )
    else:  # layer 0 global, layers 1 and 2 sliding
        cfg = transformers.Qwen2Config(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=1,
            **TINY,
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # the init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    out = {}
    for kind in KINDS:
        hf = make_hf(kind)
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)
        shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
        out[kind] = (folder, hf)
    return out


def engine_for(folder: Path, dtype: str, **overrides: object) -> LLMEngine:
    loaded = load_model(str(folder), dtype=dtype, device="cpu")
    config = EngineConfig(model=str(folder), dtype=dtype, device="cpu", num_blocks=128, **overrides)
    return LLMEngine(config, loaded)


def greedy(
    engine: LLMEngine, prompts: list[list[int]], tag: str, max_tokens: int = 8
) -> list[tuple[list[int], int]]:
    """All prompts in one batch: (tokens, cached_tokens) each."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [EngineRequest(f"{tag}{i}", p, sampling) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    engine.block_manager.check_invariants()
    return [(list(o.token_ids), o.usage.cached_tokens) for o in outs]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int = 8) -> list[int]:
    """transformers' argmax, n times, no token masked (as ``ignore_eos`` serves it)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def windows_of(**raw: object) -> tuple[int, ...]:
    return ModelConfig.from_dict(dict(TINY, **raw)).layer_windows


def test_configs_slide_as_transformers_decides() -> None:
    mistral = {"architectures": ["MistralForCausalLM"]}
    assert windows_of(**mistral, sliding_window=WINDOW) == (WINDOW,) * 3
    assert windows_of(**mistral, sliding_window=None) == ()
    # MistralConfig's default window (4096) when the key is absent; past every position: off
    assert windows_of(**mistral, max_position_embeddings=32768) == (4096,) * 3
    assert windows_of(**mistral) == ()
    smol = {"architectures": ["SmolLM3ForCausalLM"], "no_rope_layer_interval": 3}
    assert windows_of(**smol, sliding_window=WINDOW) == ()  # use_sliding_window off
    on = {**smol, "sliding_window": WINDOW, "use_sliding_window": True}
    assert windows_of(**on) == (0, 0, WINDOW)  # transformers' rule: the NoPE layers slide
    phi3 = {"architectures": ["Phi3ForCausalLM"]}
    assert windows_of(**phi3, sliding_window=WINDOW) == (WINDOW,) * 3
    assert windows_of(**phi3, max_position_embeddings=32768) == ()  # no default window
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        qwen = {"architectures": [arch], "sliding_window": WINDOW}
        assert windows_of(**qwen) == ()  # use_sliding_window defaults to off
        assert windows_of(**qwen, use_sliding_window=True, max_window_layers=1) == (0, 24, 24)
        assert windows_of(**qwen, use_sliding_window=True) == ()  # max_window_layers 28
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        assert windows_of(**qwen, use_sliding_window=True, layer_types=types) == (24, 0, 24)
    cfg = ModelConfig.from_dict(dict(TINY, **mistral, sliding_window=WINDOW))
    assert cfg.is_hybrid and cfg.sliding_window == WINDOW


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_transformers_past_the_window(
    checkpoints: dict[str, tuple[Path, object]], kind: str
) -> None:
    folder, hf = checkpoints[kind]
    engine = engine_for(folder, "float32", max_num_batched_tokens=64)  # chunked prefill too
    assert isinstance(engine.block_manager, HybridBlockManager)
    prompts = random_prompts(1, (20, 70, 150))
    cold = greedy(engine, prompts, "cold")
    assert [t for t, _ in cold] == [hf_greedy(hf, p) for p in prompts]
    # The same prefixes again with new tails: hits, and still transformers' tokens
    tails = random_prompts(2, (5, 5, 5))
    warm_prompts = [p + t for p, t in zip(prompts, tails, strict=True)]
    warm = greedy(engine, warm_prompts, "warm")
    assert [c for _, c in warm] == [16, 64, 144]  # every full block of each prompt
    assert [t for t, _ in warm] == [hf_greedy(hf, p) for p in warm_prompts]


@pytest.mark.parametrize("kind", KINDS)
def test_the_window_matters(checkpoints: dict[str, tuple[Path, object]], kind: str) -> None:
    """The same weights attending fully give other tokens past the window."""
    folder, hf = checkpoints[kind]
    full = make_hf(kind, window=None)
    full.load_state_dict(hf.state_dict())
    prompts = random_prompts(1, (70, 150))
    ours = greedy(engine_for(folder, "float32"), prompts, "w")
    assert [t for t, _ in ours] != [hf_greedy(full, p) for p in prompts]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
    prefix=st.integers(1, 120),
    suffixes=st.lists(st.integers(1, 40), min_size=2, max_size=4),
)
def test_cached_chunked_and_batched_runs_agree_at_the_default_dtype(
    checkpoints: dict[str, tuple[Path, object]],
    kind: str,
    seed: int,
    prefix: int,
    suffixes: list[int],
) -> None:
    assert_runs_agree(checkpoints[kind][0], seed, prefix, suffixes)


def assert_runs_agree(folder: Path, seed: int, prefix: int, suffixes: list[int]) -> None:
    """Prompts sharing ``prefix`` random tokens, each with its own suffix, at the default
    dtype: uncached one by one, cached one by one (the shared full blocks hit), chunked and
    batched: the same greedy tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(prefix)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in suffixes]
    plain = engine_for(folder, "auto", enable_prefix_caching=False)
    cold = [greedy(plain, [p], f"c{i}")[0][0] for i, p in enumerate(prompts)]
    cached = engine_for(folder, "auto")
    warm = [greedy(cached, [p], f"w{i}")[0] for i, p in enumerate(prompts)]
    assert [t for t, _ in warm] == cold
    if prefix >= 32:
        assert all(c >= 16 for _, c in warm[1:])
    chunked = engine_for(folder, "auto", max_num_batched_tokens=16)
    assert [t for t, _ in greedy(chunked, prompts, "k")] == cold
    assert [t for t, _ in greedy(cached, prompts, "b")] == cold  # batched, all cached


def test_a_running_sequence_holds_only_its_window(
    checkpoints: dict[str, tuple[Path, object]],
) -> None:
    """Mistral: no global layer, so a long sequence holds a window of local pages and global
    blocks that carry no KV (the prefix tree's)."""
    folder, _ = checkpoints["mistral"]
    engine = engine_for(folder, "auto", max_num_batched_tokens=32)
    assert engine.kv_cache.local_layers == (0, 1, 2)
    engine.add_request(
        EngineRequest("long", random_prompts(3, (300,))[0], SamplingParams(max_tokens=20))
    )
    most = 0
    while engine.has_unfinished:
        engine.step()
        most = max(most, engine.block_manager.stats().num_local_held)
    # keys p - 23 .. p of a 32-token step: at most 2 + 2 pages (one partial at each end)
    assert 0 < most <= -(-(WINDOW - 1 + 32) // 16) + 1


def test_an_all_sliding_model_spends_its_budget_on_local_pages(
    checkpoints: dict[str, tuple[Path, object]],
) -> None:
    folder, _ = checkpoints["mistral"]
    loaded: LoadedModel = load_model(str(folder), dtype="float32", device="cpu")
    page = loaded.kv_cache_spec(16).bytes_per_layer_page * 3
    config = EngineConfig(
        model=str(folder), dtype="float32", device="cpu", kv_memory_bytes=page * 40
    )
    engine = LLMEngine(config, loaded)
    assert engine.kv_cache.num_local_pages == 40
    assert engine.kv_cache.num_blocks == 80  # 1 / swa_pool_ratio blocks a page, no KV in them


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_no_sequence_outgrows_keeps_one_layer_group(
    checkpoints: dict[str, tuple[Path, object]], kind: str
) -> None:
    """``--max-model-len`` at or under the window: the sliding layers attend as global ones
    (no local pages, ``--kv-offload`` accepted, replayed at bf16), and every token equals the
    hybrid engine's and transformers' for sequences that fit."""
    folder, hf = checkpoints[kind]
    prompts = random_prompts(4, (9, 15, 17))  # 17 + 7 generated = the window
    one_group = engine_for(folder, "float32", max_model_len=WINDOW, kv_offload="host:0.01")
    assert not isinstance(one_group.block_manager, HybridBlockManager)
    assert one_group.kv_cache.local_layers == () and one_group.tier is not None
    hybrid = engine_for(folder, "float32", max_model_len=WINDOW + 1)
    assert isinstance(hybrid.block_manager, HybridBlockManager)
    want = [hf_greedy(hf, p, 7) for p in prompts]
    assert [t for t, _ in greedy(one_group, prompts, "o", 7)] == want
    assert [t for t, _ in greedy(hybrid, prompts, "h", 7)] == want
    bf16, bf16_hybrid = (
        engine_for(folder, "bfloat16", max_model_len=WINDOW),
        engine_for(folder, "bfloat16"),
    )
    assert bf16.runner.replay_off_reason == bf16_hybrid.runner.replay_off_reason  # None: AMX
    ours = [t for t, _ in greedy(bf16, prompts, "b", 7)]
    assert ours == [t for t, _ in greedy(bf16_hybrid, prompts, "c", 7)]
