"""GGUF loading: small GGUFs written here by the gguf package's GGUFWriter from a random
Hugging Face checkpoint (llama.cpp's q/k row permutation applied, as its converter does),
loaded by the engine, compared with transformers on the original checkpoint and on the GGUF.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from conftest import ServerLoop, serve

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from prefixcache.engine.model.demo_model import ASSETS, CHAT_TEMPLATE  # noqa: E402
from prefixcache.engine.model.gguf_loader import (  # noqa: E402
    GGUFLoadError,
    load_gguf,
    unpermute_rope_rows,
)
from prefixcache.engine.model.loader import ModelLoadError, load_model  # noqa: E402
from prefixcache.engine.model.model_config import UnsupportedModelError  # noqa: E402
from prefixcache.engine.text.gguf_tokenizer import sentencepiece_merges  # noqa: E402
from prefixcache.engine.text.tokenizer import TokenizerSpec  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64  # rows of 256: K-quants
TEXTS = [
    "Hello world, again",
    " leading space and  double  spaces\n\nnew lines\ttabs",
    "Numbers 1234567 and punctuation!?... (brackets) [x] {y}",
    "Unicode: café, naïve, 東京, emoji 🎉",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
]
# Relative max logit error against the original float32 checkpoint, per tensor type: a bound
# on what quantizing this (deliberately sensitive) random network costs.
QUANT_TOLERANCE = {Q.F32: 1e-5, Q.F16: 5e-3, Q.BF16: 3e-2, Q.Q8_0: 0.1, Q.Q4_0: 0.8, Q.Q4_K: 0.8}


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks (the gguf package only dequantizes K-quants): per 256 values a float16
    scale d and min dmin, eight sub-blocks of 32 with 6-bit scale and min, 4-bit values."""
    n_rows, n_cols = rows.shape
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    step = (x.max(axis=-1) - lo) / 15
    d = np.maximum(step.max(axis=-1), 1e-12) / 63
    dmin = np.maximum((-lo).max(axis=-1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(step / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = (d16.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin16.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round((x + offset) / scale), 0, 15).astype(np.uint8)  # [blocks, 8, 32]
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), packed, qs],
        axis=1,
    )
    return blocks.reshape(n_rows, n_cols // 256 * 144)


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    return quantize_q4_k(w) if qtype == Q.Q4_K else gguf.quantize(w, qtype)


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rotate-half rows to interleaved pairs."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in glob:
        return glob[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    local = {
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q",
        "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v",
        "self_attn.o_proj.weight": "attn_output",
        "mlp.gate_proj.weight": "ffn_gate",
        "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down",
        "self_attn.qkv_proj.weight": "attn_qkv",  # Phi-3's fused projections
        "mlp.gate_up_proj.weight": "ffn_up",
    }
    return f"blk.{layer}.{local[rest]}.weight"


def demo_vocab() -> tuple[list[str], list[str], list[int], dict[str, int]]:
    raw = json.loads((ASSETS / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(raw["model"]["vocab"])
    special = {a["content"]: a["id"] for a in raw["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]
    return tokens, merges, types, special


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: unk/bos/eos, the 256 byte tokens, then pieces
    (with the \u2581 word marker) of a BPE trained on the demo corpus, scored by rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False)
    tok.train([str(ASSETS / "corpus.txt")], trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    return tokens, scores, types


def random_checkpoint(folder: Path, vocab_size: int, tied: bool) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init: logits that tell models apart
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel | None,
    qtype: gguf.GGMLQuantizationType = Q.F32,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    pre: str = "default",
    layers: int = LAYERS,
) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(qtype))
    if tokenizer == "gpt2":
        tokens, merges, types, special = demo_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(special["<|begin_of_text|>"])
        w.add_eos_token_id(special["<|end_of_text|>"])
        w.add_eot_token_id(special["<|eot_id|>"])
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(
            "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        )
    w.add_vocab_size(len(tokens))
    if model is not None:
        for hf, tensor in model.state_dict().items():
            if hf == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            a = tensor.detach().float().numpy()
            if ".q_proj." in hf:
                a = permute_rope_rows(a, HEADS)
            elif ".k_proj." in hf:
                a = permute_rope_rows(a, KV_HEADS)
            if a.ndim == 2:
                w.add_tensor(gguf_name(hf), quantize(a, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name(hf), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def with_and_without_blocks(tmp_path: Path, qtype: str):  # type: ignore[no-untyped-def]
    """A tiny tied GGUF model, every weight ``qtype``, loaded dequantized at bf16 twice and
    prepared: as served (its GGUF blocks read where a block kernel runs) and with the same
    weights packed as bf16 panels only."""
    model = random_checkpoint(tmp_path, len(demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, getattr(Q, qtype))
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    panels = load_model(str(path), dtype="bfloat16", device="cpu")
    for module in panels.model.modules():  # the same weights without their blocks
        module.__dict__.pop("block_source", None)
    loaded.model.prepare()
    panels.model.prepare()
    return loaded, panels


def run_logits(loaded, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Our model over one sequence with plain causal attention (no paged cache)."""
    groups = loaded.config.num_queries_per_kv

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)

    ids = torch.tensor(token_ids)
    with torch.no_grad():
        hidden = loaded.model(ids, torch.arange(len(ids)), attend)
        return loaded.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, transformers.PreTrainedModel]:
    folder = tmp_path_factory.mktemp("hf")
    vocab_size = len(demo_vocab()[0])
    return folder, random_checkpoint(folder, vocab_size, tied=False)


PROMPT = [5, 17, 300, 42, 1000, 7, 99, 512, 3, 1500, 64, 88, 2000, 11, 250, 9]


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name
)
def test_logits_equal_the_hf_checkpoint_within_quantization_error(
    checkpoint: tuple[Path, transformers.PreTrainedModel],
    qtype: gguf.GGMLQuantizationType,
    tmp_path: Path,
) -> None:
    _, hf_model = checkpoint
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, hf_model, qtype)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    ours = run_logits(loaded, PROMPT)
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPT])).logits[0].float()
    err = relative_error(ours, ref)
    assert err < QUANT_TOLERANCE[qtype], f"{qtype.name}: relative logit error {err:.2e}"
    if qtype == Q.F32:
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # Exactly the quantization error: the checkpoint with each matrix quantized and
    # dequantized in place (no GGUF file, no permutation) gives our logits.
    requantized = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in requantized.parameters():
            if p.dim() == 2:
                q = quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.dequantize(q, qtype).reshape(p.shape).copy()))
        ref_quant = requantized(torch.tensor([PROMPT])).logits[0].float()
    same = relative_error(ours, ref_quant)
    assert same < 1e-4, f"{qtype.name}: differs from the requantized checkpoint by {same:.2e}"
    # And the same numbers as transformers' own GGUF loader on the same file.
    hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref_gguf = hf_gguf(torch.tensor([PROMPT])).logits[0].float()
    same = relative_error(ours, ref_gguf)
    assert same < 1e-4, f"{qtype.name}: differs from transformers on the same GGUF by {same:.2e}"


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_q4_k_writer_round_trips_through_gguf_dequantize() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 0.1, size=(8, 512)).astype(np.float32)
    back = gguf.dequantize(quantize_q4_k(w), Q.Q4_K).reshape(w.shape)
    assert np.abs(back - w).max() < 0.1 * np.abs(w).max()


# Where each type's fp16 scales sit in its block (bytes), and the block's size.
FP16_AT = {"Q8_0": (34, [0]), "Q4_0": (18, [0]), "Q4_1": (20, [0, 2]), "Q5_0": (22, [0])}
FP16_AT |= {"Q4_K": (144, [0, 2]), "Q6_K": (210, [208])}


@pytest.mark.parametrize("type_name", sorted(FP16_AT))
@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_dequantize_to_the_gguf_packages_values(type_name: str, seed: int) -> None:
    """``dequantize_ints`` over random blocks (finite fp16 scales, either sign; the other
    bytes anything) equals ``gguf.dequantize``, bit for bit (signed zeros included): the
    loader takes it instead of the package's slower loop for these types."""
    from prefixcache.engine.model.gguf_blocks import block_ints, dequantize_ints

    rng = np.random.default_rng(seed)
    size, at = FP16_AT[type_name]
    n, k = 24, 512
    per_block = 256 if type_name.endswith("_K") else 32  # weights a block
    raw = rng.integers(0, 256, size=(n * k // per_block, size), dtype=np.uint8)
    for offset in at:
        d = (rng.standard_normal(len(raw)) * 0.02).astype(np.float16)
        raw[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    ints = block_ints(raw, type_name, n, k)
    assert ints is not None
    ours = dequantize_ints(ints)
    want = gguf.dequantize(raw, Q[type_name]).reshape(n, k)
    assert ours.dtype == np.float32 and ours.shape == (n, k)
    assert np.array_equal(ours.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    permuted = permute_rope_rows(w, 8)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rope_rows(permuted, 8), w)
    assert np.array_equal(unpermute_rope_rows(permuted[:, 0], 8), w[:, 0])  # a bias


def test_tied_gguf_without_output_tensor_ties_the_head(
    tmp_path: Path,
) -> None:
    model = random_checkpoint(tmp_path / "hf", len(demo_vocab()[0]), tied=True)
    path = tmp_path / "tied.gguf"
    write_gguf(path, model, Q.F32)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(run_logits(loaded, PROMPT), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_ids_equal_tokenizer_json_and_transformers(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path, pre: str
) -> None:
    from prefixcache.engine.text.tokenizer import Tokenizer

    path = tmp_path / "tok.gguf"
    write_gguf(path, checkpoint[1], Q.F16, pre=pre)
    ours = load_model(str(path), dtype="float32", device="cpu").tokenizer
    demo = Tokenizer.from_folder(ASSETS)  # the tokenizer.json these ids came from
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        if pre == "default":  # GPT-2's split, as the demo tokenizer.json was trained with
            assert ids == demo.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.encode(text, add_special_tokens=True) == [ours.bos_token_id, *ids]
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi!"}]
    prompt = ours.apply_chat_template(messages)
    assert ours.encode(prompt) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eot = ours.token_to_id("<|eot_id|>")
    assert ours.eos_token_ids[:2] == [ours.token_to_id("<|end_of_text|>"), eot]
    assert ours.piece_cache is not None  # byte-level BPE: the piece memo stays on


def test_sentencepiece_tokenizer_ids_equal_transformers(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    write_gguf(path, None, tokenizer="llama")
    from gguf import GGUFReader

    from prefixcache.engine.model.gguf_loader import read_metadata
    from prefixcache.engine.text.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(read_metadata(GGUFReader(path)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "the baker bakes bread", "   three leading spaces"]:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.encode(text, add_special_tokens=True) == hf(text).input_ids == [1, *ids]
        assert ours.decode(ids) == hf.decode(ids), text
    assert any(0x3 <= i < 259 for i in ours.encode("東京"))  # unknown chars: byte fallback
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    assert ours.encode(ours.apply_chat_template(messages)) == hf.apply_chat_template(
        messages, tokenize=True, return_dict=False
    )
    assert ours.piece_cache is None  # Metaspace "first": whole texts only (the memo's check)


def test_sentencepiece_merges_follow_scores() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5]
    assert sentencepiece_merges(tokens, scores) == [
        ("ab", "c"),
        ("a", "bc"),
        ("a", "b"),
        ("b", "c"),
    ]


def same_tokenizer(a, b) -> None:  # type: ignore[no-untyped-def]
    """Two Tokenizers that serve a model the same way: ids, prompt, stops, fingerprint."""
    assert a.fingerprint == b.fingerprint
    assert a.eos_token_ids == b.eos_token_ids and a.bos_token_id == b.bos_token_id
    assert a.special_tokens == b.special_tokens
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.encode(text, add_special_tokens=True) == b.encode(text, add_special_tokens=True)
    assert a.chat_template == b.chat_template
    if a.chat_template is not None:
        messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi"}]
        assert a.apply_chat_template(messages) == b.apply_chat_template(messages)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_gguf_tokenizer_rebuilds_from_its_spec(tmp_path: Path, kind: str) -> None:
    """What ProcessEngine's core sends its API side is the whole tokenizer, for both GGUF
    vocabulary kinds (and a Hugging Face folder's)."""
    from gguf import GGUFReader

    from prefixcache.engine.model.gguf_loader import read_metadata
    from prefixcache.engine.text.tokenizer import Tokenizer

    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, None, tokenizer=kind)
    ours = Tokenizer.from_gguf(read_metadata(GGUFReader(path)), extra_eos_ids=[7])
    rebuilt = Tokenizer.from_spec(
        msgspec.msgpack.decode(msgspec.msgpack.encode(ours.to_spec()), type=TokenizerSpec)
    )
    same_tokenizer(ours, rebuilt)
    assert 7 in rebuilt.eos_token_ids
    folder = Tokenizer.from_folder(ASSETS, extra_eos_ids=[3])
    same_tokenizer(folder, Tokenizer.from_spec(folder.to_spec()))


async def test_process_engine_serves_a_gguf_file(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    """`prefixcache serve --model FILE.gguf` in its default (process) mode: the API side
    tokenizes as the core does, and the tokens equal the in-process engine's."""
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import EngineRequest, SamplingParams
    from prefixcache.engine.serving.process_engine import ProcessEngine

    path = tmp_path / "m.gguf"
    write_gguf(path, checkpoint[1], Q.Q8_0)
    config = dict(model=str(path), dtype="float32", device="cpu", num_blocks=64)
    reference = LLMEngine(EngineConfig(**config))
    engine = ProcessEngine(EngineConfig(**config))
    await engine.start()
    try:
        same_tokenizer(engine.tokenizer, reference.tokenizer)
        assert engine.model_name == "m.gguf"
        assert engine.cache_identity == LLMEngine.cache_identity(reference.loaded)
        prompt = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        )
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        want = reference.generate([prompt], params)[0]
        tokens, text = [], ""
        async for out in engine.generate(EngineRequest("g", prompt, params)):
            tokens += out.new_token_ids
            text += out.text_delta
        assert tokens == want.token_ids and text == want.text
    finally:
        await engine.shutdown()
        reference.close()


def test_fingerprints_follow_the_file(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, checkpoint[1], Q.F32)
    write_gguf(b, checkpoint[1], Q.Q8_0)
    first = load_model(str(a), dtype="float32", device="cpu")
    again = load_model(str(a), dtype="float32", device="cpu")
    other = load_model(str(b), dtype="float32", device="cpu")
    assert first.identity == again.identity
    assert first.fingerprint != other.fingerprint
    assert first.tokenizer.fingerprint == other.tokenizer.fingerprint
    assert load_model(str(a), dtype="bfloat16", device="cpu").identity != first.identity


def test_truncated_file_is_a_clear_error(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path, checkpoint[1], Q.F16)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(path), device="cpu")
    path.write_bytes(data[:1000])  # inside the metadata
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(path), device="cpu")
    with pytest.raises(GGUFLoadError, match="not found"):
        load_gguf(tmp_path / "absent.gguf", torch.float32, torch.device("cpu"))


def test_unknown_architecture_is_named(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    path = tmp_path / "falcon.gguf"
    write_gguf(path, checkpoint[1], Q.F16, arch="falcon")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(path), device="cpu")


def test_unsupported_tensor_type_is_named(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    path = tmp_path / "tq.gguf"
    write_gguf(path, checkpoint[1], Q.TQ1_0)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tensor type TQ1_0"):
        load_model(str(path), device="cpu")


def test_serve_with_a_bad_gguf_fails_at_start(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    """The server never answers requests with a model that did not load: it exits, or its
    /health says failed with the loader's message."""
    path = tmp_path / "bad.gguf"
    write_gguf(path, checkpoint[1], Q.F16, arch="falcon")
    port = _free_port()
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--model", str(path)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                assert proc.returncode != 0
                assert "unsupported GGUF architecture 'falcon'" in (proc.stdout.read() or "")
                return
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if health.status_code != 200 and health.json().get("status") == "failed":
                    assert "unsupported GGUF architecture 'falcon'" in health.json()["error"]
                    return
                assert health.status_code != 200, "a server with a bad model reports healthy"
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail("the server neither exited nor reported the failed load")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=20)
        if proc.stdout:
            proc.stdout.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("tied", [True, False])
def test_bench_export_writes_the_gguf_as_a_checkpoint_transformers_serves(
    tmp_path: Path, tied: bool
) -> None:
    """bench/export_hf.py (the folder vLLM serves in bench/context_sweep.sh): transformers
    loads it with no GGUF in sight, and its logits, token ids and chat prompt are the GGUF's
    through our loader."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "export_hf", Path(__file__).resolve().parent.parent / "bench" / "export_hf.py"
    )
    assert spec is not None and spec.loader is not None
    export_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_hf)

    model = random_checkpoint(tmp_path / "hf", len(demo_vocab()[0]), tied=tied)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, Q.Q8_0)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    out = tmp_path / "export"
    export_hf.export(loaded, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(got, run_logits(loaded, PROMPT), atol=1e-5, rtol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert tok(text, add_special_tokens=False).input_ids == loaded.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == loaded.tokenizer.apply_chat_template(messages)


def test_yarn_metadata_becomes_transformers_yarn() -> None:
    """llama.cpp's YaRN keys (a Qwen file converted with its 4x recipe): ModelConfig's yarn,
    with the pretraining length; llama.cpp's frequencies and attention factor are
    transformers' (the same correction dims, ramp and 0.1 ln(factor) + 1)."""
    from prefixcache.engine.model.gguf_loader import config_from_metadata
    from prefixcache.engine.model.model_config import ModelConfig
    from prefixcache.engine.model.rope import RotaryEmbedding

    meta = {
        "general.architecture": "qwen2",
        "qwen2.block_count": 2,
        "qwen2.context_length": 131072,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 96,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.rope.freq_base": 1e6,
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
        "tokenizer.ggml.tokens": ["a"] * 256,
    }
    config = ModelConfig.from_dict(config_from_metadata(meta, {"token_embd.weight"}))
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert RotaryEmbedding(config).attention_factor == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_a_phi3_gguf_splits_its_fused_projections(tmp_path: Path, qtype: Q) -> None:
    """llama.cpp's phi3 file: q/k/v in one ``attn_qkv`` and gate/up in one ``ffn_up``, as
    written (no q/k permutation). Split at load, dequantized or kept quantized (each part's
    rows packed on their own): transformers' logits on the checkpoint, and on the same file."""
    torch.manual_seed(1)
    cfg = transformers.Phi3Config(
        vocab_size=len(demo_vocab()[0]), hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    hf = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    path = tmp_path / "tiny-phi3.gguf"
    write_gguf(path, hf, qtype, arch="phi3")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    tolerance = 1e-5 if qtype == Q.F32 else QUANT_TOLERANCE[qtype]
    for weights in ("dequantized", "quantized"):
        loaded = load_model(str(path), dtype="float32", device="cpu", gguf_weights=weights)
        assert loaded.config.model_type == "phi3"
        assert relative_error(run_logits(loaded, PROMPT), ref) < tolerance, weights
        from prefixcache.engine.kernels import cpu_qgemm

        if weights == "quantized" and qtype != Q.F32 and cpu_qgemm.computes(torch.float32):
            layer = loaded.model.model.layers[0]  # each part's rows packed on their own
            kinds = {type(m).__name__ for m in (layer.self_attn.q_proj, layer.mlp.up_proj)}
            assert kinds == {"QLinear"}
    hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, pad_token_id=0
    ).eval()  # (Phi3Config's default pad id, 32000, lies past this vocabulary)
    with torch.no_grad():
        theirs = hf_gguf(torch.tensor([PROMPT])).logits[0].float()
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert relative_error(run_logits(loaded, PROMPT), theirs) < 1e-4


def test_a_longrope_phi3_gguf_is_refused_by_name(tmp_path: Path) -> None:
    """Phi-3 128K files carry LongRoPE's per-pair factors as tensors: refused, saying why."""
    gguf_mod = pytest.importorskip("gguf")
    path = tmp_path / "longrope.gguf"
    w = gguf_mod.GGUFWriter(str(path), "phi3")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("context_length", 512)):
        w.add_uint32(f"phi3.{key}", value)
    w.add_uint32("phi3.feed_forward_length", 96)
    w.add_uint32("phi3.attention.head_count", 4)
    tokens, merges, types, _ = demo_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="LongRoPE"):
        load_model(str(path), dtype="float32", device="cpu")


def test_a_smollm3_gguf_leaves_rope_out_of_every_fourth_layer(tmp_path: Path) -> None:
    """llama.cpp's smollm3: llama's tensors (q/k rows permuted), no RoPE in layers 4, 8, ...
    (its fixed step of 4, transformers' default): transformers' logits on the checkpoint."""
    torch.manual_seed(2)
    cfg = transformers.SmolLM3Config(
        vocab_size=len(demo_vocab()[0]), hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
        bos_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # write_gguf's base
    )  # fmt: skip
    hf = transformers.SmolLM3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    path = tmp_path / "tiny-smollm3.gguf"
    write_gguf(path, hf, Q.F32, arch="smollm3", layers=4)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.rope_layers == (True, True, True, False)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert relative_error(run_logits(loaded, PROMPT), ref) < 1e-5


def test_an_empty_prompt_is_the_start_token_where_the_tokenizer_adds_one(
    checkpoint: tuple[Path, transformers.PreTrainedModel], tmp_path: Path, server_loop: ServerLoop
) -> None:
    """``"prompt": ""`` on a model whose tokenizer adds a start token (this file's, as
    Gemma's and Llama 3's do) is that token alone: a base model's unconditional sample, as
    vLLM serves it. An empty token list stays a 400 (tests/test_sidecar_validation.py: and
    an empty string where the tokenizer adds nothing, the demo model's)."""
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.serving.async_engine import AsyncEngine
    from prefixcache.sidecar.server.app import SidecarSettings, create_app

    path = tmp_path / "m.gguf"
    write_gguf(path, checkpoint[1], Q.F32)
    engine = AsyncEngine(
        EngineConfig(model=str(path), dtype="float32", device="cpu", num_blocks=64)
    )
    server = serve(server_loop, create_app(engine, SidecarSettings()))
    try:
        url = server.url + "/completions"
        body = {"model": "m.gguf", "max_tokens": 3, "temperature": 0}
        r = httpx.post(url, json={**body, "prompt": ""}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 1
        bos = engine.tokenizer.encode("", True)
        assert len(bos) == 1
        same = httpx.post(url, json={**body, "prompt": bos}, timeout=60).json()
        assert same["choices"][0]["text"] == r.json()["choices"][0]["text"]
        r = httpx.post(url, json={**body, "prompt": ["", "a"]}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = httpx.post(url, json={**body, "prompt": []}, timeout=60)
        assert r.status_code == 400, r.text
        # echo + logprobs of a text prompt: the start token the tokenizer added is not in the
        # echoed text, so it is not listed (it was, as "<bos>"-like text, offsets shifted);
        # token ids keep every token, their echo holding the start token's text
        text = "the quick brown fox"
        ids = [*bos, 5, 6, 7]
        for prompt, streamed in ((text, False), (text, True), (ids, False)):
            fields = {"prompt": prompt, "echo": True, "logprobs": 1, "stream": streamed}
            r = httpx.post(url, json={**body, **fields}, timeout=60)
            assert r.status_code == 200, r.text
            echo = prompt if prompt == text else engine.tokenizer.decode(ids, False)
            if streamed:
                lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: {")]
                first = json.loads(lines[0])["choices"][0]
                assert first["text"] == echo
                lp = first["logprobs"]
            else:
                choice = r.json()["choices"][0]
                assert choice["text"].startswith(echo)
                n = len(choice["logprobs"]["tokens"]) - 3  # the completion's 3 tokens come last
                lp = {k: v[:n] for k, v in choice["logprobs"].items()}
            assert "".join(lp["tokens"]) == echo
            offsets = zip(lp["tokens"], lp["text_offset"], strict=True)
            assert all(echo[o : o + len(t)] == t for t, o in offsets)
            assert len(lp["tokens"]) == (
                len(ids) if prompt == ids else len(engine.tokenizer.encode(text, False))
            )
    finally:
        server.stop()
