"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from .paging import DEFAULT_BLOCK_SIZE


@dataclass(slots=True, frozen=True)
class TierSpec:
    """``--kv-offload`` parsed: ``host:GIB`` or ``disk:DIR:GIB``."""

    kind: str
    num_bytes: int
    path: str | None = None  # the directory of a disk tier

    @staticmethod
    def parse(text: str) -> TierSpec:
        parts = text.split(":")
        kind = parts[0]
        try:
            if kind == "host" and len(parts) == 2:
                return TierSpec("host", _gib(parts[1]))
            if kind == "disk" and len(parts) >= 3:
                return TierSpec("disk", _gib(parts[-1]), ":".join(parts[1:-1]))
        except ValueError as exc:
            raise ValueError(f"--kv-offload {text!r}: {exc}") from None
        raise ValueError(f"--kv-offload must be host:GIB or disk:DIR:GIB, got {text!r}")


def _gib(text: str) -> int:
    gib = float(text)
    if not 0 < gib < 2**20:
        raise ValueError("the size must be a positive number of GiB")
    return int(gib * 1024**3)


# --kv-cache-dtype: the pages' storage dtype (attention/kv_dtype.py); "fp8" is fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"  # "demo" or a local Hugging Face folder
    # "auto" (or None): bf16 on CUDA and on CPUs with native bf16, else fp32 | "float32" | ...
    dtype: str | None = "auto"
    device: str | None = None  # None: cuda if available, else cpu
    attention_backend: str = "auto"  # auto | cpu | cpu-split | torch | flashinfer
    # A position's logits depend only on the tokens up to it, bit for bit, whatever was
    # cached, wherever chunked prefill cut and whoever shares the step (docs/architecture.md,
    # "Fidelity"). Off: oneDNN's GEMMs and the split attention paths, a little faster.
    batch_invariant: bool = True
    # GGUF files: dequantize every tensor at load (the default: the fastest for batches), or
    # keep block-quantized weights quantized (quantized; auto: where the CPU kernel runs, bf16
    # models), which is faster for one stream only (model/gguf_weights.py).
    gguf_weights: str = "dequantized"
    chat_template: str | None = None  # a jinja template replacing the model's (or its lack)
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # wins over kv_memory_bytes when set
    kv_memory_bytes: int = 512 * 1024**2
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256  # running sequences at once
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # "auto": the model's dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2": one byte per K/V element,
    # twice the tokens per GiB of bf16 (attention/kv_dtype.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_cascade: bool = True
    lpm_queue_limit: int = 128  # above this many waiting requests, plain arrival order
    max_wait_steps: int = 64  # age bound: a request waiting this many steps goes first
    kv_events_endpoint: str | None = None  # ZMQ PUB address for KV events, e.g. tcp://*:5557
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address for replays
    kv_events_topic: str = ""
    # Whose prompts' token ids the events carry: "none", "all", or "listed" (the namespaces in
    # kv_events_token_namespaces). Anyone who can connect to the endpoint reads them.
    kv_events_token_ids: str = "none"
    kv_events_token_namespaces: tuple[str, ...] = ()
    # A second KV tier below the pool: "host:GIB" or "disk:DIR:GIB" (None: none).
    kv_offload: str | None = None
    kv_offload_keep_files: bool = False  # a disk tier's file outlives the process
    kv_spill_policy: str = "all"  # "all" evicted blocks, or "hit": only blocks hit before
    max_pin_ttl_s: float = 3600.0  # retention hints (cache_control ttl) are capped at this
    max_hint_pinned_blocks: int | None = None  # per namespace; None: a quarter of the pool
    # Hybrid (sliding-window + global) models: local pages per global page. The KV budget is
    # split so; never fewer than the running windows plus one step's tokens need
    # (kv_setup.local_pool_size), never more than one per global page.
    swa_pool_ratio: float = 0.5
    # reuse="anywhere" segments: the leading tokens of each placed chunk computed in place
    # (EPIC-style repair of cross-chunk attention); see docs/prompt-layout.md for its cost.
    reuse_repair_tokens: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_events_token_ids not in ("none", "all", "listed"):
            raise ValueError("kv_events_token_ids must be none, all or listed")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("a KV event replay endpoint needs kv_events_endpoint")
        if self.kv_spill_policy not in ("all", "hit"):
            raise ValueError(f"kv_spill_policy must be all or hit, got {self.kv_spill_policy!r}")
        if not self.swa_pool_ratio > 0:
            raise ValueError(f"swa_pool_ratio must be > 0, got {self.swa_pool_ratio}")
        if self.reuse_repair_tokens < 0:
            raise ValueError("reuse_repair_tokens must be >= 0")
        if not self.max_pin_ttl_s > 0:
            raise ValueError("max_pin_ttl_s must be > 0")
        if self.kv_offload is not None:
            TierSpec.parse(self.kv_offload)  # a clear error at start-up
