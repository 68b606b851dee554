"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from .paging import DEFAULT_BLOCK_SIZE


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"  # "demo" or a local Hugging Face folder
    # "auto" (or None): bf16 on CUDA and on CPUs with native bf16, else fp32 | "float32" | ...
    dtype: str | None = "auto"
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

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
