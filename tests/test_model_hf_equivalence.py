"""Our Llama-family model, loaded through our loader, equals Hugging Face transformers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from prefixcache.engine.attention import create_backend  # noqa: E402
from prefixcache.engine.memory.kv_cache import KVCache  # noqa: E402
from prefixcache.engine.model.demo_model import ASSETS  # noqa: E402
from prefixcache.engine.model.loader import load_model  # noqa: E402
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner  # noqa: E402

BS = 16
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def save_checkpoint(model: torch.nn.Module, folder: Path, **save_kwargs: object) -> Path:
    model.save_pretrained(folder, **save_kwargs)
    shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    return folder


def make_hf(kind: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg_kwargs = {**TINY, **overrides}
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg_kwargs))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg_kwargs))
    elif kind == "smollm3":
        model = transformers.SmolLM3ForCausalLM(
            transformers.SmolLM3Config(pad_token_id=0, **cfg_kwargs)
        )
    elif kind == "phi3":
        model = transformers.Phi3ForCausalLM(
            transformers.Phi3Config(pad_token_id=0, eos_token_id=2, **cfg_kwargs)
        )
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=None, **cfg_kwargs)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_kwargs))
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def check_equivalence(hf: torch.nn.Module, folder: Path) -> None:
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    cache = KVCache(loaded.kv_cache_spec(BS), num_blocks=64)
    runner = ModelRunner(loaded, cache, create_backend("torch", "cpu"))
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (1, 7, 33, 50)
    ]
    tables, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + 1) // BS)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    torch.testing.assert_close(logits, torch.stack(refs), atol=1e-4, rtol=1e-4)

    # One decode step each over the cached prompts (batched decode path).
    nxt = [int(x) for x in logits.argmax(-1)]
    step = runner.execute(
        [BatchEntry([t], len(p), tb) for p, t, tb in zip(prompts, nxt, tables, strict=True)]
    )
    with torch.no_grad():
        refs = [
            hf(torch.tensor([[*p, t]])).logits[0, -1] for p, t in zip(prompts, nxt, strict=True)
        ]
    torch.testing.assert_close(step, torch.stack(refs), atol=1e-4, rtol=1e-4)


def test_llama_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("llama")
    check_equivalence(hf, save_checkpoint(hf, tmp_path))


@pytest.mark.parametrize("original", [16, None])
def test_llama3_rope_scaling_equals_transformers(tmp_path: Path, original: int | None) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    hf = make_hf("llama", seed=1, rope_scaling=scaling, rope_theta=500000.0)
    folder = save_checkpoint(hf, tmp_path)
    if original is None:  # as older configs leave it out (transformers 5 writes its default)
        raw = json.loads((folder / "config.json").read_text())
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(raw.get(key), dict):
                raw[key].pop("original_max_position_embeddings", None)
        (folder / "config.json").write_text(json.dumps(raw))
    config = load_model(str(folder)).config
    assert config.rope_type == "llama3"
    # absent from the file: transformers' rule, max_position_embeddings
    expected = hf.config.rope_parameters["original_max_position_embeddings"]
    assert config.rope_scaling["original_max_position_embeddings"] == expected
    check_equivalence(hf, folder)


def test_linear_rope_scaling_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("llama", seed=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    check_equivalence(hf, save_checkpoint(hf, tmp_path))


def test_tied_embeddings_equal_transformers(tmp_path: Path) -> None:
    hf = make_hf("llama", seed=3, tie_word_embeddings=True)
    folder = save_checkpoint(hf, tmp_path)
    loaded = load_model(str(folder))
    assert loaded.config.tie_word_embeddings
    assert (
        loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    )
    check_equivalence(hf, folder)


def test_sharded_checkpoint_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("llama", seed=4)
    folder = save_checkpoint(hf, tmp_path, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_equivalence(hf, folder)


def test_qwen2_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("qwen2", seed=5)
    folder = save_checkpoint(hf, tmp_path)
    assert load_model(str(folder)).config.attention_bias
    check_equivalence(hf, folder)


def test_mistral_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("mistral", seed=6)
    check_equivalence(hf, save_checkpoint(hf, tmp_path))


def test_qwen3_equals_transformers(tmp_path: Path) -> None:
    """Qwen3: RMSNorm over each head of q and k, and a head_dim wider than hidden/heads."""
    hf = make_hf("qwen3", seed=7, head_dim=32)
    folder = save_checkpoint(hf, tmp_path)
    config = load_model(str(folder)).config
    assert config.qk_norm and config.head_dim == 32 and not config.attention_bias
    check_equivalence(hf, folder)


def test_explicit_head_dim_equals_transformers(tmp_path: Path) -> None:
    hf = make_hf("mistral", seed=8, head_dim=8)  # Mistral-Nemo style: heads * head_dim < hidden
    check_equivalence(hf, save_checkpoint(hf, tmp_path))


@pytest.mark.parametrize("layout", ["single", "sharded", "legacy"])
def test_pytorch_bin_checkpoints_equal_transformers(tmp_path: Path, layout: str) -> None:
    """Folders written by older tools: pytorch_model.bin, its shards, or the pre-zip format."""
    hf = make_hf("llama", seed=9)
    save_checkpoint(hf, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = hf.state_dict()
    if layout == "sharded":
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2]}
        halves["pytorch_model-00002-of-00002.bin"] = names[1::2]
        weight_map = {}
        for file, keys in halves.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
            weight_map.update(dict.fromkeys(keys, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    else:
        legacy = layout == "legacy"
        torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    # A LoRA adapter saved beside the weights (as PEFT does) is not the model.
    save_file(
        {"base_model.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "adapter_model.safetensors"
    )
    check_equivalence(hf, tmp_path)


def test_bfloat16_checkpoint_loads_in_float32(tmp_path: Path) -> None:
    hf = make_hf("llama", seed=10).to(torch.bfloat16)
    folder = save_checkpoint(hf, tmp_path)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.model.lm_head.weight.dtype == torch.float32
    check_equivalence(hf.float(), folder)


def test_greedy_with_repetition_penalty_equals_transformers_generate(tmp_path: Path) -> None:
    """vLLM's and transformers' repetition penalty: prompt and output tokens, same tokens out."""
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import EngineRequest, SamplingParams

    hf = make_hf("llama", seed=11)
    folder = save_checkpoint(hf, tmp_path)
    prompt = torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # no id is padding
            max_new_tokens=40,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    config = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_blocks=16)
    engine = LLMEngine(config)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    got = engine.generate([EngineRequest("r", prompt.tolist(), sampling)])[0].token_ids
    assert got == expected
    plain = engine.generate(
        [EngineRequest("p", prompt.tolist(), SamplingParams(40, ignore_eos=True))]
    )
    assert plain[0].token_ids != expected  # the penalty changed something worth checking


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize(
    "yarn",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64},  # Qwen's model-card recipe
        {"factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 2.0, "attention_factor": 1.3},
    ],
)
def test_yarn_rope_scaling_equals_transformers(tmp_path: Path, kind: str, yarn: dict) -> None:
    """Static YaRN: interpolated low frequencies, a ramp, cos and sin scaled by the attention
    factor (given, or 0.1 ln(factor) + 1); the pretraining length from the file, else
    max_position_embeddings."""
    from prefixcache.engine.model.rope import RotaryEmbedding

    hf = make_hf(kind, seed=10, rope_scaling={"rope_type": "yarn", **yarn}, rope_theta=10000.0)
    folder = save_checkpoint(hf, tmp_path)
    config = load_model(str(folder)).config
    assert config.rope_type == "yarn"
    rotary = RotaryEmbedding(config)
    want = yarn.get("attention_factor", 0.1 * math.log(yarn["factor"]) + 1.0)
    assert rotary.attention_factor == pytest.approx(want)
    plain = 1.0 / 10000.0 ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    assert not torch.allclose(rotary.inv_freq_cpu, plain)  # the scaling does something
    check_equivalence(hf, folder)


def test_partial_rotary_is_refused(tmp_path: Path) -> None:
    hf = make_hf("llama", seed=11)
    folder = save_checkpoint(hf, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_model(str(folder))


def test_phi3_equals_transformers(tmp_path: Path) -> None:
    """Phi-3: Llama's layers with q/k/v and gate/up fused in the checkpoint (split at load)."""
    hf = make_hf("phi3", seed=12)
    folder = save_checkpoint(hf, tmp_path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf.state_dict()
    loaded = load_model(str(folder))
    assert loaded.config.model_type == "phi3" and loaded.config.layer_windows == ()
    check_equivalence(hf, folder)


def test_phi3_longrope_is_refused(tmp_path: Path) -> None:
    """Phi-3.5's longrope rotates a token by the sequence's length: no prefix could be reused."""
    hf = make_hf("phi3", seed=13)
    folder = save_checkpoint(hf, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    (folder / "config.json").write_text(json.dumps({**raw, "rope_scaling": longrope}))
    with pytest.raises(ValueError, match="longrope"):
        load_model(str(folder))


def test_mistral3_serves_its_text_decoder(tmp_path: Path) -> None:
    """Mistral Small 3.1 / 3.2 are ``Mistral3ForConditionalGeneration``: the Mistral text
    decoder under ``language_model.``, a Pixtral vision tower beside it (left unread)."""
    from test_sliding_window_models import engine_for, greedy, hf_greedy, random_prompts

    torch.manual_seed(14)
    # tied, as Mistral3Config's top level is by default (the checkpoint then has no lm_head)
    text = {**TINY, "num_key_value_heads": 2, "sliding_window": None, "tie_word_embeddings": True}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=16, head_dim=16,
    )  # fmt: skip
    cfg = transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=TINY["vocab_size"] - 1
    )
    hf = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = save_checkpoint(hf, tmp_path)
    loaded = load_model(str(folder))
    assert loaded.config.model_type == "mistral" and loaded.config.layer_windows == ()
    prompts = random_prompts(2, (9, 60))
    got = [t for t, _ in greedy(engine_for(folder, "float32"), prompts, "m")]
    assert got == [hf_greedy(hf, p) for p in prompts]


