"""Loader: clear errors, robustness to config spellings, fingerprints, tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prefixcache.engine.model.demo_model import ASSETS, CHAT_TEMPLATE
from prefixcache.engine.model.loader import ModelLoadError, load_model
from prefixcache.engine.model.model_config import ModelConfig, UnsupportedModelError
from prefixcache.engine.text.detokenizer import IncrementalDetokenizer
from prefixcache.engine.text.tokenizer import Tokenizer, TokenizerError

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def weights(cfg: dict, with_lm_head: bool = True) -> dict[str, torch.Tensor]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen)}
    p = "model.layers.0."
    for name, shape in {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }.items():
        w[p + name] = torch.randn(*shape, generator=gen) * 0.1
    w["model.norm.weight"] = torch.ones(h)
    if with_lm_head:
        w["lm_head.weight"] = torch.randn(v, h, generator=gen)
    return w


def write_folder(folder: Path, cfg: dict | None = None, **kw: object) -> Path:
    cfg = dict(CONFIG if cfg is None else cfg)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(weights(cfg, **kw), str(folder / "model.safetensors"))  # type: ignore[arg-type]
    shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
    tok_cfg = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return folder


def test_loads_and_runs(tmp_path: Path) -> None:
    from prefixcache.engine.model.loader import auto_dtype

    loaded = load_model(str(write_folder(tmp_path / "m")))  # dtype auto: bf16 where native
    assert loaded.dtype == auto_dtype(torch.device("cpu")) and loaded.device.type == "cpu"
    assert loaded.config.head_dim == 8 and loaded.config.num_kv_heads == 2
    spec = loaded.kv_cache_spec(16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (1, 2, 8)
    assert loaded.tokenizer.bos_token_id == loaded.tokenizer.token_to_id("<|begin_of_text|>")


def test_missing_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"))
    folder = write_folder(tmp_path / "a")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_model(str(folder))
    folder = write_folder(tmp_path / "b")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights found"):
        load_model(str(folder))
    folder = write_folder(tmp_path / "c")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        load_model(str(folder))
    folder = write_folder(tmp_path / "d")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match=r"shards .* missing"):
        load_model(str(folder))
    folder = write_folder(tmp_path / "e")
    for cfg, error in (
        ({k: v for k, v in CONFIG.items() if k != "hidden_size"}, "no 'hidden_size'"),
        ({**CONFIG, "num_hidden_layers": "two"}, "invalid literal"),
    ):
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=rf"config\.json: {error}"):
            load_model(str(folder))


def test_unsupported_architecture(tmp_path: Path) -> None:
    cfg = {**CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(write_folder(tmp_path / "g", cfg)))
    for dynamic in ("dynamic", "longrope"):  # a token's rotation depends on the length
        cfg = {**CONFIG, "rope_scaling": {"rope_type": dynamic, "factor": 4.0}}
        with pytest.raises(UnsupportedModelError, match=f"rope_scaling type '{dynamic}'"):
            ModelConfig.from_dict(cfg)


def test_shape_mismatch(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "s")
    (folder / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 40}))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape .* implies"):
        load_model(str(folder))


def test_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "u")
    w = weights(CONFIG)
    del w["model.norm.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.norm\.weight"):
        load_model(str(folder))


def test_config_spellings() -> None:
    cfg = ModelConfig.from_dict(
        {
            **CONFIG,
            "dtype": "bfloat16",
            "eos_token_id": [5, 6],
            "bos_token_id": 1,
            "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
        }
    )
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == [5, 6]
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None and cfg.head_dim == 8
    cfg = ModelConfig.from_dict(
        {
            **CONFIG,
            "torch_dtype": "float16",
            "eos_token_id": 3,
            "rope_scaling": None,
            "head_dim": 16,
            "rope_theta": 1e6,
        }
    )
    assert cfg.torch_dtype == "float16" and cfg.eos_token_ids == [3]
    assert cfg.head_dim == 16 and cfg.rope_theta == 1e6
    cfg = ModelConfig.from_dict({**CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_type == "linear"


def test_tied_with_or_without_lm_head(tmp_path: Path) -> None:
    tied = {**CONFIG, "tie_word_embeddings": True}
    a = load_model(str(write_folder(tmp_path / "a", tied, with_lm_head=True)))
    b = load_model(str(write_folder(tmp_path / "b", tied, with_lm_head=False)))
    for m in (a, b):
        assert torch.equal(m.model.lm_head.weight, m.model.model.embed_tokens.weight)
    with pytest.warns(UserWarning, match="no lm_head.weight"):
        c = load_model(str(write_folder(tmp_path / "c", CONFIG, with_lm_head=False)))
    assert c.config.tie_word_embeddings


def test_eos_from_generation_config_and_chat_template_file(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "e")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    loaded = load_model(str(folder))
    eot = loaded.tokenizer.token_to_id("<|eot_id|>")
    assert set(loaded.tokenizer.eos_token_ids) == {eot, 1, 2}
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_sampling_defaults_from_generation_config(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "g")
    generation = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "do_sample": True,  # not a sampling value we take
        "min_p": "0",  # not a number: ignored
        "max_new_tokens": 512,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation))
    defaults = load_model(str(folder)).sampling_defaults
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert load_model(str(write_folder(tmp_path / "none"))).sampling_defaults == {}
    bad = write_folder(tmp_path / "bad")
    values = {"top_k": -1, "top_p": 1.5, "repetition_penalty": 2.5, "temperature": 0.7}
    (bad / "generation_config.json").write_text(json.dumps(values))
    with pytest.warns(UserWarning, match="ignored"):
        defaults = load_model(str(bad)).sampling_defaults
    assert defaults == {"top_k": 0, "temperature": 0.7}  # -1 means off; the others are invalid


def test_fingerprints_follow_weights_and_tokenizer(tmp_path: Path) -> None:
    a = load_model(str(write_folder(tmp_path / "a")), dtype="float32")
    b = load_model(str(write_folder(tmp_path / "b")), dtype="float32")
    assert a.fingerprint == b.fingerprint and a.tokenizer.fingerprint == b.tokenizer.fingerprint
    w = weights(CONFIG)
    w["model.norm.weight"] = w["model.norm.weight"] * 2
    save_file(w, str(tmp_path / "b" / "model.safetensors"))
    assert load_model(str(tmp_path / "b")).fingerprint != a.fingerprint
    (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    assert load_model(str(tmp_path / "b")).tokenizer.fingerprint != a.tokenizer.fingerprint
    assert a.identity != load_model(str(tmp_path / "a"), dtype="bfloat16").identity


def test_dtype_argument(tmp_path: Path) -> None:
    loaded = load_model(str(write_folder(tmp_path / "d")), dtype="bfloat16")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.kv_cache_spec().dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(str(tmp_path / "d"), dtype="int8")


def test_incremental_detokenizer_never_splits_characters(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(write_folder(tmp_path / "t"))
    text = "Zürich café 🙂🚀 你好，世界 — naïve façade done."
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    deltas = [det.push(i) for i in ids]
    assert "".join(deltas) + det.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # Byte-level tokens of one emoji arrive separately: nothing is emitted until it completes.
    emoji = tok.encode("🙂")
    assert len(emoji) > 1
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in emoji][:-1] == [""] * (len(emoji) - 1)
    # Cut before its last byte (max_tokens): the text ends before it, no U+FFFD.
    cut = tok.encode("ok") + emoji[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    det = IncrementalDetokenizer(tok)
    assert "".join(det.push(i) for i in cut) + det.flush() == "ok"


def test_no_bos_is_invented_from_config_json(tmp_path: Path) -> None:
    """Completions follow tokenizer.json: a tokenizer without BOS gets none from config.json."""
    folder = write_folder(tmp_path / "nobos", {**CONFIG, "bos_token_id": 1})
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    tokenizer = load_model(str(folder)).tokenizer
    assert tokenizer.bos_token_id is None
    assert tokenizer.encode("hi there", add_special_tokens=True) == tokenizer.encode("hi there")


def test_dtype_auto_is_bf16_only_where_the_hardware_computes_it() -> None:
    from prefixcache.engine.kernels.cpu_features import cpu_bf16_flags
    from prefixcache.engine.model.loader import auto_dtype, resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    zen4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: avx512f amx_bf16 amx_tile\n"
    old_x86 = "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
    graviton3 = "Features\t: fp asimd sve bf16 i8mm\n"
    assert cpu_bf16_flags(zen4) == {"avx512_bf16"}
    assert auto_dtype(cpu, zen4) == auto_dtype(cpu, sapphire) == torch.bfloat16
    assert auto_dtype(cpu, graviton3) == torch.bfloat16
    assert auto_dtype(cpu, old_x86) == auto_dtype(cpu, "") == torch.float32
    assert auto_dtype(cuda, old_x86) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == resolve_dtype(None, cpu) == auto_dtype(cpu)
    assert resolve_dtype("float32", cpu) == torch.float32
