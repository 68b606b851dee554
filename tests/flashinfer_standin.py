"""A CPU stand-in for the part of flashinfer-python the engine calls. Tests only.

It computes what FlashInfer's wrappers are *documented* to compute (FlashInfer's docstrings
and tutorials: the paged KV layout, the wrappers, cascade, the attention math; summarised in
docs/models.md, "Attention backends"), in plain torch, one request at a time. It is not FlashInfer's kernels: it checks our page tables,
cascade levels and call order against the documented contract, nothing about speed or the
kernels' own numerics.

- NHD paged layout ``[pages, 2, page_size, Hk, D]``; ``kv_len = (pages - 1) * page_size + last``.
- Causal masks are bottom-right aligned: row i of Lq sees key j iff ``j <= i + Lk - Lq``;
  ``window_left = W >= 0`` (inclusive: W + 1 keys) also needs ``j >= i + Lk - Lq - W``, and
  the keys before the first row's window are not read at all (a sliding layer's null page
  may hold them; the split chunks stay aligned to absolute positions).
- ``logits_soft_cap = c > 0`` caps each scaled logit x as ``c * tanh(x / c)``.
- LSEs are base 2; a row that sees no key gives o = 0, lse = -inf; merges as in cascade.cuh.
- Split-KV: keys are reduced in chunks of ``fixed_split_size`` pages merged in order; with no
  fixed size the chunk comes from the batch size (as FlashInfer's heuristic does), so outputs
  then depend on batch composition, as they would on a GPU.
- The index arrays must be int32 (the docs: int64 "can cause indexing errors"), page-table
  rules are checked (``1 <= last <= page_size``, sizes), and the appended rows must already be
  inside the page table.

``calls`` records every call (name, args, kwargs) for the signature-binding test.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__version__ = "0.0-standin"
calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
HEURISTIC_CTAS = 64  # stand-in for the SM count FlashInfer's split heuristic fills
F = TypeVar("F", bound=Callable[..., Any])

# The keyword options each call accepts, with the documented defaults (0.7.4 signatures;
# only those the engine may pass: any other name is an error here, as a typo would be).
_PAGED = {"pos_encoding_mode": "NONE", "sm_scale": None, "window_left": -1,
          "logits_soft_cap": None, "q_data_type": "float16", "kv_data_type": None}  # fmt: skip
PREFILL_PLAN = {**_PAGED, "causal": False, "o_data_type": None, "non_blocking": True,
                "fixed_split_size": None, "disable_split_kv": False}  # fmt: skip
DECODE_PLAN = {**_PAGED, "o_data_type": None, "non_blocking": True,
               "fixed_split_size": None, "disable_split_kv": False}  # fmt: skip
CASCADE_PLAN = {**_PAGED, "causal": False}
RUN = {"out": None, "return_lse": False, "window_left": None}


def _recorded(name: str, method: bool = True) -> Callable[[F], F]:
    """Record each call's arguments as given (without ``self``) in ``calls``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, tuple(args[1:] if method else args), dict(kwargs)))
            return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def _options(given: dict[str, Any], allowed: dict[str, Any], call: str) -> dict[str, Any]:
    unknown = set(given) - set(allowed)
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword arguments {sorted(unknown)}")
    return {**allowed, **given}


