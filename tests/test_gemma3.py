"""Gemma 3: our decoder equals transformers' Gemma3ForCausalLM on tiny random checkpoints
(safetensors, and a GGUF written here). The real 270M file's logits, config and tokenizer are
checked in test_gemma3_fidelity.py, which loads it once for all of them.

The sliding window is the attention backend's job; here a dense reference ``attend`` applies
it (query p sees keys p - w < k <= p), chunk by chunk, so prefills after cached tokens are
covered too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.engine.model.demo_model import ASSETS  # noqa: E402
from prefixcache.engine.model.gemma3 import Gemma3ForCausalLM  # noqa: E402
from prefixcache.engine.model.loader import load_model  # noqa: E402
from prefixcache.engine.model.model_config import ModelConfig  # noqa: E402

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,  # != head_dim: the scale is not head_dim ** -0.5
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    final_logit_softcapping=0.5,  # small: the logits here are small
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


class WindowedAttend:
    """Dense reference attention over a flat batch of sequences, each with its own K/V so
    far; ``step(lengths)`` names how many new tokens each sequence has in the next call."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.lengths: list[int] = []

    def step(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows=None):
        cfg = self.config
        w = cfg.window_of(layer)
        out, row = [], 0
        for seq, n in enumerate(self.lengths):
            qs, ks, vs = q[row : row + n], k[row : row + n], v[row : row + n]
            row += n
            if (seq, layer) in self.kv:
                pk, pv = self.kv[seq, layer]
                ks, vs = torch.cat([pk, ks]), torch.cat([pv, vs])
            self.kv[seq, layer] = (ks, vs)
            total = ks.shape[0]
            qpos = torch.arange(total - n, total)[:, None]
            kpos = torch.arange(total)[None, :]
            mask = kpos <= qpos
            if w:
                mask &= kpos > qpos - w
            g = cfg.num_queries_per_kv
            kh = ks.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, L, D]
            vh = vs.repeat_interleave(g, dim=1).transpose(0, 1)
            s = qs.transpose(0, 1).float() @ kh.float().transpose(1, 2) * cfg.attention_scale
            s = s.masked_fill(~mask, float("-inf")).softmax(-1)
            out.append((s @ vh.float()).to(q.dtype).transpose(0, 1))
        return torch.cat(out) if rows is None else torch.cat(out).index_select(0, rows)


def run_chunks(
    model: Gemma3ForCausalLM, prompts: list[list[int]], chunk: int, hidden_only: bool = False
) -> torch.Tensor:
    """Every prompt prefilled ``chunk`` tokens per step (all prompts in one flat batch);
    the logits (or final hidden states) of every token, per prompt, concatenated."""
    attend = WindowedAttend(model.config)
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        ids, pos, lengths = [], [], []
        for i, p in enumerate(prompts):
            part = p[done[i] : done[i] + chunk]
            ids += part
            pos += range(done[i], done[i] + len(part))
            lengths.append(len(part))
        attend.step(lengths)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), attend)
            out = hidden if hidden_only else model.compute_logits(hidden)
        row = 0
        for i, n in enumerate(lengths):
            logits[i].append(out[row : row + n])
            row += n
            done[i] += n
    return torch.cat([torch.cat(x) for x in logits])


def reference_logits(hf: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])