def test_smollm3_nope_layers_equal_transformers(tmp_path: Path) -> None:
    """SmolLM3: Llama's layers, every ``no_rope_layer_interval``-th one without RoPE (NoPE)."""
    hf = make_hf("smollm3", seed=15, no_rope_layer_interval=2, tie_word_embeddings=True)
    folder = save_checkpoint(hf, tmp_path)
    config = load_model(str(folder)).config
    assert config.model_type == "smollm3" and config.rope_layers == (True, False)
    check_equivalence(hf, folder)
    # the NoPE layer matters: the same weights with RoPE everywhere give other logits
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "no_rope_layers": [1, 1]}))
    with pytest.raises(AssertionError):
        check_equivalence(hf, folder)


def test_qwen2_5_vl_serves_its_text_decoder(tmp_path: Path) -> None:
    """Qwen2.5-VL: the Qwen2 text decoder (q/k/v biases) beside a ``visual`` tower left
    unread; on text alone M-RoPE's three position components are equal, so its sections
    rotate as plain RoPE does: transformers' greedy tokens."""
    from test_sliding_window_models import engine_for, greedy, hf_greedy, random_prompts

    torch.manual_seed(16)
    mrope = {"type": "mrope", "mrope_section": [2, 3, 3]}  # of head_dim / 2 = 8 pairs
    text = {**TINY, "rope_scaling": mrope, "bos_token_id": 1, "eos_token_id": 2}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
        out_hidden_size=TINY["hidden_size"], spatial_merge_size=2, fullatt_block_indexes=[0],
    )  # fmt: skip
    v = TINY["vocab_size"]
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=v - 1, video_token_id=v - 2,
        vision_start_token_id=v - 3,
    )  # fmt: skip
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = save_checkpoint(hf, tmp_path)
    config = load_model(str(folder)).config
    assert config.model_type == "qwen2" and config.attention_bias and config.rope_scaling is None
    prompts = random_prompts(3, (9, 70))
    got = [t for t, _ in greedy(engine_for(folder, "float32"), prompts, "q")]
    assert got == [hf_greedy(hf, p) for p in prompts]


