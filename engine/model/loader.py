"""load_model(): a local Hugging Face folder, a GGUF file, a named model (``smollm2``) or the
built-in ``demo`` -> LoadedModel.

A folder holds config.json, model.safetensors or shards listed in model.safetensors.index.json
(or, from older tools, pytorch_model.bin or its shards, read with ``weights_only=True``),
tokenizer.json, and optionally tokenizer_config.json / chat_template.jinja /
generation_config.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..kernels import cpu_head_int8
from ..kernels.cpu_features import cpu_bf16_flags
from ..memory.kv_cache import KVCacheSpec
from ..request import SamplingParams
from ..text.tokenizer import Tokenizer, TokenizerListener
from .llama import LlamaForCausalLM
from .model_config import ModelConfig, UnsupportedModelError
from .progress import progress_bar
from .registry import causal_lm_class, model_tensors

_DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("float32", "fp32"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}
log = logging.getLogger("prefixcache.engine")
_FINGERPRINT_SAMPLE = 1 << 20  # bytes hashed from each end of every weight file


class ModelLoadError(ValueError):
    """A checkpoint folder is incomplete or does not match its config."""


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    path: Path | None = None
    # generation_config.json's sampling values (temperature, top_p, top_k, repetition_penalty):
    # vLLM uses them for requests that leave those fields unset.
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    def kv_cache_spec(
        self, block_size: int = 16, kv_dtype: torch.dtype | None = None
    ) -> KVCacheSpec:
        """The pages for this model: its dtype, or ``kv_dtype`` (fp8, attention/kv_dtype.py)."""
        return KVCacheSpec(
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            block_size=block_size,
            dtype=self.dtype if kv_dtype is None else kv_dtype,
            device=str(self.device),
        )

    @property
    def identity(self) -> bytes:
        """Model + tokenizer fingerprints + dtype: the prefix tree's identity key."""
        return f"{self.fingerprint}|{self.tokenizer.fingerprint}|{self.dtype}".encode()

    @property
    def output_variant(self) -> str:
        """``head:q8_int`` with the integer LM head (other logits, the same KV), else ``""``."""
        head = getattr(getattr(self.model, "head", None), "invariant", None)
        return f"head:{head.kernel}" if getattr(head, "kernel", "") == cpu_head_int8.KERNEL else ""


def auto_dtype(device: torch.device, cpuinfo: str | None = None) -> torch.dtype:
    """bf16 on CUDA and on CPUs that compute it natively; fp32 elsewhere (emulated bf16 is
    slower than fp32)."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_bf16_flags(cpuinfo)):
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None`` or ``"auto"``: see ``auto_dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        chosen = auto_dtype(device)
        log.info("dtype auto: %s on %s", str(chosen).removeprefix("torch."), device)
        return chosen
    key = dtype.removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    chosen = _DTYPES[key]
    if chosen == torch.bfloat16 and device.type == "cpu" and not cpu_bf16_flags():
        log.warning(
            "dtype bfloat16 on a CPU without native bf16: torch's bf16 and the kernels' "
            "emulated bf16 run several times slower than float32 here (dtype auto picks it)"
        )
    return chosen


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(
    name_or_path: str = "demo",
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    gguf_weights: str = "dequantized",
    on_tokenizer: TokenizerListener | None = None,
) -> LoadedModel:
    """``gguf_weights`` (GGUF files only): ``auto``, ``quantized`` or ``dequantized``
    (``gguf_weights.py``). ``on_tokenizer`` gets the tokenizer's spec before the weights load
    (a server's API side builds its own from it meanwhile)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path == "demo":
        from .demo_model import DEMO_NAME, ensure_demo_model

        folder, name = ensure_demo_model(), DEMO_NAME
        return load_folder(folder, dt, dev, name=name, on_tokenizer=on_tokenizer)
    from .named_models import NAMED_MODELS, ensure_named_model

    if name_or_path in NAMED_MODELS:
        path, name = ensure_named_model(name_or_path), name_or_path
    else:
        path = Path(name_or_path).expanduser()
        if path.suffix.lower() != ".gguf" or path.is_dir():
            return load_folder(path, dt, dev, name=path.name, on_tokenizer=on_tokenizer)
        name = path.name
    from .gguf_loader import GGUFLoadError, load_gguf

    try:
        loaded = load_gguf(path, dt, dev, gguf_weights, on_tokenizer)
    except GGUFLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
    return LoadedModel(
        model=loaded.model,
        config=loaded.config,
        tokenizer=loaded.tokenizer,
        name=name,
        fingerprint=loaded.fingerprint,
        dtype=dt,
        device=dev,
        path=path,
    )


def load_folder(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    name: str | None = None,
    on_tokenizer: TokenizerListener | None = None,
) -> LoadedModel:
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {str(folder)!r} not found: pass 'demo', 'smollm2', 'gemma3', a .gguf file or a local "
            "Hugging Face folder"
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder}: config.json not found")
    try:
        raw_config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"{config_file}: invalid JSON: {exc}") from None
    if not isinstance(raw_config, dict):
        raise ModelLoadError(f"{config_file}: not a JSON object")
    try:
        config = ModelConfig.from_dict(raw_config)
    except UnsupportedModelError:
        raise
    except KeyError as exc:
        raise ModelLoadError(f"{config_file}: no {exc.args[0]!r}, which this model needs") from None
    except (TypeError, ValueError) as exc:  # a field of the wrong type
        raise ModelLoadError(f"{config_file}: {exc}") from None
    weight_files = find_weight_files(folder)

    gen_eos = _generation_eos_ids(folder)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=config.eos_token_ids + gen_eos)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer.to_spec())

    model = build_model(config, weight_files, dtype, device)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        name=name or folder.name,
        fingerprint=model_fingerprint(raw_config, weight_files),
        dtype=dtype,
        device=device,
        path=folder,
        sampling_defaults=_generation_sampling_defaults(folder),
    )


