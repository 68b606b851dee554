"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from .paging import DEFAULT_BLOCK_SIZE


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"  # "demo" or a local Hugging Face folder
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None: fp32 on CPU, bf16 on CUDA
    device: str | None = None  # None: cuda if available, else cpu
    attention_backend: str = "auto"  # auto | torch | flashinfer
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # wins over kv_memory_bytes when set
    kv_memory_bytes: int = 512 * 1024**2
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256  # running sequences at once
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting: int = 1024  # waiting queue limit; over it the sidecar answers 429
    enable_prefix_caching: bool = True
    enable_cascade: bool = True
    lpm_queue_limit: int = 128  # above this many waiting requests, plain arrival order
    max_wait_steps: int = 64  # age bound: a request waiting this many steps goes first
    seed: int = 0
    kv_events_endpoint: str | None = None  # ZMQ PUB address for KV events, e.g. tcp://*:5557
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address for replays
    kv_events_topic: str = ""
    # Whose prompts' token ids the events carry: "none", "all", or "listed" (the namespaces in
    # kv_events_token_namespaces). Anyone who can connect to the endpoint reads them.
    kv_events_token_ids: str = "none"
    kv_events_token_namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_events_token_ids not in ("none", "all", "listed"):
            raise ValueError("kv_events_token_ids must be none, all or listed")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("a KV event replay endpoint needs kv_events_endpoint")
