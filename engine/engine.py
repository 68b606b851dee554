"""The engine loop: admit requests, run scheduled steps through the model, sample, stream out.

``LLMEngine`` is synchronous and single-threaded; ``AsyncEngine`` runs it on its own thread.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from prefixcache.sdk.cache_stats import (
    BlockStats,
    CacheStats,
    TierBlockStats,
    TokenizerPieceStats,
    TokenStats,
)

from . import output, prefix_store
from .api import TreeSnapshot
from .attention import create_backend
from .block_manager import BlockManager
from .cache_activity import CacheActivity
from .config import EngineConfig, TierSpec
from .kv_cache import KVCache
from .kv_events import BlockEventRecorder, KVEventPublisher
from .kv_tier import KVTier, TierStats, create_tier
from .loader import LoadedModel, load_model
from .metrics import EngineMetrics, GaugeValues
from .model_runner import BatchEntry, ModelRunner
from .prefix_store import LoadResult, SaveResult, Snapshot
from .prefix_tree import root_digest
from .request import EngineRequest, RequestOutput, SamplingParams, TokenLogprob, Usage
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .structured_output import StructuredOutput
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger("prefixcache.engine")


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, device=config.device)
        self.tokenizer = self.loaded.tokenizer
        spec = self.loaded.kv_cache_spec(config.block_size)
        num_blocks = config.num_blocks or spec.num_blocks_for(config.kv_memory_bytes)
        self.kv_cache = KVCache(spec, num_blocks)
        self.tier: KVTier | None = None
        if config.kv_offload and config.enable_prefix_caching:
            self.tier = create_tier(
                TierSpec.parse(config.kv_offload),
                self.kv_cache,
                str(self.loaded.device),
                keep_files=config.kv_offload_keep_files,
            )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            identity=self.cache_identity(self.loaded),
            copy_slots=self.kv_cache.copy_slots,
            enable_caching=config.enable_prefix_caching,
            tier=self.tier,
            spill_policy=config.kv_spill_policy,
        )
        self.max_hint_pinned_blocks = config.max_hint_pinned_blocks or max(1, num_blocks // 4)
        backend = create_backend(
            config.attention_backend, self.loaded.device, batch_invariant=config.batch_invariant
        )
        self.runner = ModelRunner(
            self.loaded, self.kv_cache, backend, config.enable_cascade, config.batch_invariant
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.activity = CacheActivity(self.block_manager)  # miss reasons, the dashboard's data
        self.block_manager.on_evict = self.activity.on_evict
        self.scheduler.explain_miss = self.activity.on_admit
        self.sampler = Sampler()
        self.structured = StructuredOutput(self.tokenizer, self.loaded.config.vocab_size)
        self.metrics = EngineMetrics()
        self.metrics.read_gauges_from(self._gauge_values)  # read live at every scrape
        # Why the last step failed as a whole (not attributable to one request); None once a
        # step succeeds again. /health reports it.
        self.error: str | None = None
        dtype_name = str(self.loaded.dtype).removeprefix("torch.")
        self.metrics.model_info.labels(self.loaded.name, dtype_name).set(1)
        log.info("model %s: dtype %s on %s", self.loaded.name, dtype_name, self.loaded.device)
        model_len = self.loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        # A sequence never outgrows the pool, so a lone request can always make progress.
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self._sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._stop_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._last_stats = self.block_manager.stats()
        self._last_tier = self.tier.stats() if self.tier is not None else TierStats()
        self.peak_used_blocks = 0  # high-water mark of blocks held by requests, for benchmarks
        self.kv_events: KVEventPublisher | None = None
        self._kv_recorder: BlockEventRecorder | None = None
        if config.kv_events_endpoint:
            self._start_kv_events(config)

    def _start_kv_events(self, config: EngineConfig) -> None:
        """Publish what the cache stores and evicts; a fresh pool starts with AllBlocksCleared
        (a restarted replica tells its subscribers to forget what it held)."""
        manager = self.block_manager
        roots: frozenset[bytes] | Literal["all"] = "all"
        if config.kv_events_token_ids != "all":
            listed = (
                config.kv_events_token_namespaces if config.kv_events_token_ids == "listed" else ()
            )
            roots = frozenset(root_digest(manager.identity, ns) for ns in listed)
        recorder = BlockEventRecorder(config.block_size, roots)
        self.kv_events = KVEventPublisher(
            config.kv_events_endpoint or "",
            config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
        )
        recorder.all_cleared()
        manager.listener = self._kv_recorder = recorder
        self.flush_kv_events()

    def flush_kv_events(self) -> None:
        """Hand the events since the last flush to the publisher (never waits)."""
        if self._kv_recorder is None or self.kv_events is None:
            return
        if events := self._kv_recorder.drain():
            self.kv_events.publish(events)

    def close(self) -> None:
        """Release what outlives a step: the KV tier's writer and its file, and the KV event
        publisher (it sends what it has queued first)."""
        if self.tier is not None:
            self.tier.close()
        if self.kv_events is not None:
            self.flush_kv_events()
            self.kv_events.close()
            self.kv_events = None

    @staticmethod
    def cache_identity(loaded: LoadedModel) -> bytes:
        """Root of every namespace: blocks never match across models, tokenizers or dtypes."""
        key = f"{loaded.fingerprint}|{loaded.tokenizer.fingerprint}|{loaded.dtype}"
        return hashlib.sha256(key.encode()).digest()

    # -- requests ----------------------------------------------------------------------------

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError with a message a client can act on; changes nothing."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.request_id in self._sequences:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        vocab = self.loaded.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; this engine accepts at most "
                f"{self.max_seq_len - 1} (context {self.max_model_len} tokens, KV pool "
                f"{self.block_manager.num_blocks * self.config.block_size} tokens)"
            )
        for span in request.segments or ():
            if not 0 <= span.start <= span.end <= len(prompt):
                raise ValueError(f"segment {span.tag!r} span is outside the prompt")

    def add_request(self, request: EngineRequest, arrival_time: float | None = None) -> None:
        self.validate(request)
        seq = Sequence(
            request=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            arrival_order=next(self._arrivals),
            arrival_step=self.scheduler.num_steps,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.sampling.skip_special_tokens
            ),
        )
        if request.sampling.grammar is not None:  # ValueError for a schema it cannot use
            self.structured.add(request.request_id, request.sampling.grammar)
        self._sequences[request.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free everything the request holds; returns its final output, or None if unknown."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort")

    def fail_request(self, request_id: str, reason: str, message: str) -> RequestOutput | None:
        """End a request with an error: freed as an abort, counted as a failure (``reason``),
        its final output carries ``message`` (finish reason "error"). None if unknown."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return None
        final = self._finish(seq, "error", failure=reason)
        final.error = message
        return final

    def fail_all(self, reason: str, message: str) -> list[RequestOutput]:
        """End every request (running and waiting) with an error."""
        ids = [s.request_id for s in [*self.scheduler.running, *self.scheduler.waiting]]
        return [out for rid in ids if (out := self.fail_request(rid, reason, message))]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduled step. An error attributable to one request (its sampling, its output)
        ends that request only; a failed forward pass ends the requests of its batch."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        self.metrics.preemptions.inc(len(out.preempted))
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        outputs: list[RequestOutput] = []
        if out.chunks:
            kind = "decode" if all(c.seq.is_decoding for c in out.chunks) else "prefill"
            try:
                logits = self.runner.execute(self._batch(out))
            except Exception as exc:
                log.exception("the model step failed")
                self.error = f"the model step failed: {type(exc).__name__}: {exc}"
                batch = dict.fromkeys(c.seq.request_id for c in out.chunks)
                return [
                    f for rid in batch if (f := self.fail_request(rid, "engine_error", self.error))
                ]
            self.error = None
            self.metrics.prompt_tokens_computed.inc(self.scheduler.on_step_done(out))
            self._count_cache_stats()
            ready = [c.seq for c in out.chunks if c.seq.num_uncomputed_tokens == 0]
            for seq in ready:
                if seq.request.retain and seq.num_output_tokens == 0:
                    self._retain(seq)
            assert logits.shape[0] == len(ready)
            params = [s.request.sampling for s in ready]
            histories = None
            if any(p.penalized for p in params):  # only then: the ids each request has seen
                histories = [
                    (s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :])
                    if p.penalized
                    else ((), ())
                    for s, p in zip(ready, params, strict=True)
                ]
            request_ids = [s.request_id for s in ready]
            self.structured.mask(logits, request_ids)  # constrained rows only
            tokens, logprobs, errors = self.sampler.sample(logits, params, request_ids, histories)
            self.structured.accept(
                [r for r, e in zip(request_ids, errors, strict=True) if e is None],
                [t for t, e in zip(tokens, errors, strict=True) if e is None],
            )
            now = time.monotonic()
            for seq, token, logprob, error in zip(ready, tokens, logprobs, errors, strict=True):
                if error is None:
                    try:
                        outputs.append(self._append_token(seq, token, logprob, now))
                        continue
                    except Exception as exc:
                        log.exception("output failed for request %s", seq.request_id)
                        error = f"output failed: {type(exc).__name__}: {exc}"
                failed = self.fail_request(seq.request_id, "request_error", error)
                if failed is not None:
                    outputs.append(failed)
            self.metrics.step_duration.labels(kind).observe(time.perf_counter() - started)
        self.flush_kv_events()
        return outputs

    def _batch(self, out: SchedulerOutput) -> list[BatchEntry]:
        batch = []
        for chunk in out.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            batch.append(
                BatchEntry(
                    token_ids=seq.token_ids[start:end],
                    start_pos=start,
                    block_table=seq.table.block_ids,
                    compute_logits=end == seq.num_tokens,
                )
            )
        return batch

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - (seq.last_token_time or now))
        seq.last_token_time = now
        self.metrics.generation_tokens.inc()
        reason = output.finish_reason(seq, token, self._stop_token_ids, self.max_seq_len)
        if reason is None:
            return output.delta_output(seq, token, logprob)
        final = self._finish(seq, reason)
        final.new_token_ids = [token]
        final.logprobs = [logprob] if logprob is not None else None
        return final

    def _finish(self, seq: Sequence, reason: str, failure: str | None = None) -> RequestOutput:
        self.activity.on_finish(seq, reason)
        self.scheduler.finish(seq)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self._sequences.pop(seq.request_id, None)
        self.sampler.forget(seq.request_id)
        self.structured.forget(seq.request_id)
        if failure is None:
            self.metrics.requests_finished.labels(reason).inc()
        else:
            self.metrics.requests_failed.labels(failure).inc()
        now = time.monotonic()
        if seq.first_token_time is not None:
            self.metrics.e2e_latency.observe(now - seq.arrival_time)
        return output.final_output(seq, reason, now)

    def _retain(self, seq: Sequence) -> None:
        """The request's retention hints, now that its prompt is cached: TTL pins, each capped
        at --max-pin-ttl, together within the namespace's share of pinned blocks."""
        assert seq.request.retain is not None
        for hint in seq.request.retain:
            self.block_manager.pin(
                seq.token_ids[: min(hint.end, seq.num_prompt_tokens)],
                seq.namespace,
                ttl_s=min(hint.ttl_s, self.config.max_pin_ttl_s),
                max_blocks=self.max_hint_pinned_blocks,
            )

    def _count_cache_stats(self) -> None:
        stats = self.block_manager.stats()
        last, self._last_stats = self._last_stats, stats
        self.metrics.prefix_cache_queries.inc(stats.query_tokens - last.query_tokens)
        reloaded = stats.reloaded_tokens - last.reloaded_tokens
        hits = self.metrics.prefix_cache_hits
        hits.labels("pool").inc(stats.hit_tokens - last.hit_tokens - reloaded)
        if self.tier is not None:
            hits.labels(self.tier.kind).inc(reloaded)
            tier = self.tier.stats()
            before, self._last_tier = self._last_tier, tier
            self.metrics.kv_tier_writes.inc(tier.writes - before.writes)
            self.metrics.kv_tier_reloads.inc(tier.reloads - before.reloads)
            self.metrics.kv_tier_drops.inc(
                tier.drops + tier.corrupt - before.drops - before.corrupt
            )
        self.metrics.evictions.inc((stats.evicted_tokens - last.evicted_tokens) // stats.block_size)

    def _gauge_values(self) -> GaugeValues:
        manager = self.block_manager
        tier = self.tier.stats() if self.tier is not None else None
        return GaugeValues(
            running=self.num_running,
            waiting=self.num_waiting,
            in_use=manager.num_used_blocks,
            cached_idle=manager.num_cached_idle_blocks,
            free=manager.num_free_blocks,
            tier_used=tier.bytes_used if tier is not None else 0,
            tier_free=tier.bytes_free if tier is not None else 0,
        )

    # -- cache admin -------------------------------------------------------------------------

    def pin(self, token_ids: list[int], namespace: str, ttl_s: float | None = None) -> int:
        """Pin a cached prefix; with ``ttl_s`` the pin lapses unless renewed by hits or pins."""
        return self.block_manager.pin(token_ids, namespace, ttl_s)

    def unpin(self, token_ids: list[int], namespace: str) -> int:
        return self.block_manager.unpin(token_ids, namespace)

    # Saving and loading pinned prefixes, split by thread: ``snapshot_pinned`` and
    # ``restore_pinned`` touch the pages (engine thread); ``prefix_store.write`` and
    # ``read_pinned`` do the file work (any thread). ``AsyncEngine`` runs the same halves.

    def snapshot_pinned(self) -> Snapshot:
        """The pinned prefixes and their KV, for ``prefix_store.write``."""
        return prefix_store.snapshot(self.block_manager, self.kv_cache)

    def read_pinned(self, path: str | Path, key: bytes = b"") -> Snapshot:
        """A file's pinned prefixes, refused unless signed with ``key`` by this engine's
        identity (any thread). The empty key is public: scripts and tests only."""
        return prefix_store.read(path, self.block_manager.identity, self.kv_cache, key)

    def restore_pinned(self, snap: Snapshot) -> LoadResult:
        """Cache and pin a snapshot ``read_pinned`` checked against this engine."""
        result = prefix_store.restore(snap, self.block_manager, self.kv_cache)
        self.flush_kv_events()
        self._last_stats = self.block_manager.stats()
        return result

    def save_pinned(self, path: str | Path, key: bytes = b"") -> SaveResult:
        return prefix_store.write(self.snapshot_pinned(), path, key)

    def load_pinned(self, path: str | Path, key: bytes = b"") -> LoadResult:
        return self.restore_pinned(self.read_pinned(path, key))

    def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        """Evict the pool's idle blocks (and empty the KV tier, unless ``keep_tier``: then the
        evicted blocks spill into it)."""
        evicted = self.block_manager.evict_all(include_pinned, keep_tier)
        if self.tier is not None:
            self.tier.drain()
        self.flush_kv_events()
        self.metrics.evictions.inc(evicted)
        self._last_stats = self.block_manager.stats()
        return evicted

    def cache_stats(self) -> CacheStats:
        s = self.block_manager.stats()
        return CacheStats(
            block_size=s.block_size,
            blocks=BlockStats(
                total=s.num_blocks,
                free=s.num_free_blocks,
                cached_idle=s.num_cached_idle_blocks,
                in_use=s.num_used_blocks,
                pinned=s.num_pinned_blocks,
            ),
            tokens=TokenStats(
                queries=s.query_tokens,
                hits=s.hit_tokens,
                inserted=s.inserted_tokens,
                evicted=s.evicted_tokens,
            ),
            hit_rate=s.hit_tokens / s.query_tokens if s.query_tokens else 0.0,
            tokenizer_pieces=self.piece_stats(),
            tier=self._tier_blocks(),
        )

    def _tier_blocks(self) -> TierBlockStats | msgspec.UnsetType:
        """The KV tier's occupancy; UNSET without one."""
        if self.tier is None:
            return msgspec.UNSET
        t = self.tier.stats()
        return TierBlockStats(
            kind=t.kind,
            total=t.num_slots,
            used=t.num_entries,
            bytes_total=t.num_slots * t.slot_bytes,
            bytes_used=t.bytes_used,
        )

    def tier_stats(self) -> TierStats | None:
        return self.tier.stats() if self.tier is not None else None

    def cache_tree(self) -> TreeSnapshot:
        """Every cached block, parents first (the dashboard's picture of the tree)."""
        return self.activity.snapshot()

    def piece_stats(self) -> TokenizerPieceStats | msgspec.UnsetType:
        """The tokenizer's memo of text between special tokens; UNSET where it keeps none."""
        pieces = self.tokenizer.piece_cache
        if pieces is None:
            return msgspec.UNSET
        s = pieces.stats
        return TokenizerPieceStats(hits=s.hits, misses=s.misses, entries=s.entries, chars=s.chars)

    # -- scripts and tests -------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[list[int] | EngineRequest],
        sampling: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (blocking) and return their results in order."""
        requests = []
        for prompt in prompts:
            if isinstance(prompt, EngineRequest):
                requests.append(prompt)
            else:
                rid = f"gen-{next(self._arrivals)}"
                requests.append(EngineRequest(rid, list(prompt), sampling or SamplingParams()))
        for request in requests:
            self.add_request(request)
        results: dict[str, GenerationResult] = {
            r.request_id: GenerationResult(
                r.request_id, list(r.prompt_token_ids), [], "", "", Usage()
            )
            for r in requests
        }
        pending = set(results)
        while pending:
            if not self.has_unfinished:
                raise RuntimeError("engine stopped with unfinished requests")
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.text += out.text_delta
                if out.logprobs:
                    result.logprobs.extend(out.logprobs)
                if out.finished:
                    result.finish_reason = out.finish_reason or ""
                    result.usage = out.usage or Usage()
                    pending.discard(out.request_id)
        return [results[r.request_id] for r in requests]
