"""load_gguf(): a llama.cpp GGUF file -> GGUFModel, dequantized to the engine dtype (or with
its block-quantized linears and embedding kept quantized: ``gguf_weights``).

The header is parsed by the ``gguf`` package's reader on a file's first load and kept
(``gguf_index``: metadata, tensor table, rebuilt tokenizer); the tensors are memory-mapped
from the file and dequantized one at a
time (``gguf.dequantize``, float32) and cast to the engine dtype, so the process holds the
model once plus one float32 tensor, never two copies of the weights. Config comes from the
``<arch>.*`` metadata, the tokenizer from ``tokenizer.*`` (engine/text/gguf_tokenizer.py).

llama.cpp's converter permutes the rows of q and k for llama and mistral (its RoPE rotates
interleaved pairs, Hugging Face's rotates halves); that permutation is undone here. qwen2 and
qwen3 files are written unpermuted. llama.cpp's converter adds 1 to every Gemma norm weight
(llama.cpp scales by the weight, Gemma by 1 + weight); as transformers does, 1 is taken off
again (float32) for gemma2 and gemma3.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from ..kernels.gemm_blocks import BlockSource
from ..text import gguf_index
from ..text.tokenizer import Tokenizer, TokenizerListener
from . import gguf_weights
from .gguf_blocks import BlockInts, block_ints, dequantize_ints
from .llama import LlamaForCausalLM
from .model_config import ModelConfig, UnsupportedModelError
from .progress import progress_bar
from .registry import causal_lm_class, fused_parts, hf_tensor_name
from .rope import rope_inv_freq

if TYPE_CHECKING:
    from gguf import GGUFReader

# GGUF general.architecture -> the Hugging Face architecture the engine runs.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",  # every 4th layer without RoPE, as llama.cpp runs it
}
PERMUTED_QK = ("llama", "mistral", "smollm3")  # written with interleaved-pair RoPE rows
# Tensor types dequantized at load (names as gguf.GGMLQuantizationType spells them).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
_FINGERPRINT_SAMPLE = 1 << 20  # bytes of tensor data hashed from each end of the file

GEMMA_ARCHS = ("gemma2", "gemma3")  # norms written as 1 + weight, four a layer, own config
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # transformers' defaults (and llama.cpp's)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # their 27B: scale by hidden / heads
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-pair frequency divisors


class GGUFLoadError(ValueError):
    """The file is not a readable GGUF, is truncated, or holds what the engine cannot run."""


@dataclass(slots=True)
class GGUFModel:
    """What loader.load_model wraps into a LoadedModel."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str
    quantized: bool = False  # some weights kept quantized (gguf_weights)


def open_gguf(path: Path) -> GGUFReader:
    """The memory-mapped reader, after checking that every tensor lies inside the file."""
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFLoadError(f"GGUF file {str(path)!r} not found")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError / IndexError on broken headers
        raise GGUFLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt header?): {exc}"
        ) from exc
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFLoadError(
                f"{path}: truncated: tensor {t.name} needs bytes up to {end} but the file has "
                f"{size}"
            )
    return reader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field as Python values (strings, numbers, lists)."""
    return {name: f.contents() for name, f in reader.fields.items() if f.types}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A config.json-style dict for ModelConfig.from_dict, from ``<arch>.*`` metadata."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}: prefixcache runs "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            raise UnsupportedModelError(
                f"{arch}.{key} differs per layer in this file; prefixcache needs one value"
            )
        return value

    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if get(key) is None:
            raise GGUFLoadError(f"GGUF metadata {arch}.{key} is missing")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise UnsupportedModelError("key and value head sizes differ: prefixcache needs them equal")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    raw: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length") or 4096),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(get("rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
    }
    if arch in GEMMA_ARCHS:
        raw.update(_gemma_config(arch, meta, raw))
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = float(get("rope.scaling.factor") or 1.0)
        if scaling != "linear":  # yarn and the rest: ModelConfig names what it supports
            raw["rope_scaling"] = {"rope_type": scaling, "factor": factor}
            if (orig := get("rope.scaling.original_context_length")) is not None:
                raw["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        elif factor != 1.0:
            raw["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if arch not in GEMMA_ARCHS:
        # llama.cpp's graphs for these attend fully whatever the file says (and Mistral's
        # config would default an absent window to 4096): read, never applied.
        raw["sliding_window"] = None
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            raw[name] = int(value)
    return raw


def _gemma_config(a: str, meta: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's fields. Where the file is silent (the Gemma 3 270M file names no
    layer pattern, local rope base nor attention scale), transformers' defaults, which are
    also llama.cpp's: Gemma 3 every 6th layer global, local base 10000; Gemma 2 every other
    layer; scale head_dim ** -0.5 (llama.cpp's rule, hidden / heads for the 27B models, is
    kept). ``rope.scaling.*`` (read after this) applies to Gemma 3's global layers only, in
    llama.cpp as in transformers. Softcaps as the file gives them (llama.cpp's converter
    writes Gemma 2's; the file's silence means none)."""
    layers = raw["num_hidden_layers"]
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", GEMMA_SLIDING_PATTERN[a])
    if isinstance(pattern, list):  # newer llama.cpp: one flag per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    if len(sliding) != layers:
        raise GGUFLoadError(f"{a}.attention.sliding_window_pattern has {len(sliding)} layers")
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(meta.get(f"{a}.attention.sliding_window", 4096)),
    }
    if a == "gemma3":
        out["rope_local_base_freq"] = float(meta.get(f"{a}.rope.freq_base_swa", 10000.0))
    if (scale := meta.get(f"{a}.attention.scale")) is not None:
        out["query_pre_attn_scalar"] = float(scale) ** -2
    elif layers == GEMMA_27B_LAYERS[a]:
        out["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = raw["head_dim"]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = meta.get(f"{a}.{key}")
        out[key] = None if cap is None else float(cap)
    return out


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, D/2, 1, D/2+1, ...) -> (0..D-1),
    i.e. interleaved rotation pairs back to rotate-half halves. Works for weights and biases."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: Any, ints: BlockInts | None = None) -> np.ndarray:
    """One tensor as a float32 array in Hugging Face (row-major, reversed GGUF) shape; from
    ``ints`` (its blocks split, ``gguf_blocks.block_ints``) where given: the same values."""
    from gguf import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if ints is not None:
        return dequantize_ints(ints).reshape(shape)
    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def check_extents(index: gguf_index.GGUFIndex, path: Path) -> None:
    """Every tensor inside the file (``open_gguf``'s check, for an index read from cache)."""
    size = path.stat().st_size
    for t in index.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFLoadError(
                f"{path}: truncated: tensor {t.name} needs bytes up to "
                f"{t.data_offset + t.n_bytes} but the file has {size}"
            )