def make_tiny_hf(seed: int = 0, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(**{**TINY, **overrides})
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # the init leaves the norms at 0 (1 + w = 1): perturb them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def save_tiny(hf: torch.nn.Module, folder: Path) -> Path:
    hf.save_pretrained(folder)
    shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    return folder


def test_config_from_hf_gemma3(tmp_path: Path) -> None:
    hf = make_tiny_hf()
    raw = json.loads((save_tiny(hf, tmp_path) / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert cfg.model_type == "gemma3" and cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows == (8, 0, 8, 0) and cfg.is_hybrid
    assert cfg.rope_theta == 50000.0 and cfg.rope_local_base_freq == 100.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.attention_scale == 24**-0.5 and cfg.final_logit_softcapping == 0.5
    assert cfg.hidden_activation == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    # nested under text_config (a multimodal checkpoint's layout), older flat rope keys, and
    # the default 5:1 pattern
    nested = {
        "architectures": ["Gemma3ForCausalLM"],
        "text_config": {
            **{k: v for k, v in TINY.items() if k not in ("layer_types", "rope_parameters")},
            "num_hidden_layers": 7,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "model_type": "gemma3_text",
        },
    }
    cfg = ModelConfig.from_dict(nested)
    assert cfg.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling) == (1e6, 1e4, None)


def test_tiny_gemma3_equals_transformers(tmp_path: Path) -> None:
    hf = make_tiny_hf()
    loaded = load_model(str(save_tiny(hf, tmp_path)), dtype="float32", device="cpu")
    model = loaded.model
    assert isinstance(model, Gemma3ForCausalLM)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 13, 40)]
    ref = reference_logits(hf, prompts)
    whole = run_chunks(model, prompts, chunk=64)
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=2e-5)
    # prefill in chunks after cached tokens, and one token at a time (decode)
    torch.testing.assert_close(run_chunks(model, prompts, chunk=5), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(run_chunks(model, prompts, chunk=1), ref, atol=2e-5, rtol=2e-5)
    # prepare(): fused QKV / gate-up GEMMs, packed head
    model.prepare()
    torch.testing.assert_close(run_chunks(model, prompts, chunk=9), ref, atol=1e-4, rtol=1e-4)


def test_the_window_and_softcap_matter(tmp_path: Path) -> None:
    """The test above can fail: without the window (or the softcap) logits differ."""
    hf = make_tiny_hf()
    model = load_model(str(save_tiny(hf, tmp_path)), dtype="float32", device="cpu").model
    prompts = [list(range(3, 40))]
    ref = reference_logits(hf, prompts)
    model.config.layer_windows = (0, 0, 0, 0)
    assert not torch.allclose(run_chunks(model, prompts, 64), ref, atol=1e-3)
    model.config.layer_windows = (8, 0, 8, 0)
    model.config.final_logit_softcapping = None
    assert not torch.allclose(run_chunks(model, prompts, 64), ref, atol=1e-3)


def test_out_rows_and_bf16_fused_rotary(tmp_path: Path) -> None:
    hf = make_tiny_hf(seed=1)
    folder = save_tiny(hf, tmp_path)
    model = load_model(str(folder), dtype="float32", device="cpu").model
    prompt = list(range(3, 30))
    attend = WindowedAttend(model.config)
    attend.step([len(prompt)])
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        every = model.compute_logits(model(ids, pos, attend))
        attend = WindowedAttend(model.config)
        attend.step([len(prompt)])
        last = model.compute_logits(model(ids, pos, attend, torch.tensor([len(prompt) - 1])))
    torch.testing.assert_close(last[0], every[-1], atol=1e-5, rtol=1e-5)

    bf16 = load_model(str(folder), dtype="bfloat16", device="cpu").model
    bf16.prepare()
    fused = run_chunks(bf16, [prompt], 64)
    bf16.set_fused_ops(False)
    assert not bf16.fused_ops
    torch.testing.assert_close(run_chunks(bf16, [prompt], 64), fused, atol=0, rtol=0)


def _gguf_name(hf_name: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in names:
        return names[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    part = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }[rest]
    return f"blk.{layer}.{part}"


def write_gemma_gguf(
    path: Path,
    arch: str,
    hf: torch.nn.Module,
    shape: dict,
    rope_base: float,
    extra: Callable[[Any], None] | None = None,
) -> None:
    """``hf``'s weights as llama.cpp's converter writes a Gemma GGUF (norms as 1 + weight, the
    head tied), with ``shape``'s sizes and window, a byte-level SentencePiece vocabulary and
    what ``extra`` adds to the writer."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(shape["max_position_embeddings"])
    w.add_embedding_length(shape["hidden_size"])
    w.add_block_count(shape["num_hidden_layers"])
    w.add_feed_forward_length(shape["intermediate_size"])
    w.add_head_count(shape["num_attention_heads"])
    w.add_head_count_kv(shape["num_key_value_heads"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_base)
    w.add_sliding_window(shape["sliding_window"])
    if extra is not None:
        extra(w)
    vocab = shape["vocab_size"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens = (tokens + [f"tok{i}" for i in range(vocab - len(tokens))])[:vocab]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3, 3] + [6] * (len(tokens) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = p.detach().float().numpy()
        w.add_tensor(_gguf_name(name), a + np.float32(1.0) if "norm" in name else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_written_gemma3_gguf_equals_transformers(tmp_path: Path) -> None:
    """A gemma3 GGUF as llama.cpp writes one (norms as 1 + weight, Gemma 3's defaults left
    out of the metadata), from a tiny random model: our loader's logits equal it."""
    pytest.importorskip("gguf")
    layers = 6  # the default pattern: 5 sliding, then 1 global
    hf = make_tiny_hf(
        seed=3,
        num_hidden_layers=layers,
        layer_types=None,
        query_pre_attn_scalar=TINY["head_dim"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        final_logit_softcapping=None,
    )
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma_gguf(path, "gemma3", hf, {**TINY, "num_hidden_layers": layers}, 1e6)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert cfg.model_type == "gemma3" and cfg.layer_windows == (8, 8, 8, 8, 8, 0)
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.attention_scale) == (1e6, 1e4, 0.25)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 256, (n,), generator=gen).tolist() for n in (3, 30)]
    ref = reference_logits(hf, prompts)
    torch.testing.assert_close(run_chunks(loaded.model, prompts, 7), ref, atol=1e-4, rtol=1e-4)