def _host(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    return [int(x) for x in t.tolist()]


def _dtype(x: Any) -> torch.dtype:
    return getattr(torch, x) if isinstance(x, str) else x


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor
) -> None:
    """``cascade.cuh``'s merge, base 2; two empty states merge to zeros."""
    m = torch.maximum(s, s_other)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a, b = torch.exp2(s - m), torch.exp2(s_other - m)
    total = a + b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    v.copy_(((v.float() * a[..., None] + v_other.float() * b[..., None]) / safe[..., None]).to(v))
    s.copy_(m + torch.log2(total))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    first: int,
    kv_len: int,
    soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``o [Lq, Hq, D]`` and base-2 lse ``[Lq, Hq]`` of q over keys ``[first, first +
    len(k))`` of a request with ``kv_len`` keys, masks aligned bottom-right."""
    lq, hq, d = q.shape
    if k.shape[0] == 0:
        return torch.zeros(lq, hq, d), torch.full((lq, hq), -math.inf)
    g = hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if soft_cap > 0:  # logits_soft_cap: cap * tanh(x / cap) of the scaled logits x
        s = soft_cap * torch.tanh(s / soft_cap)
    rows = torch.arange(lq)[:, None] + (kv_len - lq)  # each query's absolute position
    cols = torch.arange(first, first + k.shape[0])[None, :]
    keep = torch.ones(lq, k.shape[0], dtype=torch.bool)
    if causal:
        keep &= cols <= rows
    if window >= 0:
        keep &= cols >= rows - window
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vf), lse.transpose(0, 1) / math.log(2.0)


class _PagedAttention:
    """What the prefill and decode wrappers share: a planned CSR page table and its math."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        if kv_layout != "NHD":
            raise ValueError("the stand-in implements the NHD layout only")
        self._plan: dict[str, Any] | None = None

    def _set_plan(
        self,
        qo: list[int],
        kv_t: torch.Tensor,
        idx_t: torch.Tensor,
        last_t: torch.Tensor,
        heads: tuple[int, int, int, int],
        opts: dict[str, Any],
    ) -> None:
        kv, idx = _host(kv_t, "kv_indptr"), _host(idx_t, "kv_indices")
        last = _host(last_t, "kv_last_page_len")
        hq, hk, _, ps = heads
        n = len(kv) - 1
        if kv[0] != 0 or qo[0] != 0 or len(qo) != n + 1 or len(last) != n:
            raise ValueError("indptr arrays must start at 0 and have batch_size + 1 entries")
        if len(idx) < kv[-1]:
            raise ValueError(f"kv_indices has {len(idx)} ids, indptr says {kv[-1]}")
        if any(not 1 <= x <= ps for x in last):
            raise ValueError(f"kv_last_page_len must be in [1, {ps}]: {last}")
        if hq % hk:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if opts["pos_encoding_mode"] != "NONE":
            raise ValueError("the engine applies RoPE itself: pos_encoding_mode must be NONE")
        max_pages = max((kv[b + 1] - kv[b] for b in range(n)), default=1)
        fixed = opts.get("fixed_split_size")
        if opts.get("disable_split_kv"):
            split = max(1, max_pages)
        elif fixed is not None and fixed > 0:
            split = fixed
        else:  # fill HEURISTIC_CTAS "CTAs" with this batch: depends on who is in it
            split = max(1, -(-max_pages * n // HEURISTIC_CTAS))
        self._plan = dict(opts, qo=qo, kv=kv, idx=idx, last=last, heads=heads, split=split)

    @property
    def plan_info(self) -> dict[str, Any]:
        if self._plan is None:
            raise RuntimeError("run() before plan()")
        return self._plan

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, opts: dict[str, Any]) -> Any:
        p = self.plan_info
        hq, hk, d, ps = p["heads"]
        qo, kv, idx, last = p["qo"], p["kv"], p["idx"], p["last"]
        if tuple(q.shape) != (qo[-1], hq, d) or q.dtype != _dtype(p["q_data_type"]):
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match the plan")
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != (2, ps, hk, d):
            raise ValueError(
                f"paged_kv_cache {tuple(kv_cache.shape)}: not NHD [P, 2, {ps}, {hk}, {d}]"
            )
        if kv_cache.dtype != _dtype(p["kv_data_type"] or p["q_data_type"]):
            raise ValueError(f"paged_kv_cache is {kv_cache.dtype}, not the planned kv dtype")
        window = p["window_left"] if opts["window_left"] is None else opts["window_left"]
        scale = p["sm_scale"] if p["sm_scale"] is not None else 1 / math.sqrt(d)
        o_all = torch.zeros(q.shape)
        lse_all = torch.full(q.shape[:2], -math.inf)
        chunk = p["split"] * ps
        for b in range(len(qo) - 1):
            pages = torch.tensor(idx[kv[b] : kv[b + 1]], dtype=torch.int64)
            kv_len = (len(pages) - 1) * ps + last[b] if len(pages) else 0
            qb = q[qo[b] : qo[b + 1]]
            first = max(0, kv_len - len(qb) - window) if window >= 0 else 0
            base = first // ps * ps  # keys from the page holding the first one seen
            # fp8 pages (FlashInfer's fp8 KV, scale 1): indexed as bytes, read through exactly
            raw = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
            k = raw[pages[base // ps :], 0].view(kv_cache.dtype).reshape(-1, hk, d)
            v = raw[pages[base // ps :], 1].view(kv_cache.dtype).reshape(-1, hk, d)
            k, v = k[: kv_len - base].to(q.dtype), v[: kv_len - base].to(q.dtype)
            o, lse = _attend(qb, k[:0], v[:0], scale, False, -1, 0, kv_len)
            for a in range(0, kv_len, chunk):  # split-KV: partial states merged in order
                lo, hi = max(a, first) - base, min(a + chunk, kv_len) - base
                if lo >= hi:
                    continue
                part = _attend(
                    qb, k[lo:hi], v[lo:hi], scale, p["causal"], window, lo + base, kv_len,
                    p["logits_soft_cap"] or 0.0,
                )  # fmt: skip
                merge_state_in_place(o, lse, *part)
            o_all[qo[b] : qo[b + 1]], lse_all[qo[b] : qo[b + 1]] = o, lse
        o_dtype = _dtype(p.get("o_data_type") or p["q_data_type"])
        result = o_all.to(o_dtype)
        out = opts["out"]
        if out is not None:
            if out.shape != q.shape or out.dtype != o_dtype:
                raise ValueError("out has the wrong shape or dtype")
            out.copy_(result)
            result = out
        return (result, lse_all) if opts["return_lse"] else result


class BatchPrefillWithPagedKVCacheWrapper(_PagedAttention):
    @_recorded("BatchPrefillWithPagedKVCacheWrapper")
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        super().__init__(float_workspace_buffer, kv_layout)

    @_recorded("BatchPrefillWithPagedKVCacheWrapper.plan")
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        **options: Any,
    ) -> None:
        opts = _options(options, PREFILL_PLAN, "plan")
        heads = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        qo = _host(qo_indptr, "qo_indptr")
        self._set_plan(qo, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, heads, opts)

    @_recorded("BatchPrefillWithPagedKVCacheWrapper.run")
    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, **options: Any) -> Any:
        return self._run(q, paged_kv_cache, _options(options, RUN, "run"))


class BatchDecodeWithPagedKVCacheWrapper(_PagedAttention):
    @_recorded("BatchDecodeWithPagedKVCacheWrapper")
    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **options: Any
    ) -> None:
        allowed = {"use_cuda_graph": False, "use_tensor_cores": False}
        allowed |= dict.fromkeys(
            ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer")
        )
        opts = _options(options, allowed, "__init__")
        for name in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer"):
            if opts[name] is not None and opts[name].dtype != torch.int32:
                raise TypeError(f"{name} must be int32")
        super().__init__(float_workspace_buffer, kv_layout)

    @_recorded("BatchDecodeWithPagedKVCacheWrapper.plan")
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        opts = _options(options, DECODE_PLAN, "plan") | {"causal": False}
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        qo = list(range(indptr.numel()))
        self._set_plan(qo, indptr, indices, last_page_len, heads, opts)

    @_recorded("BatchDecodeWithPagedKVCacheWrapper.run")
    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, **options: Any) -> Any:
        return self._run(q, paged_kv_cache, _options(options, RUN, "run"))


class MultiLevelCascadeAttentionWrapper:
    """One prefill wrapper per level, ``causal`` on the last level only; ``run`` = the last
    level with its lse, then each upper level merged in place (cascade.py)."""

    @_recorded("MultiLevelCascadeAttentionWrapper")
    def __init__(
        self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"
    ) -> None:
        self._levels = [
            _PagedAttention(float_workspace_buffer, kv_layout) for _ in range(num_levels)
        ]

    @_recorded("MultiLevelCascadeAttentionWrapper.plan")
    def plan(
        self,
        qo_indptr_arr: list[torch.Tensor],
        paged_kv_indptr_arr: list[torch.Tensor],
        paged_kv_indices_arr: list[torch.Tensor],
        paged_kv_last_page_len: list[torch.Tensor],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        opts = _options(options, CASCADE_PLAN, "plan")
        arrs = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        if any(len(a) != len(self._levels) for a in arrs):
            raise ValueError("one entry per level in every *_arr")
        qos = [_host(qo, "qo_indptr") for qo in qo_indptr_arr]
        if len({qo[-1] for qo in qos}) != 1:
            raise ValueError("every level must partition the same queries")
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        for i, level in enumerate(self._levels):
            causal = opts["causal"] and i == len(self._levels) - 1
            level_opts = opts | {"causal": causal, "o_data_type": None}
            level._set_plan(qos[i], *(a[i] for a in arrs[1:]), heads, level_opts)

    @_recorded("MultiLevelCascadeAttentionWrapper.run")
    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        opts = RUN | {"return_lse": True}
        out, lse = self._levels[-1]._run(q, paged_kv_cache, opts)
        for level in self._levels[:-1]:
            merge_state_in_place(out, lse, *level._run(q, paged_kv_cache, opts))
        return out


@_recorded("append_paged_kv_cache", method=False)
def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Row i goes to page ``kv_indices[kv_indptr[b] + pos // ps]``, slot ``pos % ps``; the
    page table must already cover it."""
    if kv_layout != "NHD":
        raise ValueError("the stand-in implements the NHD layout only")
    b_idx, pos = _host(batch_indices, "batch_indices"), _host(positions, "positions")
    idx, kv = _host(kv_indices, "kv_indices"), _host(kv_indptr, "kv_indptr")
    last = _host(kv_last_page_len, "kv_last_page_len")
    ps = paged_kv_cache.shape[2]
    if append_key.dtype != paged_kv_cache.dtype or append_value.dtype != paged_kv_cache.dtype:
        raise TypeError("append_key/value must have the cache's dtype")
    if not append_key.shape[0] == len(b_idx) == len(pos):
        raise ValueError("one batch index and one position per appended row")
    for i, (b, p) in enumerate(zip(b_idx, pos, strict=True)):
        n = kv[b + 1] - kv[b]
        kv_len = (n - 1) * ps + last[b] if n else 0
        if not 0 <= p < kv_len:
            raise ValueError(f"row {i}: position {p} outside request {b}'s {kv_len} tokens")
        page = idx[kv[b] + p // ps]
        paged_kv_cache[page, 0, p % ps] = append_key[i]
        paged_kv_cache[page, 1, p % ps] = append_value[i]
