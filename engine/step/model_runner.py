"""ModelRunner: one forward step over a batch of prefill chunks and decodes.

Every token of the step goes through the linear layers as one flat ``[T, hidden]`` tensor;
attention metadata is built once (in FlashInfer's form) and shared by all layers. A hybrid
model's sliding layers get a second metadata over their local pages (``window`` set, no
cascade or prefill groups, slid-out pages mapped to the null page) and their own backend.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..attention import AttentionBackend, AttentionMetadata, AttentionShape, SeqSpec, kv_dtype
from ..attention.cpu_backend import CpuKernelBackend
from ..attention.metadata import find_prefill_groups, plan_step_order
from ..heap import release_freed_heap
from ..memory.kv_cache import KVCache
from ..model.loader import LoadedModel
from . import prompt_logprobs, step_replay
from .prompt_logprobs import PromptLogprobSink
from .step_replay import StepReplay

if TYPE_CHECKING:
    from ..memory.block_types import BlockTable
    from .scheduler import SchedulerOutput

log = logging.getLogger("prefixcache.engine")


@dataclass(slots=True)
class BatchEntry:
    token_ids: list[int]  # tokens to compute this step (a prefill chunk, or 1 token for decode)
    start_pos: int  # tokens already in the KV cache (position of token_ids[0])
    block_table: list[int]  # physical blocks covering start_pos + len(token_ids) tokens
    compute_logits: bool = True  # False for a non-final prefill chunk
    local_table: list[int] | None = None  # hybrid: local pages per block (0: slid out)
    prompt_logprobs: PromptLogprobSink | None = None  # its rows' prompt logprobs go here


def batch_of(
    out: SchedulerOutput, local_table_of: Callable[[BlockTable], list[int]] | None = None
) -> list[BatchEntry]:
    """A scheduled step as the runner's batch: each chunk's tokens, where they start, its
    table (and for a hybrid model its local table); logits only for a chunk that reaches its
    sequence's last token. A sequence with placed spans (chunk_reuse.py) gives one entry per
    run of tokens between them, over the same table: every entry's KV is written before any
    attention reads the pages, so the step equals computing the runs one after another."""
    batch = []
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.table is not None
        local = local_table_of(seq.table) if local_table_of is not None else None
        for start, end in chunk.token_runs():  # one run, or runs around placed spans
            batch.append(
                BatchEntry(
                    token_ids=seq.token_ids[start:end],
                    start_pos=start,
                    block_table=seq.table.block_ids,
                    compute_logits=end == seq.num_tokens,
                    local_table=local,
                    prompt_logprobs=prompt_logprobs.sink_for(seq, start, end),
                )
            )
    return batch


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        enable_cascade: bool = True,
        batch_invariant: bool = True,
        on_plan: Callable[[AttentionMetadata], None] | None = None,
        local_backend: AttentionBackend | None = None,
    ) -> None:
        """``on_plan`` sees every step's attention metadata once it is planned (the global
        one). ``local_backend``: a hybrid model's sliding layers' (it must support windows)."""
        self.loaded = loaded
        self.model = loaded.model
        self.model.prepare(batch_invariant)
        release_freed_heap()  # the load's and the packing's temporaries
        self.kv_cache = kv_cache
        self.backend = backend
        self.enable_cascade = enable_cascade
        self.device = loaded.device
        cfg = loaded.config
        spec = kv_cache.spec
        if spec.dtype != loaded.dtype and not kv_dtype.is_fp8(spec.dtype):
            raise ValueError(
                f"KV cache dtype {spec.dtype} is neither fp8 nor the model's {loaded.dtype}"
            )
        self.shape = AttentionShape(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded.dtype,
            spec.dtype,
            cfg.attn_logit_softcapping or 0.0,
            cfg.sm_scale,
        )
        backend.prepare(self.shape, torch.device(self.device))
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("KV cache spec does not match the model (layers, kv heads, head dim)")
        self.on_plan = on_plan
        self.window = 0
        self.local_backend = local_backend
        self._layer_backends = [backend] * cfg.num_layers
        if kv_cache.local_layers:
            windows = {cfg.window_of(i) for i in kv_cache.local_layers}
            if len(windows) != 1 or 0 in windows:
                raise ValueError(f"the sliding layers need one common window, got {windows}")
            if local_backend is None or not getattr(local_backend, "supports_window", False):
                name = local_backend.name if local_backend is not None else None
                raise ValueError(
                    f"a hybrid (sliding-window) model needs an attention backend with "
                    f"sliding-window support for its local layers; {name!r} has none"
                )
            self.window = windows.pop()
            local_backend.prepare(self.shape, torch.device(self.device))
            for i in kv_cache.local_layers:
                self._layer_backends[i] = local_backend
        self.invariance_gaps = (
            invariance_gaps(self.model, self.shape, [backend, *self._layer_backends])
            if batch_invariant
            else []
        )
        if self.invariance_gaps:
            log.warning(
                "batch invariance is off for %s: cached, chunked and batched runs may differ in "
                "their last bits (a greedy token can flip)",
                "; ".join(self.invariance_gaps),
            )
        self.replay: StepReplay | None = None
        local = local_backend if kv_cache.local_layers else None
        self.replay_off_reason = step_replay.unsupported_reason(
            self.model, backend, spec.dtype, local
        )
        if self.replay_off_reason is None:
            assert isinstance(backend, CpuKernelBackend)  # unsupported_reason checked both
            assert local is None or isinstance(local, CpuKernelBackend)
            self.replay = StepReplay(
                self.model,  # type: ignore[arg-type]
                backend,
                kv_cache.layers,
                local_backend=local,
            )

    @torch.inference_mode()
    def execute(self, batch: list[BatchEntry]) -> torch.Tensor:
        """float32 logits ``[n, vocab]``: one row per entry with ``compute_logits``, for its last
        token, in batch order."""
        if not batch:
            return torch.empty(0, self.loaded.config.vocab_size, dtype=torch.float32)
        self._validate(batch)
        bs = self.kv_cache.block_size
        seqs = [SeqSpec(e.start_pos, len(e.token_ids), e.block_table) for e in batch]
        order, groups = plan_step_order(seqs, bs, self.enable_cascade)
        ordered = [seqs[i] for i in order]
        prefill_groups = find_prefill_groups(ordered, bs) if self.enable_cascade else []
        meta = AttentionMetadata.build(
            ordered, bs, self.device, cascade_groups=groups, prefill_groups=prefill_groups
        )
        self.backend.plan(meta, self.shape)
        if self.on_plan is not None:
            self.on_plan(meta)
        if self.local_backend is not None and self.window:
            local = [SeqSpec(e.start_pos, len(e.token_ids), e.local_table or []) for e in batch]
            local_meta = AttentionMetadata.build(
                [local[i] for i in order], bs, self.device, window=self.window
            )
            self.local_backend.plan(local_meta, self.shape)

        ids = [t for i in order for t in batch[i].token_ids]
        if min(ids) < 0 or max(ids) >= self.loaded.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.loaded.config.vocab_size})")
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        layers = self.kv_cache.layers
        backends = self._layer_backends

        def attend(
            layer: int,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            rows: torch.Tensor | None = None,
        ) -> torch.Tensor:
            if rows is None:
                return backends[layer].forward(q, k, v, layers[layer])
            return backends[layer].forward_rows(q, k, v, layers[layer], rows)

        # Row of each logits entry's last token, listed in batch order: only those rows go on
        # past the last layer's attention.
        qo_end = meta.qo_indptr[1:].tolist()
        row_of = {i: qo_end[j] - 1 for j, i in enumerate(order)}
        rows = [row_of[i] for i, e in enumerate(batch) if e.compute_logits]
        # Rows whose logits give prompt logprobs: an entry's first len(targets) rows.
        qo_start = meta.qo_indptr[:-1].tolist()
        first_of = {i: qo_start[j] for j, i in enumerate(order)}
        sinks = [(first_of[i], e.prompt_logprobs) for i, e in enumerate(batch) if e.prompt_logprobs]
        prompt_rows = [start + r for start, sink in sinks for r in range(len(sink.targets))]
        index = torch.tensor(rows + prompt_rows, dtype=torch.int64, device=self.device)
        every_row = not prompt_rows and len(rows) == len(ids) and rows == sorted(rows)
        replay = self.replay  # off while a bench has switched the model to torch's ops
        if replay is not None and len(ids) <= replay.max_tokens and self.model.fused_ops:
            if every_row or prompt_rows:
                hidden = replay.forward(input_ids, meta.positions)
                if not every_row:
                    hidden = hidden.index_select(0, index)
            else:  # only the logits rows past the last layer's attention, ascending
                kept = sorted(rows)
                kept_rows = torch.tensor(kept, dtype=torch.int64)
                hidden = replay.forward(input_ids, meta.positions, kept_rows)
                if kept != rows:
                    at = {r: i for i, r in enumerate(kept)}
                    hidden = hidden.index_select(0, torch.tensor([at[r] for r in rows]))
        else:
            hidden = self.model(input_ids, meta.positions, attend, None if every_row else index)
        if prompt_rows:
            self._fill_prompt_logprobs(hidden[len(rows) :], [sink for _, sink in sinks])
            hidden = hidden[: len(rows)]
        if not rows:
            return torch.empty(0, self.loaded.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden)

    def _fill_prompt_logprobs(self, hidden: torch.Tensor, sinks: list[PromptLogprobSink]) -> None:
        """``hidden``: the sinks' rows in order; their logits a slice at a time."""
        at = 0
        for sink in sinks:
            n = len(sink.targets)
            for lo in range(0, n, prompt_logprobs.ROWS_PER_SLICE):
                hi = min(n, lo + prompt_logprobs.ROWS_PER_SLICE)
                part = dataclasses.replace(sink, targets=sink.targets[lo:hi], first=sink.first + lo)
                prompt_logprobs.fill(part, self.model.compute_logits(hidden[at + lo : at + hi]))
            at += n

    def _validate(self, batch: list[BatchEntry]) -> None:
        cfg = self.loaded.config
        bs = self.kv_cache.block_size
        for e in batch:
            n = len(e.token_ids)
            if n == 0:
                raise ValueError("a batch entry must have at least one token")
            if e.start_pos < 0 or e.start_pos + n > cfg.max_position_embeddings:
                raise ValueError(
                    f"positions {e.start_pos}..{e.start_pos + n} exceed the model's "
                    f"max_position_embeddings {cfg.max_position_embeddings}"
                )
            if len(e.block_table) * bs < e.start_pos + n:
                raise ValueError(
                    f"block table of {len(e.block_table)} blocks cannot hold "
                    f"{e.start_pos + n} tokens"
                )
            if min(e.block_table) < 0 or max(e.block_table) >= self.kv_cache.num_blocks:
                raise ValueError("block table references a block outside the KV cache")
            if self.window:
                local = e.local_table
                if local is None or len(local) < len(e.block_table):
                    raise ValueError("a hybrid model's batch entry needs its local table")
                if min(local) < 0 or max(local) >= self.kv_cache.num_local_pages:
                    raise ValueError("local table references a page outside the local pool")


def invariance_gaps(
    model: torch.nn.Module, shape: AttentionShape, backends: list[AttentionBackend]
) -> list[str]:
    """What keeps a batch-invariant engine from being so here: an attention backend that is not
    (the torch reference, chosen, or fallen back to for a shape the kernels lack), projections
    on oneDNN's or MKL's GEMM (a dtype the invariant kernel does not take)."""
    where = f"{shape.dtype}, head dim {shape.head_dim}"
    gaps = [
        f"attention (backend {b.name!r} at {where}"
        + (
            ": the CPU kernels lack this shape, the torch reference runs it)"
            if b.name == "cpu"
            else ")"
        )
        for b in dict.fromkeys(backends)
        if not b.batch_invariant
    ]
    layers = getattr(getattr(model, "model", None), "layers", None) or [None]
    qkv = getattr(getattr(layers[0], "self_attn", None), "qkv", None)
    if qkv is not None and hasattr(qkv, "invariant") and qkv.invariant is None:
        gaps.append(f"the projections ({qkv.weight.dtype}: not the invariant GEMM's)")
    return gaps
