"""Modules whose weight stays GGUF-quantized (``kernels/cpu_qgemm``), in place of
``nn.Linear`` and ``nn.Embedding``: the loader swaps them in, ``prepare()`` fuses them.

They hold no weight parameter (the state dict keeps biases only): a quantized model is served,
not trained or saved. ``QEmbedding`` gives exactly the rows (bf16 or fp32) a dequantizing loader gives; ``QLinear``
computes ``x @ W.T`` in ``x``'s dtype from the integers and scales (close to, not bit-equal
with, the product of the dequantized weight).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu_qgemm import QuantizedLinear, QuantizedWeight


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
