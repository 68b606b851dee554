"""Attention math in torch, over contiguous operands: dense (causal or not), grouped, padded
decode, and the log-sum-exp merge of two partial states. The reference backend
(``torch_backend``) gathers pages into these; on CPU they call torch's flash attention (for
its LSE). torch only: the engine's kernels are the other backends'.

Same math as FlashInfer: bottom-right causal alignment, base-2 LSE.
"""

from __future__ import annotations

import math

import torch

from ..kernels import torch_private

LOG2E = 1.0 / math.log(2.0)
_QUERY_CHUNK = 1024  # query rows per product in the generic (non-CPU) path


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets (LSEs in base 2).

    ``o_*`` ``[N, H, D]``, ``lse_*`` float32 ``[N, H]``. Two empty states (-inf) merge to 0.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a = torch.exp2(lse_a - m)
    w_b = torch.exp2(lse_b - m)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / denom[..., None]
    return o.to(o_a.dtype), m + torch.log2(total)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[Lq, Hq, D]`` over contiguous ``k``/``v`` ``[Lk, Hk, D]``.

    ``causal`` requires ``Lq == Lk`` (the square of new tokens). ``softcap`` > 0 caps each
    score s as ``softcap * tanh(s / softcap)`` (Gemma 2; torch's flash kernel has no such
    step, so the generic path runs). Returns the output ``[Lq, Hq, D]`` (q's dtype) and the
    base-2 LSE ``[Lq, Hq]`` (float32).
    """
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    if lk == 0:
        return q.new_zeros(q.shape), q.new_full((lq, hq), -math.inf, dtype=torch.float32)
    if q.device.type == "cpu" and not softcap:
        if causal:
            assert lq == lk
            if g > 1:
                k = k.repeat_interleave(g, dim=1)
                v = v.repeat_interleave(g, dim=1)
            qh, kh, vh = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
            o, lse = torch_private.flash_attention_cpu(qh, kh, vh, True, scale)
            return o[0].permute(1, 0, 2), lse[0].transpose(0, 1) * LOG2E
        # Non-causal: fold the g query heads of a kv head into the row axis, so K/V are not
        # expanded and are read once per kv head.
        qh = q.view(lq, hk, g, d).permute(1, 2, 0, 3).reshape(1, hk, g * lq, d)
        kh, vh = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
        o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale)
        o = o.view(hk, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)
        lse = lse.view(hk, g, lq).permute(2, 0, 1).reshape(lq, hq) * LOG2E
        return o, lse
    return _dense_attention_generic(q, k, v, scale, causal, softcap)


def grouped_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_groups: int,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_groups`` equal groups of queries, each over its own keys, no mask.

    ``q`` ``[G * n, Hq, D]`` (group-major), ``k``/``v`` ``[G * L, Hk, D]``. Returns the output
    ``[G * n, Hq, D]`` and base-2 LSE ``[G * n, Hq]`` (float32), as ``dense_attention`` would
    per group."""
    if num_groups == 1 or q.device.type != "cpu" or softcap:
        states = [
            dense_attention(qg, kg, vg, scale, causal=False, softcap=softcap)
            for qg, kg, vg in zip(
                q.chunk(num_groups), k.chunk(num_groups), v.chunk(num_groups), strict=True
            )
        ]
        return torch.cat([o for o, _ in states]), torch.cat([lse for _, lse in states])
    rows, hq, d = q.shape
    hk = k.shape[1]
    g, n, length = hq // hk, rows // num_groups, k.shape[0] // num_groups
    # Fold each kv head's g query heads and the group's n queries into rows: K/V read once.
    qh = q.view(num_groups, n, hk, g, d).permute(0, 2, 3, 1, 4).reshape(num_groups, hk, g * n, d)
    kh = k.view(num_groups, length, hk, d).permute(0, 2, 1, 3)
    vh = v.view(num_groups, length, hk, d).permute(0, 2, 1, 3)
    o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale)
    o = o.view(num_groups, hk, g, n, d).permute(0, 3, 1, 2, 4).reshape(rows, hq, d)
    lse = lse.view(num_groups, hk, g, n).permute(0, 3, 1, 2).reshape(rows, hq) * LOG2E
    return o, lse


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_first: int,
    k_first: int,
    window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Sliding-window causal attention over contiguous operands: query row i, at position
    ``q_first + i``, sees key j, at position ``k_first + j``, iff ``q_pos - window < k_pos <=
    q_pos``. Every row must see at least one key. ``q`` ``[Lq, Hq, D]``, ``k``/``v``
    ``[Lk, Hk, D]``; returns ``[Lq, Hq, D]`` in q's dtype."""
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    q_pos = torch.arange(q_first, q_first + lq, device=q.device)[:, None]
    k_pos = torch.arange(k_first, k_first + lk, device=q.device)[None, :]
    drop = (k_pos > q_pos) | (k_pos <= q_pos - window)  # [Lq, Lk]
    if q.device.type == "cpu" and not softcap:
        # The g query heads of a kv head folded into the row axis (head-major), as above.
        mask = torch.zeros(g * lq, lk, dtype=q.dtype).masked_fill_(drop.repeat(g, 1), -math.inf)
        qh = q.view(lq, hk, g, d).permute(1, 2, 0, 3).reshape(1, hk, g * lq, d)
        kh, vh = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
        o, _ = torch_private.flash_attention_cpu(
            qh, kh, vh, False, scale, attn_mask=mask[None, None]
        )
        return o.view(hk, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)
    s = cap(
        torch.einsum("qhgd,khd->hgqk", q.float().view(lq, hk, g, d), k.float()) * scale, softcap
    )
    p = s.masked_fill(drop, -math.inf).softmax(-1)
    o = torch.einsum("hgqk,khd->qhgd", p, v.float())
    return o.reshape(lq, hq, d).to(q.dtype)


def cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores capped as ``softcap * tanh(s / softcap)`` (none at 0)."""
    return softcap * torch.tanh(s / softcap) if softcap else s


def _dense_attention_generic(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    kf = k.float().permute(1, 2, 0)  # [Hk, D, Lk]
    vf = v.float().permute(1, 0, 2)  # [Hk, Lk, D]
    out = torch.empty(lq, hq, d, dtype=q.dtype, device=q.device)
    lse_out = torch.empty(lq, hq, dtype=torch.float32, device=q.device)
    for a in range(0, lq, _QUERY_CHUNK):
        b = min(lq, a + _QUERY_CHUNK)
        qc = q[a:b].float().view(b - a, hk, g, d).permute(1, 2, 0, 3)  # [Hk, g, n, D]
        s = torch.matmul(qc.reshape(hk, g * (b - a), d), kf).view(hk, g, b - a, lk) * scale
        s = cap(s, softcap)
        if causal:
            rows = torch.arange(a, b, device=q.device)[:, None]
            cols = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(cols > rows + (lk - lq), -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # [Hk, g, n]
        p = torch.exp(s - lse[..., None])
        o = torch.matmul(p.view(hk, g * (b - a), lk), vf).view(hk, g, b - a, d)
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, hq, d).to(q.dtype)
        lse_out[a:b] = lse.permute(2, 0, 1).reshape(b - a, hq) * LOG2E
    return out, lse_out


def padded_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    starts: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its own keys, batched with padding.

    ``q`` ``[B, Hq, D]``; ``k``/``v`` ``[B, L, Hk, D]`` (rows past ``lens[b]`` are padding, and
    so are rows before ``starts[b]``: a sliding window's first block). Returns ``o``
    ``[B, Hq, D]`` and the base-2 LSE ``[B, Hq]`` (float32).
    """
    b, hq, d = q.shape
    length, hk = k.shape[1], k.shape[2]
    g = hq // hk
    cols = torch.arange(length, device=q.device)[None, :]
    pad = cols >= lens[:, None]  # [B, L]
    if starts is not None:
        pad |= cols < starts[:, None]
    qh = q.view(b, hk, g, d)
    kh, vh = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [B, Hk, L, D] views
    if q.device.type == "cpu" and not softcap:
        mask = torch.zeros(b, 1, 1, length, dtype=q.dtype).masked_fill_(
            pad[:, None, None, :], -math.inf
        )
        o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale, attn_mask=mask)
        return o.reshape(b, hq, d), lse.reshape(b, hq) * LOG2E
    return _padded_decode_generic(qh, kh, vh, pad, scale, softcap)


def _padded_decode_generic(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    pad: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hk, g, d = qh.shape
    hq = hk * g
    s = cap(
        torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale, softcap
    )  # [B, Hk, g, L]
    s.masked_fill_(pad[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]), vh.float())
    return o.reshape(b, hq, d).to(qh.dtype), lse.reshape(b, hq) * LOG2E
