"""The engine's CPU attention kernel against torch's, on the engine's own call shapes.

- prefill: causal attention of an L-token prompt (8 query / 2 KV heads of 64, bf16), the
  kernel (``cpu_kernels.attention``) vs torch's CPU flash attention as ``dense_attention``
  calls it (``PREFIXCACHE_CPU_KERNELS=0`` path);
- decode: B sequences of ragged lengths, one query each, over their KV pages: the kernel
  reading pages in place vs gathering the pages and one padded torch call (the fallback path);
- cascade: 4 groups of 8 decodes sharing a 512-token prefix (50 own tokens each): the decode
  kernel with the groups (prefix read once per group, states merged in the kernel) vs the
  split it replaced (prefill kernel on each prefix, plain decode on the own pages, LSE merge);
- merge: two partial states of 1,088 tokens merged by LSE, the kernel's one pass vs torch's
  ops (``merge_states`` with the kernel off).

Prints milliseconds (median) and the speedup; CPU time with one thread (robust on a shared
box) and wall time with the configured threads.

    .venv/bin/python bench/cpu_attention.py [--prefill 4000] [--decodes 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.attention import cpu_kernels
from prefixcache.engine.attention.torch_ops import merge_states, padded_decode_attention
from prefixcache.engine.kernels.cpu_features import cpu_flags, cpu_model_name
from prefixcache.engine.model.progress import progress_iter


def timed(fn: Callable[[], object], repeat: int, clock: Callable[[], float]) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        start = clock()
        fn()
        runs.append(clock() - start)
    return statistics.median(runs) * 1000


def torch_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> object:
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    qh, kh, vh = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, kk, vv))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, True, scale=scale
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=4000, help="prompt tokens")
    ap.add_argument("--decodes", type=int, default=16, help="decoding sequences")
    ap.add_argument("--max-len", type=int, default=1100, help="longest decode context")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if (reason := cpu_kernels.unavailable_reason()) is not None or cpu_kernels.load() is None:
        print(f"CPU attention kernel unavailable here: {reason or 'build failed'}")
        if args.json:
            print(json.dumps({"available": False, "cpu": cpu_model_name()}))
        return
    hq, hk, d, bs = 8, 2, 64, 16
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, k, v = rand(args.prefill, hq, d), rand(args.prefill, hk, d), rand(args.prefill, hk, d)
    lens = torch.randint(1, args.max_len + 1, (args.decodes,), generator=gen)
    width = -(-args.max_len // bs)
    num_blocks = args.decodes * width + 1
    kv = rand(num_blocks, 2, bs, hk, d)
    tables = torch.randperm(num_blocks, generator=gen)[: args.decodes * width]
    tables = tables.view(args.decodes, width).to(torch.int32).contiguous()
    dq = rand(args.decodes, hq, d)

    def torch_decode() -> object:
        pages = kv.view(num_blocks * 2, -1)
        rows = tables.long().reshape(-1) * 2
        kk = pages.index_select(0, rows).view(args.decodes, width * bs, hk, d)
        vv = pages.index_select(0, rows + 1).view(args.decodes, width * bs, hk, d)
        return padded_decode_attention(dq, kk, vv, lens, scale)

    # Cascade: groups of decodes sharing a prefix (the shared-prefix serving shape). Ours: one
    # call, the prefix read once per group inside the kernel; baseline: the prefix by the
    # prefill kernel, each member's own pages by a plain decode, merged by LSE in torch.
    groups_n, members, shared_len, own_len = 4, 8, 512, 50
    b = groups_n * members
    shared_blocks, own_blocks = shared_len // bs, -(-own_len // bs)
    ckv = rand(groups_n * shared_blocks + b * own_blocks, 2, bs, hk, d)
    ids = torch.randperm(ckv.shape[0], generator=gen).to(torch.int32)
    prefix_ids = ids[: groups_n * shared_blocks].view(groups_n, shared_blocks)
    own_ids = ids[groups_n * shared_blocks :].view(b, own_blocks)
    full = torch.cat([prefix_ids.repeat_interleave(members, 0), own_ids], 1).contiguous()
    full_lens = torch.full((b,), shared_len + own_len, dtype=torch.int64)
    own_lens = torch.full((b,), own_len, dtype=torch.int64)
    cq = rand(b, hq, d)
    groups = torch.tensor([[i * members, (i + 1) * members, shared_len] for i in range(groups_n)])

    def split_cascade() -> object:
        own, own_lse = cpu_kernels.paged_decode(cq, ckv, own_ids.contiguous(), own_lens, scale)
        out = torch.empty_like(own)
        for i in range(groups_n):
            rows = slice(i * members, (i + 1) * members)
            o_s, lse_s = cpu_kernels.paged_attention(
                cq[rows], ckv, prefix_ids[i].contiguous(), shared_len, scale
            )
            out[rows], _ = merge_states(o_s, lse_s, own[rows], own_lse[rows])
        return out

    # Merge of two partial states (a prefill's cached part with its new tokens), 1,088 rows.
    mo_a, mo_b = rand(1088, hq, d), rand(1088, hq, d)
    ml_a, ml_b = (torch.randn(1088, hq, generator=gen) * 4 for _ in range(2))

    def torch_merge() -> object:
        return merge_states(mo_a, ml_a, mo_b, ml_b)

    cases = {
        "prefill": (
            lambda: cpu_kernels.attention(q, k, v, scale, True),
            lambda: torch_dense(q, k, v, scale),
        ),
        "decode": (lambda: cpu_kernels.paged_decode(dq, kv, tables, lens, scale), torch_decode),
        "cascade": (
            lambda: cpu_kernels.paged_decode(cq, ckv, full, full_lens, scale, groups),
            split_cascade,
        ),
        "merge": (lambda: cpu_kernels.merge_states(mo_a, ml_a, mo_b, ml_b), torch_merge),
    }
    threads = torch.get_num_threads()
    result: dict[str, object] = {
        "available": True,
        "cpu": cpu_model_name(),
        "avx512_bf16": "avx512_bf16" in cpu_flags(),
        "amx_bf16": "amx_bf16" in cpu_flags(),
        "threads": threads,
    }
    for name, (ours, theirs) in progress_iter(cases.items(), "kernel vs baseline"):
        torch.set_num_threads(1)
        ours_cpu = timed(ours, args.repeat, time.process_time)
        theirs_cpu = timed(theirs, args.repeat, time.process_time)
        torch.set_num_threads(threads)
        ours_wall = timed(ours, args.repeat, time.perf_counter)
        theirs_wall = timed(theirs, args.repeat, time.perf_counter)
        result[name] = {
            "kernel_cpu_ms_1t": ours_cpu,
            "torch_cpu_ms_1t": theirs_cpu,
            "speedup_1t": theirs_cpu / ours_cpu,
            "kernel_wall_ms": ours_wall,
            "torch_wall_ms": theirs_wall,
            "speedup_wall": theirs_wall / ours_wall,
        }
    for name in cases:  # after the bar is done
        ours_cpu, theirs_cpu = result[name]["kernel_cpu_ms_1t"], result[name]["torch_cpu_ms_1t"]
        ours_wall, theirs_wall = result[name]["kernel_wall_ms"], result[name]["torch_wall_ms"]
        print(
            f"{name:8s} kernel {ours_cpu:8.2f} ms vs baseline {theirs_cpu:8.2f} ms CPU (1 thread): "
            f"{theirs_cpu / ours_cpu:.2f}x; wall at {threads} threads {ours_wall:.2f} vs "
            f"{theirs_wall:.2f} ms: {theirs_wall / ours_wall:.2f}x"
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
