"""FlashInfer backend (CUDA): paged prefill, decode and two-level cascade wrappers.

Written to the flashinfer-python 0.7 API (docs/models.md). The runner orders a step as
prefills | plain decodes | cascade groups, so each wrapper gets one contiguous slice of q:

- prefills  -> BatchPrefillWithPagedKVCacheWrapper (causal, bottom-right aligned)
- decodes   -> BatchDecodeWithPagedKVCacheWrapper
- groups    -> MultiLevelCascadeAttentionWrapper(2): level 0 = each group's shared blocks
               (non-causal), level 1 = each member's own pages after the shared ones.

``plan`` runs once per step (``flashinfer_plan.build_tables``: host arrays from the step's
sequences, page ids gathered on the device, no device tensor read back) and every layer's
``forward`` reuses it. RoPE is applied by the model before K is written (pos_encoding_mode
NONE), and q/kv dtypes are passed explicitly (FlashInfer defaults to float16 otherwise); fp8
pages (``--kv-cache-dtype fp8``) are FlashInfer's fp8 KV with the default scales of 1.

Batch invariance (docs/architecture.md, "Fidelity"): by default the prefill and decode plans
get one fixed split size (``fixed_split_size``, in pages), so a row's split-KV reduction does
not depend on who shares the step, and cascade groups are decoded by the decode wrapper like
lone decodes (the cascade wrapper's plan takes no split size, and its level boundary is not
one a lone decode uses). With ``batch_invariant=False`` FlashInfer picks its splits and
cascade groups take the cascade wrapper.

Sliding window: a windowed step (``meta.window = w > 0``: the query at p sees keys p - w < k
<= p) plans and runs the prefill and decode wrappers with ``window_left = w - 1`` (FlashInfer's
left window is inclusive: it keeps keys k >= p - window_left, so w - 1 gives w keys, itself
included). Such a metadata comes without groups; pages wholly before every query's window may
be the null page, which the window masks. The constructor's ``window_left`` applies to
unwindowed steps (a fixed window for every layer); with it, cascade groups are decoded
plainly too: a window is not the same mask on a level's own page list.

Tests inject a CPU stand-in for the module (``module=``, tests/flashinfer_standin.py): it
computes what the wrappers are documented to compute, so the engine runs through this code
on CPU; it is not FlashInfer's kernels.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from .backend import AttentionBackend, AttentionShape
from .flashinfer_plan import PageTable, PlanBuffers, StepTables, build_tables
from .kv_dtype import to_kv
from .metadata import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
FIXED_SPLIT_PAGES = 64  # 1024 tokens at block size 16: one split size for prefill and decode
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_PAGES = 16384


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_window = True

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        batch_invariant: bool = True,
        window_left: int = -1,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_pages: int = DEFAULT_MAX_NUM_PAGES,
        fixed_split_pages: int = FIXED_SPLIT_PAGES,
        workspace_bytes: int = WORKSPACE_BYTES,
        module: ModuleType | None = None,
    ) -> None:
        """``module`` replaces ``import flashinfer`` (the tests' CPU stand-in); without it the
        device must be CUDA."""
        device = torch.device(device)
        if module is None:
            if device.type != "cuda" or not torch.cuda.is_available():
                raise ValueError("the flashinfer backend needs a CUDA device")
            import flashinfer  # lazy: importing works on CPU, but nothing in it runs there

            module = flashinfer
        fi: Any = module
        self._fi = fi
        self.device = device
        self.batch_invariant = batch_invariant
        self.window_left = window_left
        self.fixed_split_pages = fixed_split_pages
        self._bufs = PlanBuffers(device, max_num_seqs, max_num_pages)
        ws = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        cascade_ws = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD")
        # The decode wrapper owns device index buffers sized by max_num_seqs/pages, so that
        # capturing decode in a CUDA graph later needs only use_cuda_graph=True.
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws,
            kv_layout="NHD",
            use_cuda_graph=False,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(max_num_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(
                max_num_seqs, dtype=torch.int32, device=device
            ),
        )
        self._cascade = fi.MultiLevelCascadeAttentionWrapper(2, cascade_ws, kv_layout="NHD")
        self._meta: AttentionMetadata | None = None
        self._tables: StepTables | None = None
        self._positions = torch.empty(0, dtype=torch.int32, device=device)
        self._window_left = window_left  # the planned step's

    @property
    def uses_cascade(self) -> bool:
        """Whether cascade groups take the cascade wrapper (else the decode wrapper)."""
        return not self.batch_invariant and self.window_left < 0

    def step_window_left(self, meta: AttentionMetadata) -> int:
        """FlashInfer's ``window_left`` for this step: ``meta.window - 1`` for a windowed
        metadata, else the constructor's (-1: none)."""
        return meta.window - 1 if meta.window > 0 else self.window_left

    def _split_kwargs(self) -> dict[str, Any]:
        if self.batch_invariant:
            return {"fixed_split_size": self.fixed_split_pages, "disable_split_kv": False}
        return {"fixed_split_size": None, "disable_split_kv": False}

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        window_left = self.step_window_left(meta)
        tables = build_tables(meta, self._bufs, self.uses_cascade and window_left < 0)
        bs = meta.block_size
        common: dict[str, Any] = {
            "num_qo_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "page_size": bs,
            "pos_encoding_mode": "NONE",
            "window_left": window_left,
            "sm_scale": shape.scale,
            "logits_soft_cap": shape.softcap or None,  # cap * tanh(x / cap), x scaled
            "q_data_type": shape.dtype,
            "kv_data_type": shape.page_dtype,  # fp8 pages: FlashInfer's fp8 KV, scale 1
        }
        if tables.prefill is not None:
            t = tables.prefill
            self._prefill.plan(
                t.qo_indptr,
                t.kv_indptr,
                t.kv_indices,
                t.last_page_len,
                head_dim_qk=shape.head_dim,
                causal=True,
                o_data_type=shape.dtype,
                non_blocking=True,
                **common,
                **self._split_kwargs(),
            )
        if tables.decode is not None:
            t = tables.decode
            self._decode.plan(
                t.kv_indptr,
                t.kv_indices,
                t.last_page_len,
                head_dim=shape.head_dim,
                o_data_type=shape.dtype,
                non_blocking=True,
                **common,
                **self._split_kwargs(),
            )
        if tables.cascade is not None:
            self._plan_cascade(tables.cascade, shape, common)
        # The write positions of the step's new K/V, in the dtype the kernel takes: once.
        n = meta.num_tokens
        if self._positions.numel() < n:
            self._positions = torch.empty(max(n, 2 * self._positions.numel()), **_i32(self))
        self._positions[:n].copy_(meta.positions)
        self._meta, self._tables, self._window_left = meta, tables, window_left

    def _plan_cascade(
        self, levels: tuple[PageTable, PageTable], shape: AttentionShape, common: dict[str, Any]
    ) -> None:
        self._cascade.plan(
            [t.qo_indptr for t in levels],
            [t.kv_indptr for t in levels],
            [t.kv_indices for t in levels],
            [t.last_page_len for t in levels],
            head_dim=shape.head_dim,
            causal=True,  # applied to the last level only; a decode sees its whole suffix
            **common,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        meta, tables = self._meta, self._tables
        if meta is None or tables is None:
            raise RuntimeError("FlashInferBackend.forward before plan()")
        self._fi.append_paged_kv_cache(
            to_kv(k, kv_layer.dtype),
            to_kv(v, kv_layer.dtype),
            meta.batch_indices,
            self._positions[: meta.num_tokens],
            kv_layer,
            meta.kv_indices,
            meta.kv_indptr,
            meta.kv_last_page_len,
            kv_layout="NHD",
        )
        p_end, d_end, total = tables.rows
        out = torch.empty_like(q)
        wl = self._window_left  # as planned (run's default would be the plan's too)
        if p_end:
            self._prefill.run(q[:p_end], kv_layer, out=out[:p_end], window_left=wl)
        if d_end > p_end:
            self._decode.run(q[p_end:d_end], kv_layer, out=out[p_end:d_end], window_left=wl)
        if total > d_end:
            out[d_end:total] = self._cascade.run(q[d_end:total], kv_layer)
        return out


def _i32(backend: FlashInferBackend) -> dict[str, Any]:
    return {"dtype": torch.int32, "device": backend.device}