def test_phi3_mini_head_dim_runs_on_the_cpu_kernels(tmp_path: Path) -> None:
    """Phi-3 mini's heads of 96 and its sliding window on every layer: the CPU kernels take
    them (once the torch reference's, neither fast nor batch-invariant). At fp32 the engine's
    greedy tokens are transformers' past the window; at bf16, cold, warm, chunked and batched
    greedy tokens are the same."""
    from prefixcache.engine.attention import cpu_kernels
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import SamplingParams

    if cpu_kernels.unavailable_reason() is not None:
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    hf = make_hf("phi3", seed=13, hidden_size=192, num_attention_heads=2, num_key_value_heads=2, sliding_window=40)  # fmt: skip
    folder = save_checkpoint(hf, tmp_path)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 256, (90,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 17)]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)

    def engine(dtype: str, **overrides: object) -> LLMEngine:
        loaded = load_model(str(folder), dtype=dtype, device="cpu")
        assert loaded.config.head_dim == 96 and set(loaded.config.layer_windows) == {40}
        config = EngineConfig(model=str(folder), dtype=dtype, device="cpu", num_blocks=128, **overrides)  # fmt: skip
        made = LLMEngine(config, loaded)
        assert made.runner.invariance_gaps == []  # no torch reference anywhere
        return made

    exact = engine("float32").generate(prompts[:1], greedy)[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=10, do_sample=False)
    assert exact == ref[0, len(prompts[0]) :].tolist()

    cold = [engine("bfloat16", enable_prefix_caching=False).generate([p], greedy)[0].token_ids for p in prompts]  # fmt: skip
    warm_engine = engine("bfloat16")
    warm_engine.generate([prefix], SamplingParams(max_tokens=1))
    warm = [warm_engine.generate([p], greedy)[0] for p in prompts]
    assert all(out.usage.cached_tokens >= 80 for out in warm)
    assert [out.token_ids for out in warm] == cold
    chunked = engine("bfloat16", max_num_batched_tokens=32).generate(prompts, greedy)
    assert [out.token_ids for out in chunked] == cold
    assert [out.token_ids for out in engine("bfloat16").generate(prompts, greedy)] == cold
