"""ModelConfig: the parts of a Hugging Face config.json that a Llama-family decoder needs.

Checkpoints written by different tools and transformers versions spell the same thing in
different ways (``torch_dtype`` vs ``dtype``, ``rope_scaling`` vs ``rope_parameters``, ``head_dim``
present or derived, ``eos_token_id`` as an int or a list); ``from_dict`` accepts all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3 4B-27B: its text decoder (the vision tower's tensors are left unread)
    "Gemma3ForConditionalGeneration": "gemma3",
    "Mistral3ForConditionalGeneration": "mistral",  # Mistral Small 3.1 / 3.2: its text decoder
    # Qwen2-VL / Qwen2.5-VL: the Qwen2 text decoder; on text alone M-RoPE's three position
    # components are equal, which is plain RoPE
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",  # Llama's layers, q/k/v and gate/up fused in the checkpoint
    "SmolLM3ForCausalLM": "smollm3",  # Llama's layers, RoPE left out of every 4th (NoPE)
}
# model_type spellings that name a supported architecture (Gemma 3's text model saves
# "gemma3_text").
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
# Defaults a Gemma config may leave out: the 4B-27B checkpoints' text_config names only the
# fields that differ from these.
_GEMMA_COMMON: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
GEMMA3_DEFAULTS: dict[str, Any] = {  # transformers' Gemma3TextConfig defaults
    **_GEMMA_COMMON,
    "vocab_size": 262_208,
    "max_position_embeddings": 131_072,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6,
}
GEMMA2_DEFAULTS: dict[str, Any] = {  # transformers' Gemma2Config defaults
    **_GEMMA_COMMON,
    "vocab_size": 256_000,
    "max_position_embeddings": 8192,
    "rope_theta": 10_000.0,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
GEMMA_DEFAULTS = {"gemma2": GEMMA2_DEFAULTS, "gemma3": GEMMA3_DEFAULTS}
GEGLU_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GELU, tanh approximation
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # with "rope_type": linear | llama3
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2: True)
    mlp_bias: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # applied through layer_windows (see _sliding_layers)
    # Per layer: 0 = global (full causal) attention, w > 0 = sliding window of w keys (the
    # query at position p sees keys k with p - w < k <= p, as transformers' sliding mask).
    # Empty = every layer global. Gemma 3 fills it from its local:global layer pattern.
    layer_windows: tuple[int, ...] = ()
    hidden_activation: str = "silu"  # Gemma: gelu_pytorch_tanh (GeGLU MLP)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    rope_local_base_freq: float | None = None  # Gemma 3: the sliding layers' rope base
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_logit_softcapping: float | None = None
    # Per layer, whether q and k are rotated (SmolLM3's NoPE layers are not); empty = all
    rope_layers: tuple[bool, ...] = ()

    def window_of(self, layer: int) -> int:
        """The layer's sliding window (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def uses_rope(self, layer: int) -> bool:
        """Whether the layer rotates q and k (False: a NoPE layer)."""
        return self.rope_layers[layer] if self.rope_layers else True

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide: the KV cache keeps them on local pages (two layer groups, or
        the local one alone when every layer slides, as in Mistral 7B v0.1)."""
        return any(w > 0 for w in self.layer_windows)

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each head of q and k, before RoPE."""
        return self.model_type == "qwen3"

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sm_scale(self) -> float | None:
        """The attention backends' scale where it is not their ``head_dim ** -0.5`` (Gemma's
        ``query_pre_attn_scalar``, 168 or 144 on the 27B models), else None."""
        qpas = self.query_pre_attn_scalar
        return None if qpas is None or qpas == self.head_dim else self.attention_scale

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if isinstance(raw.get("text_config"), dict):  # a text model's fields nested
            raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            model_type = str(raw.get("model_type", ""))
            arch = (
                by_type.get(_MODEL_TYPE_ALIASES.get(model_type, model_type)) if not archs else None
            )
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            got = archs or raw.get("model_type")
            raise UnsupportedModelError(
                f"unsupported architecture {got!r}: prefixcache supports {supported}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if model_type in GEMMA_DEFAULTS:
            # Defaults under the file's values; a softcap the file sets to null stays off.
            given = {k: v for k, v in raw.items() if v is not None or k.endswith("softcapping")}
            raw = {**GEMMA_DEFAULTS[model_type], **given}
            act = raw.get("hidden_activation") or raw.get("hidden_act")
            if act not in GEGLU_ACTIVATIONS:
                raise UnsupportedModelError(f"unsupported Gemma hidden_activation {act!r}")
        else:
            act = raw.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise UnsupportedModelError(f"unsupported hidden_act {act!r} (only silu)")
            act = "silu"

        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = raw.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )

        rope_params = raw.get("rope_parameters")
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        if isinstance(rope_params, dict):  # transformers >= 5 folds rope_theta in here
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_scaling is None:
                rope_scaling = rope_params
        extra: dict[str, Any] = {}  # fields of one family
        if model_type in GEMMA_DEFAULTS:
            extra = _gemma_fields(raw, model_type)
            rope_theta, rope_scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        scaling = _normalise_rope_scaling(rope_scaling)
        max_pos = int(raw.get("max_position_embeddings") or 4096)
        if scaling is not None and scaling["rope_type"] in ("yarn", "llama3"):
            # transformers' rule: the file's pretraining length, else max_position_embeddings
            orig = raw.get("original_max_position_embeddings") or max_pos
            scaling.setdefault("original_max_position_embeddings", orig)
        for where in (raw, rope_params if isinstance(rope_params, dict) else {}):
            if float(where.get("partial_rotary_factor") or 1.0) != 1.0:
                raise UnsupportedModelError(
                    "partial_rotary_factor != 1 (RoPE on part of each head) is not supported"
                )

        window = raw.get("sliding_window")
        if model_type == "smollm3":
            extra["rope_layers"] = _smollm3_rope_layers(raw)
        if model_type in ("mistral", "phi3", "qwen2", "qwen3", "smollm3"):
            window, extra["layer_windows"] = _sliding_layers(model_type, raw, max_pos)

        eos = raw.get("eos_token_id")
        eos_ids = (
            [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])
        )
        bos = raw.get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window=None if window is None else int(window),
            hidden_activation=act,
            **extra,
        )


