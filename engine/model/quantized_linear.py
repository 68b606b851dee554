"""Modules whose weight is read from a packed form, in place of ``nn.Linear`` and
``nn.Embedding``.

GGUF-quantized ones (``kernels/cpu_qgemm``): the loader swaps them in, ``prepare()`` fuses
them. They hold no weight parameter (the state dict keeps biases only): a quantized model is
served, not trained or saved. ``QEmbedding`` gives exactly the rows (bf16 or fp32) a
dequantizing loader gives; ``QLinear`` computes ``x @ W.T`` in ``x``'s dtype from the integers
and scales (close to, not bit-equal with, the product of the dequantized weight).

``HeadEmbedding``: a tied embedding whose rows come from the LM head's batch-invariant packing
(``embed_from_head``, at ``prepare()``), so the table is not held twice.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..kernels.cpu_gemm import PackedLinear
from ..kernels.cpu_qgemm import QuantizedLinear, QuantizedWeight
from ..kernels.linear import Gemm


class QLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.k, weight.n
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernel = QuantizedLinear(weight, bias)
        self.qweight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)


class QEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self.kernel = QuantizedLinear(weight)
        self.qweight = weight
        self.dtype = dtype  # the rows' dtype: the model's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.gather(ids, self.dtype)


def fused_kernel(linears: tuple[nn.Module, ...]) -> QuantizedLinear | None:
    """One kernel for ``QLinear``s applied side by side (fused QKV, gate/up), or None where
    their weights cannot share one packing (``QuantizedWeight.concat``)."""
    if not all(isinstance(lin, QLinear) for lin in linears):
        return None
    weight = QuantizedWeight.concat([lin.qweight for lin in linears])  # type: ignore[union-attr]
    if weight is None:
        return None
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return QuantizedLinear(weight)
    if any(b is None for b in biases):
        return None
    return QuantizedLinear(weight, torch.cat(biases))  # type: ignore[arg-type]


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the model's quantized weights (a tied head counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QLinear | QEmbedding):
            seen[id(module.qweight)] = module.qweight.nbytes
    return sum(seen.values())


class HeadEmbedding(nn.Module):
    """The rows of a tied embedding table read from the LM head's packed copy of it
    (``PackedLinear.weight_rows``: the table's values, bit for bit). ``weight`` keeps the
    table's name, shape and dtype on the meta device."""

    def __init__(self, head: PackedLinear, weight: nn.Parameter) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.weight_rows(ids)


class TiedModel(Protocol):
    """What ``embed_from_head`` reads of a causal LM (``LlamaForCausalLM`` and its kin)."""

    head: object
    lm_head: nn.Linear
    model: nn.Module


def embed_from_head(model: TiedModel) -> bool:
    """Where the LM head shares the embedding's table and its batch-invariant kernel packed
    a copy that gives the rows back, the embedding reads that copy and the table is let go
    (the embedding, ``lm_head`` and the head's ``Gemm`` hold a meta tensor of its name, shape
    and dtype): a tied model held it twice (Gemma 3: 320 MiB of its 1.2 GB). Whether it did."""
    head, embedding = model.head, model.model.embed_tokens
    if not (isinstance(head, Gemm) and isinstance(embedding, nn.Embedding)):
        return False
    packed = head.invariant
    tied = model.lm_head.weight is embedding.weight and head.weight is embedding.weight
    if not (tied and isinstance(packed, PackedLinear) and packed.gives_rows):
        return False
    meta = nn.Parameter(embedding.weight.to("meta"), requires_grad=False)
    model.model.embed_tokens = HeadEmbedding(packed, meta)
    model.lm_head.weight = meta
    head.weight = meta
    return True
