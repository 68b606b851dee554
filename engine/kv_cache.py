"""Paged KV storage: one tensor per layer in FlashInfer's NHD layout.

Each layer holds ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; ``[:, 0]`` is K and
``[:, 1]`` is V. A block id indexes the same page in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paging import DEFAULT_BLOCK_SIZE


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(1, memory_bytes // self.bytes_per_block)


class KVCache:
    """The pages themselves. Who owns which page is the block manager's business."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots (K and V, every layer) of one block into another.

        Copy-on-write for a match that ends inside a cached block.
        """
        assert 0 < num_tokens <= self.spec.block_size and src_block != dst_block
        for layer in self.layers:
            layer[dst_block, :, :num_tokens].copy_(layer[src_block, :, :num_tokens])
