"""The engine: admit requests, and step: schedule, execute, sample, update.

``LLMEngine`` is synchronous and single-threaded; ``EngineCore`` (engine_core.py) serves it,
on a thread (``AsyncEngine``) or in its own process (``ProcessEngine``). The step reports what
happened to its stats collector (engine_stats.py); logits processors live in the sampler.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from prefixcache.sdk.cache_stats import CacheStats, TokenizerPieceStats

from .api import TreeSnapshot
from .attention import create_backend, kv_dtype
from .config import EngineConfig
from .memory import prefix_store
from .memory.kv_tier import TierStats
from .memory.prefix_store import LoadResult, SaveResult, Snapshot
from .model.loader import LoadedModel
from .observability import cache_report
from .observability.block_listeners import BlockListeners
from .observability.cache_activity import CacheActivity
from .observability.engine_stats import EngineStats
from .observability.kv_event_feed import KVEventFeed
from .observability.metrics import EngineMetrics
from .request import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from .step import output
from .step.chunk_reuse import REUSE_ANYWHERE, ChunkReuse
from .step.engine_hooks import EngineHooks
from .step.generate import GenerationResult, run_to_completion
from .step.kv_setup import build_kv, cache_identity
from .step.model_runner import ModelRunner, batch_of
from .step.model_setup import engine_model
from .step.sampler import Sampler
from .step.scheduler import Scheduler, SchedulerOutput
from .step.sequence import Sequence
from .step.structured_output import StructuredOutput
from .text.detokenizer import IncrementalDetokenizer

log = logging.getLogger("prefixcache.engine")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        hooks: EngineHooks | None = None,
    ) -> None:
        self.config = config
        self.hooks = hooks = hooks or EngineHooks()
        self.loaded = engine_model(config, loaded, hooks.on_tokenizer)
        self.tokenizer = self.loaded.tokenizer
        self._listeners = BlockListeners()  # the activity, then the KV event recorder
        identity = self.cache_identity(self.loaded, config.kv_cache_dtype)
        kv = build_kv(config, self.loaded, identity, hooks.clock)
        self.kv_cache, self.tier, self.block_manager = kv.cache, kv.tier, kv.manager
        self.local_tier = kv.local_tier
        self._tiers = [t for t in (kv.tier, kv.local_tier) if t is not None]  # (len() is 0)
        self.block_manager.listener = self._listeners
        self.hybrid, self._local_table_of = kv.local_table_of is not None, kv.local_table_of
        num_blocks = self.block_manager.num_blocks
        self.max_hint_pinned_blocks = config.max_hint_pinned_blocks or max(1, num_blocks // 4)

        backend = create_backend(
            config.attention_backend, self.loaded.device, batch_invariant=config.batch_invariant
        )
        local_backend = None  # a hybrid model's sliding layers plan their own metadata
        if self.hybrid:
            local_backend = create_backend(
                config.attention_backend, self.loaded.device, batch_invariant=config.batch_invariant
            )
        self.runner = ModelRunner(
            self.loaded,
            self.kv_cache,
            backend,
            config.enable_cascade,
            batch_invariant=config.batch_invariant,
            on_plan=hooks.on_plan,
            local_backend=local_backend,
        )
        self.activity = CacheActivity(self.block_manager)  # miss reasons, the dashboard's data
        self._listeners.add(self.activity)
        self.scheduler = Scheduler(config, self.block_manager)
        self.scheduler.explain_miss = self.activity.on_admit
        self.chunk_reuse = ChunkReuse(
            self.block_manager,
            self.kv_cache,
            self.runner.execute,
            self.loaded.model.layer_inv_freqs(),
            config.reuse_repair_tokens,
        )
        self.scheduler.reuse = self.chunk_reuse
        self.structured = StructuredOutput(self.tokenizer, self.loaded.config.vocab_size)
        self._stop_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.structured, hooks.logits_processors, self._stop_token_ids)
        self.stats = EngineStats(self.block_manager, self.tier)
        self.stats.watch_gauges(lambda: self.num_running, lambda: self.num_waiting)
        # Why the last step failed as a whole (not attributable to one request); None once a
        # step succeeds again. /health reports it.
        self.error: str | None = None
        dtype_name = str(self.loaded.dtype).removeprefix("torch.")
        self.stats.model(self.loaded.name, dtype_name)
        log.info("model %s: dtype %s on %s", self.loaded.name, dtype_name, self.loaded.device)
        model_len = self.loaded.config.max_position_embeddings
        asked = config.max_model_len or model_len
        if asked > model_len:
            log.warning("max_model_len %d capped to the model's %d positions", asked, model_len)
        self.max_model_len = min(asked, model_len)
        # A sequence never outgrows the pool, so a lone request can always make progress.
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self._sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.kv_events: KVEventFeed | None = None
        if config.kv_events_endpoint:  # what the cache stores and evicts, published
            self.kv_events = KVEventFeed(config, self.block_manager.identity)
            self._listeners.add(self.kv_events.recorder)
            self.chunk_reuse.on_namespace = self.kv_events.hide_namespace

    @property
    def metrics(self) -> EngineMetrics:
        return self.stats.metrics

    def flush_kv_events(self) -> None:
        """Hand the events since the last flush to the publisher (never waits)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def close(self) -> None:
        """Release the KV tier's writer and file, and the event publisher (it sends its queue)."""
        for tier in self._tiers:
            tier.close()
        if self.kv_events is not None:
            self.kv_events.close()

    @staticmethod
    def cache_identity(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> bytes:
        """Root of every namespace (``kv_setup.cache_identity``)."""
        return cache_identity(loaded, kv_cache_dtype)

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
            if span.reuse not in ("", REUSE_ANYWHERE):
                raise ValueError(f"segment {span.tag!r}: reuse must be {REUSE_ANYWHERE!r}")

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
        self.sampler.add(
            request.request_id, request.sampling, request.namespace
        )  # bad schema: ValueError
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
        """One scheduled step: schedule, execute, sample, update. An error attributable to one
        request (its sampling, its output) ends that request only; a failed forward pass ends
        the requests of its batch."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        self.stats.scheduled(len(out.preempted))
        if self.hooks.on_schedule is not None:
            self.hooks.on_schedule(out, self.block_manager.num_used_blocks)
        outputs: list[RequestOutput] = []
        if out.chunks:
            kind = "decode" if all(c.seq.is_decoding for c in out.chunks) else "prefill"
            try:
                logits = self.runner.execute(batch_of(out, self._local_table_of))
            except Exception as exc:
                return self._fail_batch(out, exc)
            self.error = None
            self.stats.computed(self.scheduler.on_step_done(out))
            ready = [c.seq for c in out.chunks if c.seq.num_uncomputed_tokens == 0]
            for seq in ready:
                if seq.request.retain and seq.num_output_tokens == 0:
                    self._retain(seq)
            assert logits.shape[0] == len(ready)
            sampled = self.sampler.sample_next(logits, ready)
            outputs = self._update(ready, sampled.tokens, sampled.logprobs, sampled.errors)
            self.stats.step_done(kind, time.perf_counter() - started)
        self.flush_kv_events()
        return outputs

    def _fail_batch(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        log.exception("the model step failed")
        self.error = f"the model step failed: {type(exc).__name__}: {exc}"
        batch = dict.fromkeys(c.seq.request_id for c in out.chunks)
        return [f for rid in batch if (f := self.fail_request(rid, "engine_error", self.error))]

    def _update(
        self,
        ready: list[Sequence],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        errors: list[str | None],
    ) -> list[RequestOutput]:
        """Each sampled token appended and streamed (or its request failed alone)."""
        outputs = []
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
        return outputs

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        seq.token_ids.append(token)
        self.stats.token(seq, now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        reason = output.finish_reason(seq, token, self._stop_token_ids, self.max_seq_len)
        if reason is None:
            out = output.delta_output(seq, token, logprob)
        else:
            out = self._finish(seq, reason)
            out.new_token_ids = [token]
            out.logprobs = [logprob] if logprob is not None else None
        if seq.num_output_tokens == 1:  # the first output: the prompt's logprobs and usage
            out.prompt_logprobs, out.usage = seq.prompt_logprobs, out.usage or output.usage_of(seq)
        return out

    def _finish(self, seq: Sequence, reason: str, failure: str | None = None) -> RequestOutput:
        self.activity.on_finish(seq, reason)
        self.scheduler.finish(seq)
        self._sequences.pop(seq.request_id, None)
        self.sampler.forget(seq.request_id)  # its generator, its grammar
        now = time.monotonic()
        self.stats.finished(seq, reason, failure, now)
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
        self.stats.skip_cache_moves()
        return result

    def save_pinned(self, path: str | Path, key: bytes = b"") -> SaveResult:
        return prefix_store.write(self.snapshot_pinned(), path, key)

    def load_pinned(self, path: str | Path, key: bytes = b"") -> LoadResult:
        return self.restore_pinned(self.read_pinned(path, key))

    def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        """Evict the pool's idle blocks (and empty the KV tier, unless ``keep_tier``: then the
        evicted blocks spill into it)."""
        evicted = self.block_manager.evict_all(include_pinned, keep_tier)
        for tier in self._tiers:
            tier.drain()
        self.flush_kv_events()
        self.stats.admin_evicted(evicted)
        return evicted

    def cache_stats(self) -> CacheStats:
        tier, local = (t.stats() if t is not None else None for t in (self.tier, self.local_tier))
        pages, manager = kv_dtype.name_of(self.kv_cache.spec.dtype), self.block_manager.stats()
        return cache_report.cache_stats(manager, tier, self.piece_stats(), pages, local)

    def tier_stats(self) -> TierStats | None:
        return self.tier.stats() if self.tier is not None else None

    def cache_tree(self) -> TreeSnapshot:
        """Every cached block, parents first (the dashboard's picture of the tree)."""
        return self.activity.snapshot()

    def piece_stats(self) -> TokenizerPieceStats | msgspec.UnsetType:
        """The tokenizer's memo of text between special tokens; UNSET where it keeps none."""
        return cache_report.piece_stats(self.tokenizer)

    # -- scripts and tests -------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[list[int] | EngineRequest],
        sampling: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (blocking) and return their results in order."""
        requests = [
            p
            if isinstance(p, EngineRequest)
            else EngineRequest(f"gen-{next(self._arrivals)}", list(p), sampling or SamplingParams())
            for p in prompts
        ]
        return run_to_completion(self, requests)