def find_weight_files(folder: Path) -> list[Path]:
    """safetensors when present (as transformers prefers them), else PyTorch pickles; a
    LoRA adapter file lying beside them (adapter_model.safetensors) is never taken."""
    for single, index, pattern in (
        ("model.safetensors", "model.safetensors.index.json", "model*.safetensors"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        if (folder / index).is_file():
            return _indexed_files(folder, folder / index)
        if (folder / single).is_file():
            return [folder / single]
        if files := sorted(folder.glob(pattern)):
            return files
    other = [f for f in folder.glob("*.safetensors") if not f.name.startswith("adapter")]
    if other:  # shards named by another tool
        return sorted(other)
    raise ModelLoadError(
        f"{folder}: no weights found (model.safetensors or pytorch_model.bin, or their shards "
        "with an index.json)"
    )


def _indexed_files(folder: Path, index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    files = [folder / f for f in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{folder}: shards listed in {index.name} are missing: {missing}")
    return files


def read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one weight file, on the CPU."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt", device="cpu") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, sf.get_tensor(key)
        return
    try:  # weights_only: a checkpoint can never run code on load
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot be read as a PyTorch state dict: {e}") from e
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot be read as a PyTorch state dict: {e}") from e
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path}: holds a {type(state).__name__}, not a state dict")
    yield from state.items()


def build_model(
    config: ModelConfig, weight_files: list[Path], dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    state: dict[str, torch.Tensor] = {}
    total = sum(weight_data_bytes(f) for f in weight_files)
    done = 0
    with progress_bar("load weights", total, unit="B") as bar:
        for f in weight_files:
            for key, tensor in read_tensors(f):
                size = min(tensor.numel() * tensor.element_size(), total - done)
                bar.update(size)
                done += size
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                for name, part in model_tensors(config, key, tensor):
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    state[name] = part.to(device=device, dtype=dtype)  # one source at a time
        bar.update(total - done)  # a pickle's own framing

    if "lm_head.weight" in expected and "lm_head.weight" not in state:
        warnings.warn(
            "checkpoint has no lm_head.weight: tying it to the input embeddings", stacklevel=3
        )
        config.tie_word_embeddings = True
        expected.pop("lm_head.weight")
        with torch.device("meta"):
            model = causal_lm_class(config)(config)

    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensors: {_short(missing)}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has unexpected tensors: {_short(unexpected)}")
    for key, shape in expected.items():
        got = tuple(state[key].shape)
        if got != shape:
            raise ModelLoadError(
                f"tensor {key} has shape {list(got)} but config.json implies {list(shape)}"
            )

    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model


def weight_data_bytes(path: Path) -> int:
    """The tensor bytes of one weight file: a safetensors file less its header, else its size."""
    size = path.stat().st_size
    if path.suffix != ".safetensors":
        return size
    with open(path, "rb") as fh:
        return size - 8 - struct.unpack("<Q", fh.read(8))[0]


def model_fingerprint(raw_config: dict, weight_files: list[Path]) -> str:
    """sha256 over the canonical config and, per weight file, its name, size, safetensors
    header (names, dtypes, shapes, offsets) and the first and last MiB of tensor data (of a
    pickle: its first and last MiB)."""
    h = hashlib.sha256(json.dumps(raw_config, sort_keys=True).encode())
    for f in weight_files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            start = 0
            if f.suffix == ".safetensors":
                header_len = struct.unpack("<Q", fh.read(8))[0]
                h.update(fh.read(header_len))
                start = 8 + header_len
            h.update(fh.read(_FINGERPRINT_SAMPLE))
            fh.seek(max(start, size - _FINGERPRINT_SAMPLE))
            h.update(fh.read())
    return h.hexdigest()[:32]


def _generation_eos_ids(folder: Path) -> list[int]:
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return []
    eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_sampling_defaults(folder: Path) -> dict[str, float]:
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return {}
    raw = json.loads(gen.read_text(encoding="utf-8"))
    defaults: dict[str, float] = {}
    for key in _SAMPLING_KEYS:
        value = raw.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if key == "top_k" and value < 0:
            value = 0  # -1: off, as in vLLM
        try:
            SamplingParams(**{key: value})
        except ValueError as exc:  # never let the model's file fail every default request
            warnings.warn(f"{gen}: {key} ignored: {exc}", stacklevel=2)
            continue
        defaults[key] = value
    return defaults


def _short(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedModelError",
    "find_weight_files",
    "load_model",
    "model_fingerprint",
    "resolve_device",
    "resolve_dtype",
]
