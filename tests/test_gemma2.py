"""Gemma 2: tiny random checkpoints written by transformers' Gemma2ForCausalLM, served by the
whole engine. Gemma 2 is Gemma 3's decoder without q/k norms, on one rope base, with every
other layer sliding and an attention logit softcap (``cap * tanh(score / cap)``) that the
attention backends apply. Greedy tokens equal transformers' past the window (float32, where
the softcap and the window both change them), and cached, uncached, chunked and batched runs
give the same tokens at the default dtype (hypothesis)."""

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

from test_sliding_window_models import (  # noqa: E402
    assert_runs_agree,
    engine_for,
    greedy,
    hf_greedy,
)

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager  # noqa: E402
from prefixcache.engine.model.demo_model import ASSETS  # noqa: E402
from prefixcache.engine.model.gemma3 import Gemma3ForCausalLM  # noqa: E402
from prefixcache.engine.model.loader import load_model  # noqa: E402
from prefixcache.engine.model.model_config import ModelConfig  # noqa: E402

WINDOW = 24
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=512,
    sliding_window=WINDOW,
    query_pre_attn_scalar=48,  # != head_dim, as on the 27B (144 and 128): the backends' scale
    attn_logit_softcapping=1.0,  # small: a tiny model's scores are small
    final_logit_softcapping=2.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf(seed: int = 0, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**TINY, **overrides}))
    with torch.no_grad():  # the init leaves the norms at 0 (1 + w = 1) and q.k small
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(6.0)
    return model.eval()


def save(hf: torch.nn.Module, folder: Path) -> Path:
    hf.save_pretrained(folder)
    shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    hf = make_hf()
    return save(hf, tmp_path_factory.mktemp("gemma2")), hf


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def test_config_follows_gemma2config(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    folder, _ = checkpoint
    cfg = ModelConfig.from_file(folder / "config.json")
    assert cfg.model_type == "gemma2" and cfg.architecture == "Gemma2ForCausalLM"
    assert cfg.layer_windows == (WINDOW, 0, WINDOW, 0)  # every other layer, from the first
    assert cfg.attn_logit_softcapping == 1.0 and cfg.final_logit_softcapping == 2.0
    assert cfg.rope_local_base_freq is None and cfg.attention_scale == 48**-0.5
    # transformers' defaults where the file is silent; a softcap set to null stays off
    bare = {"architectures": ["Gemma2ForCausalLM"], **{k: TINY[k] for k in list(TINY)[:6]}}
    cfg = ModelConfig.from_dict({**bare, "num_hidden_layers": 3})
    assert cfg.attn_logit_softcapping == 50.0 and cfg.final_logit_softcapping == 30.0
    assert cfg.layer_windows == (4096, 0, 4096) and cfg.rope_theta == 10000.0
    assert (
        ModelConfig.from_dict({**bare, "attn_logit_softcapping": None}).attn_logit_softcapping
        is None
    )


def test_loaded_model_equals_transformers(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """float32 logits of every position, prompts within the window (no attention mask
    differs there), through the loader and a dense reference ``attend`` with the softcap."""
    folder, hf = checkpoint
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    assert loaded.model.model.layers[0].self_attn.q_norm is None
    cfg = loaded.config
    cap = cfg.attn_logit_softcapping

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = cfg.num_queries_per_kv
        kh, vh = (
            k.repeat_interleave(g, 1).transpose(0, 1),
            v.repeat_interleave(g, 1).transpose(0, 1),
        )
        s = q.transpose(0, 1) @ kh.transpose(1, 2) * cfg.attention_scale
        s = cap * torch.tanh(s / cap)
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (s.softmax(-1) @ vh).transpose(0, 1)

    prompt = random_prompts(0, (WINDOW,))[0]
    with torch.inference_mode():
        ours = loaded.model.compute_logits(
            loaded.model(torch.tensor(prompt), torch.arange(len(prompt)), attend)
        )
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_equals_transformers_past_the_window(
    checkpoint: tuple[Path, torch.nn.Module],
) -> None:
    folder, hf = checkpoint
    engine = engine_for(folder, "float32", max_num_batched_tokens=64)  # chunked prefill too
    assert isinstance(engine.block_manager, HybridBlockManager)
    prompts = random_prompts(1, (10, 60, 150))
    assert [t for t, _ in greedy(engine, prompts, "cold")] == [hf_greedy(hf, p) for p in prompts]
    warm_prompts = [p + t for p, t in zip(prompts, random_prompts(2, (5, 5, 5)), strict=True)]
    warm = greedy(engine, warm_prompts, "warm")
    assert [c for _, c in warm] == [10, 60, 144]  # shared tokens in stored blocks
    assert [t for t, _ in warm] == [hf_greedy(hf, p) for p in warm_prompts]


def test_the_softcap_and_the_window_matter(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """A guard for the test above: without either, transformers gives other tokens."""
    _, hf = checkpoint
    prompts = random_prompts(1, (60, 150))
    want = [hf_greedy(hf, p) for p in prompts]
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 4096}):
        other = make_hf(**change)
        other.load_state_dict(hf.state_dict())
        assert [hf_greedy(other, p) for p in prompts] != want, change


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    prefix=st.integers(1, 120),
    suffixes=st.lists(st.integers(1, 40), min_size=2, max_size=4),
)
def test_cached_chunked_and_batched_runs_agree_at_the_default_dtype(
    checkpoint: tuple[Path, torch.nn.Module], seed: int, prefix: int, suffixes: list[int]
) -> None:
    assert_runs_agree(checkpoint[0], seed, prefix, suffixes)


def test_a_written_gemma2_gguf_equals_transformers(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """A gemma2 GGUF as llama.cpp's converter writes one (norms as 1 + weight, the softcaps
    and window in the metadata, the layer pattern left to the default), from the tiny
    checkpoint: the engine's float32 greedy tokens equal transformers' past the window."""
    from test_gemma3 import write_gemma_gguf

    _, hf = checkpoint
    path = tmp_path / "tiny-gemma2.gguf"

    def softcaps(w: object) -> None:
        w.add_attn_logit_softcapping(TINY["attn_logit_softcapping"])  # type: ignore[attr-defined]
        w.add_final_logit_softcapping(TINY["final_logit_softcapping"])  # type: ignore[attr-defined]
        # llama.cpp infers the 27B's scale from its layer count; a tiny model names it
        w.add_attention_scale(TINY["query_pre_attn_scalar"] ** -0.5)  # type: ignore[attr-defined]

    write_gemma_gguf(path, "gemma2", hf, TINY, 10000.0, softcaps)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert cfg.model_type == "gemma2" and cfg.layer_windows == (WINDOW, 0, WINDOW, 0)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.0, 2.0)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", device="cpu", num_blocks=128), loaded
    )
    prompts = random_prompts(3, (40, 130))
    assert [t for t, _ in greedy(engine, prompts, "g")] == [hf_greedy(hf, p) for p in prompts]