def test_through_the_model_runner_within_the_window(tmp_path: Path) -> None:
    """Loader -> ModelRunner -> torch backend (paged cache, prepare()d model): equal to
    transformers while no prompt is longer than the window (windows are the backends' job)."""
    from prefixcache.engine.attention import create_backend
    from prefixcache.engine.memory.kv_cache import KVCache
    from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

    hf = make_tiny_hf(seed=4, sliding_window=64)
    loaded = load_model(str(save_tiny(hf, tmp_path)), dtype="float32", device="cpu")
    runner = ModelRunner(loaded, KVCache(loaded.kv_cache_spec(16), 32), create_backend("torch"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 20, 50)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    with torch.inference_mode():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_a_multimodal_checkpoint_serves_its_text_decoder(tmp_path: Path) -> None:
    """Gemma 3 4B-27B are ``Gemma3ForConditionalGeneration``: the text decoder under
    ``language_model.`` (or ``model.language_model.``), a vision tower beside it. Its text
    decoder is served (the vision tensors left unread): greedy tokens equal transformers' on
    text, past the window, in both namings."""
    from safetensors.torch import load_file, save_file
    from test_sliding_window_models import engine_for, greedy, hf_greedy, random_prompts

    torch.manual_seed(5)
    text = {k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")}
    text.update(vocab_size=300, num_hidden_layers=2, num_key_value_heads=1, head_dim=64)
    text.update(sliding_window=16, query_pre_attn_scalar=64, max_position_embeddings=512)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=16,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    folder = save_tiny(hf, tmp_path / "written")
    weights = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in weights)
    prompts = random_prompts(1, (10, 40))
    want = [hf_greedy(hf, p) for p in prompts]
    assert [t for t, _ in greedy(engine_for(folder, "float32"), prompts, "a")] == want
    renamed = {
        k.replace("language_model.model.", "model.language_model."): v for k, v in weights.items()
    }
    renamed = {k.replace("vision_tower.", "model.vision_tower."): v for k, v in renamed.items()}
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert [t for t, _ in greedy(engine_for(folder, "float32"), prompts, "b")] == want


# The Gemma 3 4B and 27B checkpoints' config.json: a text_config naming only the fields that
# differ from transformers' Gemma3TextConfig defaults.
SHORT_TEXT_CONFIGS = [
    {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
]


@pytest.mark.parametrize("text_config", SHORT_TEXT_CONFIGS)
def test_a_short_text_config_takes_transformers_defaults(text_config: dict[str, Any]) -> None:
    from transformers import Gemma3Config

    outer = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    ref = Gemma3Config(**json.loads(json.dumps(outer))).text_config
    cfg = ModelConfig.from_dict(outer)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
        ref.num_hidden_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.rms_norm_eps == ref.rms_norm_eps and cfg.tie_word_embeddings
    windows = tuple(ref.sliding_window if t == "sliding_attention" else 0 for t in ref.layer_types)
    assert cfg.layer_windows == windows
    rope = ref.rope_parameters
    assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
    assert cfg.rope_local_base_freq == rope["sliding_attention"]["rope_theta"]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attention_scale == ref.query_pre_attn_scalar**-0.5
    assert cfg.eos_token_ids == [1, 106] and cfg.bos_token_id == ref.bos_token_id