def check_tensor_types(tensors: list[Any], path: Path) -> None:
    bad = sorted({t.tensor_type.name for t in tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        names = [t.name for t in tensors if t.tensor_type.name in bad][:3]
        raise UnsupportedModelError(
            f"{path.name}: unsupported GGUF tensor type {', '.join(bad)} (e.g. {', '.join(names)}):"
            f" prefixcache dequantizes {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    weights: str = "dequantized",
    on_tokenizer: TokenizerListener | None = None,
) -> GGUFModel:
    """``weights``: ``gguf_weights.WEIGHT_MODES``; ``on_tokenizer``: as ``load_model``'s."""
    quantize = gguf_weights.resolve_mode(weights, dtype, device)
    if not path.is_file():
        raise GGUFLoadError(f"GGUF file {str(path)!r} not found")
    index = gguf_index.open_index(path, open_gguf)
    check_extents(index, path)
    meta = index.metadata
    tensors = {t.name: t for t in gguf_index.tensor_views(index, path)}
    raw_config = config_from_metadata(meta, set(tensors))
    config = ModelConfig.from_dict(raw_config)
    check_tensor_types(list(tensors.values()), path)
    built = None
    if index.tokenizer is None:  # raises why the metadata's tokenizer cannot be built
        built = Tokenizer.from_gguf(meta, extra_eos_ids=config.eos_token_ids)
        spec = built.to_spec()
    else:
        eos = index.tokenizer.eos_token_ids + list(config.eos_token_ids)
        spec = msgspec.structs.replace(index.tokenizer, eos_token_ids=eos)
    if on_tokenizer is not None:
        on_tokenizer(spec)
    tokenizer = built if built is not None else Tokenizer.from_spec(spec)

    arch = raw_config["model_type"]
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    def parts(hf: str) -> list[tuple[str, int, int]]:  # the model's rows in tensor `hf`
        return fused_parts(config, hf) or [(hf, 0, expected.get(hf, (0,))[0])]

    placed = {n: parts(hf) for n in tensors if (hf := hf_tensor_name(n, arch)) is not None}
    unknown = [n for n in tensors if n != ROPE_FREQS and n not in placed]
    if any(n.startswith("rope_factors_") for n in unknown):  # Phi-3 128K, Phi-3.5
        raise UnsupportedModelError(
            f"{path.name}: LongRoPE (rope_factors_long / _short) rotates a token by the "
            "sequence's length, so no cached prefix stays valid: not supported"
        )
    unexpected = [n for n, ps in placed.items() if any(p not in expected for p, _, _ in ps)]
    if unknown or unexpected:
        raise GGUFLoadError(f"{path.name}: tensors the engine cannot place: {unknown + unexpected}")
    missing = sorted(set(expected) - {p for ps in placed.values() for p, _, _ in ps})
    if missing:
        raise GGUFLoadError(f"{path.name}: missing tensors: {missing[:6]}")

    permute = arch in PERMUTED_QK
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, Any] = {}
    head_name = gguf_weights.HEAD if gguf_weights.HEAD in expected else gguf_weights.EMBEDDING
    sources: dict[str, BlockSource] = {}  # blocks the bf16 GEMMs read (AMX)
    with progress_bar("dequantize", sum(int(tensors[n].n_bytes) for n in placed), unit="B") as bar:
        for gguf_name, hf_parts in placed.items():
            t, hf = tensors[gguf_name], hf_parts[0][0]
            shape = (hf_parts[-1][2], *expected[hf][1:])  # a fused tensor: its parts' rows
            if tuple(int(d) for d in reversed(t.shape.tolist())) != shape:
                raise GGUFLoadError(
                    f"{path.name}: tensor {gguf_name} has shape {list(reversed(t.shape.tolist()))} but "
                    f"the metadata implies {list(shape)}"
                )
            orders = [np.arange(a, b) for _, a, b in hf_parts]  # a fused tensor's parts
            if len(hf_parts) == 1:
                orders = [_row_order(gguf_name, shape[0], config) if permute else None]
            if quantize and gguf_weights.quantizable_name(hf):
                qws = [gguf_weights.pack_tensor(t, order) for order in orders]
                if all(qw is not None for qw in qws):
                    packed.update((p, qw) for (p, _, _), qw in zip(hf_parts, qws, strict=True))
                    bar.update(int(t.n_bytes))
                    continue
            ints = block_ints(t.data, t.tensor_type.name, *shape) if len(shape) == 2 else None
            if hf == head_name or (
                hf != gguf_weights.EMBEDDING and gguf_weights.quantizable_name(hf)
            ):
                found = gguf_weights.block_sources(ints, orders, dtype, device, hf == head_name)
                if found is not None:
                    sources.update((p, src) for (p, _, _), src in zip(hf_parts, found, strict=True))
            w = dequantize_tensor(t, ints)
            if permute and ".attn_q." in gguf_name:
                w = unpermute_rope_rows(w, config.num_heads)
            elif permute and ".attn_k." in gguf_name:
                w = unpermute_rope_rows(w, config.num_kv_heads)
            elif arch in GEMMA_ARCHS and gguf_name.endswith("norm.weight"):
                w = w - np.float32(1.0)
            for part, a, b in hf_parts:
                state[part] = torch.from_numpy(w[a:b]).to(device=device, dtype=dtype)
            del w  # one float32 tensor at a time
            bar.update(int(t.n_bytes))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and gguf_weights.EMBEDDING not in packed:
        model.lm_head.weight = model.model.embed_tokens.weight
    if packed:
        gguf_weights.install(model, packed, config.tie_word_embeddings, dtype)
    else:  # the same logits, each weight read at 0.75-1.06 bytes instead of 2
        for name, src in sources.items():
            linear = (
                model.lm_head
                if name == head_name
                else model.get_submodule(name.removesuffix(".weight"))
            )
            linear.block_source = src
    if ROPE_FREQS in tensors:  # divides each pair's frequency, as llama.cpp's rope does
        factors = torch.from_numpy(dequantize_tensor(tensors[ROPE_FREQS]).reshape(-1))
        model.model.rotary_emb.inv_freq_cpu = rope_inv_freq(config) / factors
    model.eval().requires_grad_(False)
    fingerprint = gguf_fingerprint(path, index.data_offset, raw_config)
    if packed:
        fingerprint = gguf_weights.quantized_fingerprint(fingerprint)
    return GGUFModel(model, config, tokenizer, fingerprint, quantized=bool(packed))


def _row_order(gguf_name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The rows of a llama/mistral q or k weight in Hugging Face order (``unpermute_rope_rows``
    as an index), else None."""
    heads = {".attn_q.": config.num_heads, ".attn_k.": config.num_kv_heads}
    for part, n in heads.items():
        if part in gguf_name:
            return unpermute_rope_rows(np.arange(rows), n)
    return None


def gguf_fingerprint(path: Path, data_start: int, raw_config: dict[str, Any]) -> str:
    """sha256 over the derived config, the file's name and size, its whole header (metadata
    and tensor table) and the first and last MiB of tensor data."""
    h = hashlib.sha256(json.dumps(raw_config, sort_keys=True).encode())
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(data_start))
        h.update(fh.read(_FINGERPRINT_SAMPLE))
        fh.seek(max(data_start, size - _FINGERPRINT_SAMPLE))
        h.update(fh.read())
    return h.hexdigest()[:32]
