"""Paged KV storage: one tensor per layer in FlashInfer's NHD layout.

Each layer holds ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; ``[:, 0]`` is K and
``[:, 1]`` is V. A block id indexes the same page in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..paging import DEFAULT_BLOCK_SIZE


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
        # On the CPU, each layer's pages as bytes (views of the same memory): the tier's copies
        self._host: list[np.ndarray] | None = None
        if self.layers[0].device.type == "cpu":
            self._host = [
                layer.view(torch.uint8).numpy().reshape(num_blocks, -1) for layer in self.layers
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

    # The KV tier's side (``kv_tier.PageIO``): whole pages as bytes, every layer in order.

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A host copy of the pages' KV: uint8 ``[len(pages), bytes_per_block]``."""
        if self._host is not None:  # one copy, on this thread (no torch intra-op workers)
            out = np.empty((len(pages), self.bytes_per_block), dtype=np.uint8)
            width = self.bytes_per_block // len(self._host)
            for i, layer in enumerate(self._host):
                out[:, i * width : (i + 1) * width] = layer[pages]
            return out
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        rows = torch.cat([layer.index_select(0, index).flatten(1) for layer in self.layers], 1)
        return rows.view(torch.uint8).cpu().numpy()

    def write_pages(self, pages: list[int], data: np.ndarray | Sequence[np.ndarray]) -> None:
        """Fill pages from ``read_pages``' bytes: a uint8 ``[len(pages), bytes_per_block]``
        array, or one such row per page (views into a tier's slots: no gather copy).

        On the CPU each row goes straight into its page, layer by layer, on this thread: a
        plain memory copy. torch's ``index_copy_`` over the same bytes ran at 0.3-0.9 GB/s
        on a shared 2-vCPU box (its intra-op workers wait on each other)."""
        if self._host is not None:
            width = self.bytes_per_block // len(self._host)
            for page, row in zip(pages, data, strict=True):
                for i, layer in enumerate(self._host):
                    layer[page] = row[i * width : (i + 1) * width]
            return
        rows = torch.from_numpy(np.ascontiguousarray(data)).view(self.spec.dtype)
        rows = rows.to(self.layers[0].device, non_blocking=True)
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        per_layer = rows.shape[1] // len(self.layers)
        for i, layer in enumerate(self.layers):
            part = rows[:, i * per_layer : (i + 1) * per_layer]
            layer.index_copy_(0, index, part.reshape(len(pages), *layer.shape[1:]))
