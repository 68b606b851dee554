"""Paged KV storage: one tensor per layer in FlashInfer's NHD layout.

Each layer holds ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; ``[:, 0]`` is K and
``[:, 1]`` is V. A block id indexes the same page in every layer. A hybrid model's sliding
layers (``local_layers``) hold ``num_local_pages`` pages instead, indexed by local page
(``hybrid/local_pages.py``; page 0 is the null page).
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

    @property
    def bytes_per_layer_page(self) -> int:
        return self.bytes_per_block // self.num_layers


class KVCache:
    """The pages themselves. Who owns which page is the block manager's business."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_local_pages: int = 0,
        local_layers: Sequence[int] = (),
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if local_layers and num_local_pages < 2:
            raise ValueError(f"sliding layers need >= 2 local pages, got {num_local_pages}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_local_pages = num_local_pages if local_layers else 0
        self.local_layers = tuple(local_layers)
        local = set(self.local_layers)

        def pages(i: int) -> tuple[int, ...]:
            n = num_local_pages if i in local else num_blocks
            return (n, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)

        self.layers: list[torch.Tensor] = [
            torch.zeros(pages(i), dtype=spec.dtype, device=spec.device)
            for i in range(spec.num_layers)
        ]
        self._global = [t for i, t in enumerate(self.layers) if i not in local]
        self._local = [t for i, t in enumerate(self.layers) if i in local]
        self.global_io = PageBytes(self._global)  # by block id
        self.local_io = PageBytes(self._local)  # by local page (hybrid models)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @staticmethod
    def select_pages(layer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """``layer.index_select(0, pages)``, for fp8 pages too (torch's index ops take no fp8
        on CPU: their bytes are selected)."""
        if layer.element_size() != 1:
            return layer.index_select(0, pages)
        return layer.view(torch.uint8).index_select(0, pages).view(layer.dtype)

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots (K and V, every layer) of one block into another.

        Copy-on-write for a match that ends inside a cached block. (Global layers only in a
        hybrid model: its sliding layers' pages are copied by ``copy_local_slots``.)
        """
        assert 0 < num_tokens <= self.spec.block_size and src_block != dst_block
        for layer in self._global:
            layer[dst_block, :, :num_tokens].copy_(layer[src_block, :, :num_tokens])

    def copy_local_slots(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """``copy_slots`` for the sliding layers' local pages."""
        assert 0 < num_tokens <= self.spec.block_size and src_page != dst_page
        for layer in self._local:
            layer[dst_page, :, :num_tokens].copy_(layer[src_page, :, :num_tokens])

    # The KV tier's side (``kv_tier.PageIO``): whole pages as bytes. A hybrid model has two
    # groups of pages, each its own PageIO: ``global_io`` (by block) and ``local_io``.

    @property
    def bytes_per_block(self) -> int:
        return self.global_io.bytes_per_block

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return self.global_io.read_pages(pages)

    def write_pages(self, pages: list[int], data: np.ndarray | Sequence[np.ndarray]) -> None:
        self.global_io.write_pages(pages, data)


class PageBytes:
    """One layer group's pages as bytes (``kv_tier.PageIO``): a page is the same index in
    every layer of the group, its bytes the layers' in order. A group of no layer (a model
    whose every layer slides has no global KV) reads and writes zero bytes a page."""

    __slots__ = ("_host", "bytes_per_block", "layers")

    def __init__(self, layers: list[torch.Tensor]) -> None:
        self.layers = layers
        self.bytes_per_block = sum(layer[0].numel() * layer.element_size() for layer in layers)
        # On the CPU, each layer's pages as bytes (views of the same memory): the tier's copies
        self._host: list[np.ndarray] | None = None
        if layers and layers[0].device.type == "cpu":
            self._host = [
                layer.view(torch.uint8).numpy().reshape(layer.shape[0], -1) for layer in layers
            ]

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A host copy of the pages' KV: uint8 ``[len(pages), bytes_per_block]``."""
        if not self.layers:
            return np.empty((len(pages), 0), dtype=np.uint8)
        if self._host is not None:  # one copy, on this thread (no torch intra-op workers)
            out = np.empty((len(pages), self.bytes_per_block), dtype=np.uint8)
            width = self.bytes_per_block // len(self._host)
            for i, layer in enumerate(self._host):
                out[:, i * width : (i + 1) * width] = layer[pages]
            return out
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        raw = [layer.view(torch.uint8) for layer in self.layers]  # bytes: fp8 pages too
        return torch.cat([r.index_select(0, index).flatten(1) for r in raw], 1).cpu().numpy()

    def write_pages(self, pages: list[int], data: np.ndarray | Sequence[np.ndarray]) -> None:
        """Fill pages from ``read_pages``' bytes: a uint8 ``[len(pages), bytes_per_block]``
        array, or one such row per page (views into a tier's slots: no gather copy).

        On the CPU each row goes straight into its page, layer by layer, on this thread: a
        plain memory copy. torch's ``index_copy_`` over the same bytes ran at 0.3-0.9 GB/s
        on a shared 2-vCPU box (its intra-op workers wait on each other)."""
        if not self.layers:
            return
        if self._host is not None:
            width = self.bytes_per_block // len(self._host)
            for page, row in zip(pages, data, strict=True):
                for i, layer in enumerate(self._host):
                    layer[page] = row[i * width : (i + 1) * width]
            return
        rows = torch.from_numpy(np.ascontiguousarray(data))
        rows = rows.to(self.layers[0].device, non_blocking=True)
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        per_layer = rows.shape[1] // len(self.layers)
        for i, layer in enumerate(self.layers):  # as bytes: fp8 pages too
            part = rows[:, i * per_layer : (i + 1) * per_layer]
            layer.view(torch.uint8).view(layer.shape[0], -1).index_copy_(0, index, part)
