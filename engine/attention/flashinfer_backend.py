"""FlashInfer backend (CUDA only): paged prefill, decode and two-level cascade wrappers.

Written to the flashinfer-python 0.7 API (see docs/models.md). The runner orders a step as
prefills | plain decodes | cascade groups, so each wrapper gets one contiguous slice of q:

- prefills  -> BatchPrefillWithPagedKVCacheWrapper (causal, bottom-right aligned)
- decodes   -> BatchDecodeWithPagedKVCacheWrapper
- groups    -> MultiLevelCascadeAttentionWrapper(2): level 0 = each group's shared blocks
               (non-causal), level 1 = each member's own pages after the shared ones.

RoPE is applied by the model before K is written (pos_encoding_mode NONE), and q/kv dtypes are
passed explicitly (FlashInfer defaults to float16 otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from .backend import AttentionBackend, AttentionShape
from .metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError("the flashinfer backend needs a CUDA device")
        import flashinfer  # lazy: importing works on CPU, but nothing in it runs there

        self._fi: Any = flashinfer
        self.device = device
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        cascade_ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, kv_layout="NHD", use_tensor_cores=True
        )
        self._cascade = flashinfer.MultiLevelCascadeAttentionWrapper(2, cascade_ws, kv_layout="NHD")
        self._meta: AttentionMetadata | None = None
        self._rows: tuple[int, int, int] = (0, 0, 0)  # prefill end, decode end, total rows

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        dev = self.device
        bs = meta.block_size
        qo = meta.qo_indptr.tolist()
        kv_indptr = meta.kv_indptr.tolist()
        indices = meta.kv_indices.tolist()
        last = meta.kv_last_page_len.tolist()
        common = dict(
            num_qo_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            page_size=bs,
            q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )

        def sub(lo: int, hi: int) -> tuple[list[int], list[int], list[int], list[int]]:
            """CSR page table of sequences [lo, hi), re-based to start at 0."""
            q = [x - qo[lo] for x in qo[lo : hi + 1]]
            kp = [x - kv_indptr[lo] for x in kv_indptr[lo : hi + 1]]
            return q, kp, indices[kv_indptr[lo] : kv_indptr[hi]], last[lo:hi]

        p_end, d_end = meta.num_prefills, meta.cascade_begin
        if p_end:
            q, kp, ki, kl = sub(0, p_end)
            self._prefill.plan(
                _i32(q, dev),
                _i32(kp, dev),
                _i32(ki, dev),
                _i32(kl, dev),
                head_dim_qk=shape.head_dim,
                causal=True,
                pos_encoding_mode="NONE",
                **common,
            )
        if d_end > p_end:
            _, kp, ki, kl = sub(p_end, d_end)
            self._decode.plan(
                _i32(kp, dev),
                _i32(ki, dev),
                _i32(kl, dev),
                head_dim=shape.head_dim,
                pos_encoding_mode="NONE",
                **common,
            )
        if meta.cascade_groups:
            self._plan_cascade(meta, shape, common)
        self._meta = meta
        self._rows = (qo[p_end], qo[d_end], qo[-1])

    def _plan_cascade(
        self, meta: AttentionMetadata, shape: AttentionShape, common: dict[str, Any]
    ) -> None:
        dev, bs = self.device, meta.block_size
        base = meta.cascade_begin
        top_qo, top_kv, top_idx, top_last = [0], [0], [], []
        low_kv, low_idx, low_last = [0], [], []
        for g in meta.cascade_groups:
            shared = list(meta.seqs[g.begin].block_table[: g.num_shared_blocks])
            top_idx.extend(shared)
            top_kv.append(len(top_idx))
            top_last.append(bs)  # the shared part is whole blocks
            top_qo.append(g.end - base)
            for s in meta.seqs[g.begin : g.end]:
                num_pages = -(-s.kv_len // bs)
                low_idx.extend(s.block_table[g.num_shared_blocks : num_pages])
                low_kv.append(len(low_idx))
                low_last.append(s.kv_len - (num_pages - 1) * bs)
        n = meta.num_seqs - base
        self._cascade.plan(
            [_i32(top_qo, dev), _i32(list(range(n + 1)), dev)],
            [_i32(top_kv, dev), _i32(low_kv, dev)],
            [_i32(top_idx, dev), _i32(low_idx, dev)],
            [_i32(top_last, dev), _i32(low_last, dev)],
            head_dim=shape.head_dim,
            causal=True,  # applied to the last level only; a decode sees its whole suffix
            pos_encoding_mode="NONE",
            **common,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() first"
        self._fi.append_paged_kv_cache(
            k.to(kv_layer.dtype),
            v.to(kv_layer.dtype),
            meta.batch_indices,
            meta.positions.to(torch.int32),
            kv_layer,
            meta.kv_indices,
            meta.kv_indptr,
            meta.kv_last_page_len,
            kv_layout="NHD",
        )
        p_end, d_end, total = self._rows
        out = torch.empty_like(q)
        if p_end:
            out[:p_end] = self._prefill.run(q[:p_end], kv_layer)
        if d_end > p_end:
            out[p_end:d_end] = self._decode.run(q[p_end:d_end], kv_layer)
        if total > d_end:
            out[d_end:total] = self._cascade.run(q[d_end:total], kv_layer)
        return out