def _gemma_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 2's and 3's own fields: the sliding/full layer pattern as ``layer_windows``, the
    rope bases (Gemma 3: a local one for the sliding layers, rope scaling on the full layers
    only; Gemma 2: one for all), the attention scale and softcaps. ``raw`` already carries
    the family's transformers defaults."""
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:  # Gemma 2: every other layer slides, from the first; Gemma 3: 5 in 6
        pattern = int(raw["sliding_window_pattern"]) if model_type == "gemma3" else 2
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"unsupported Gemma layer_types {types!r}")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma with use_bidirectional_attention is not supported")
    window = int(raw["sliding_window"])
    if model_type == "gemma2":
        params = raw.get("rope_parameters")
        scaling = dict(params) if isinstance(params, dict) else raw.get("rope_scaling")
        theta = (params or {}).get("rope_theta", raw.get("rope_theta"))
        return {
            "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
            "rope_theta": float(theta),
            "rope_scaling": scaling,
            "rope_local_base_freq": None,  # every layer on rope_theta
            "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
            "attn_logit_softcapping": _opt_float(raw.get("attn_logit_softcapping")),
            "final_logit_softcapping": _opt_float(raw.get("final_logit_softcapping")),
        }
    params = raw.get("rope_parameters")
    full: dict[str, Any] = {}
    local_theta = raw.get("rope_local_base_freq")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = dict(params["full_attention"])  # transformers >= 5: one dict per layer type
        sliding = params.get("sliding_attention") or {}
        if (sliding.get("rope_type") or "default") != "default":
            raise UnsupportedModelError("Gemma 3: rope scaling on the sliding layers")
        local_theta = sliding.get("rope_theta", local_theta)
    elif isinstance(params, dict):
        full = dict(params)
    elif isinstance(raw.get("rope_scaling"), dict):
        full = dict(raw["rope_scaling"])
    theta = full.get("rope_theta", raw.get("rope_theta"))
    return {
        "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
        "rope_theta": float(theta),
        "rope_scaling": full,
        "rope_local_base_freq": float(local_theta),
        "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
        "attn_logit_softcapping": _opt_float(raw.get("attn_logit_softcapping")),
        "final_logit_softcapping": _opt_float(raw.get("final_logit_softcapping")),
    }


def _sliding_layers(
    model_type: str, raw: dict[str, Any], max_pos: int
) -> tuple[int | None, tuple[int, ...]]:
    """(the window, ``layer_windows``) as transformers applies them: Mistral slides on every
    layer (``sliding_window`` defaults to 4096 when the key is absent; ``null`` turns it off),
    Phi-3 too (no default: Phi-3-mini-4k's 2047);
    Qwen2 / Qwen3 only with ``use_sliding_window``, on ``layer_types``' sliding layers, else
    on layers from ``max_window_layers`` (default 28) on. A window that no position can
    outgrow (>= ``max_position_embeddings``) changes nothing and is left out."""
    window = raw.get("sliding_window", None if model_type in ("phi3", "smollm3") else 4096)
    every_layer = model_type in ("mistral", "phi3")
    if window is None or (not every_layer and not raw.get("use_sliding_window", False)):
        return None, ()
    window, n = int(window), int(raw["num_hidden_layers"])
    if every_layer:
        sliding = [True] * n
    elif isinstance(types := raw.get("layer_types"), list) and len(types) == n:
        sliding = [t == "sliding_attention" for t in types]
    elif model_type == "smollm3":  # transformers' rule: the NoPE layers slide
        sliding = [not rope for rope in _smollm3_rope_layers(raw)]
    else:
        first = int(raw.get("max_window_layers", 28))
        sliding = [i >= first for i in range(n)]
    if window <= 0:
        raise UnsupportedModelError(f"sliding_window {window} must be positive")
    if window >= max_pos or not any(sliding):
        return window, ()
    return window, tuple(window if s else 0 for s in sliding)


def _smollm3_rope_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's ``no_rope_layers`` (1: the layer uses RoPE), else transformers' default: every
    ``no_rope_layer_interval``-th layer (4) without it."""
    n = int(raw["num_hidden_layers"])
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise UnsupportedModelError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return tuple(bool(f) for f in flags)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _normalise_rope_scaling(scaling: Any) -> dict[str, Any] | None:
    if not isinstance(scaling, dict):
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "mrope":  # Qwen-VL's M-RoPE: plain RoPE where every token is text
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = ""
        if rope_type in ("dynamic", "longrope", "su"):
            why = " (it rotates a token by the sequence's length: no cached prefix stays valid)"
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r}{why}: supported are "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = rope_type
    return out
