"""The engine loop: caching never changes outputs, burst dedupe, order, preemption, abort."""

from __future__ import annotations

import random

import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.engine_hooks import EngineHooks


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


def make_engine(loaded, **overrides) -> LLMEngine:
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=512)
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded)


def assert_clean(engine: LLMEngine) -> None:
    """Pool invariant, and nothing held once every request is done."""
    engine.block_manager.check_invariants()
    assert not engine.has_unfinished
    assert engine.block_manager.num_used_blocks == 0


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def mixed_workload(vocab: int, seed: int = 7) -> list[tuple[int, EngineRequest]]:
    """(arrival step, request): shared prefixes of random lengths, repeats, two tenants."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, n, vocab) for n in (37, 64, 90, 5)]
    workload = []
    for i in range(18):
        prefix = rng.choice(prefixes)
        prompt = prefix + random_tokens(rng, rng.randrange(1, 40), vocab)
        if i >= 4 and rng.random() < 0.25:  # a full repeat of an earlier prompt
            prompt = list(workload[rng.randrange(len(workload))][1].prompt_token_ids)
        tenant = rng.choice(["", "tenant-b"])
        request = EngineRequest(f"r{i}", prompt, greedy(rng.randrange(3, 9)), namespace=tenant)
        workload.append((rng.randrange(0, 12), request))
    return workload


def run_workload(engine: LLMEngine, workload) -> dict[str, tuple[list[int], int]]:
    """Feed requests at their arrival steps; return tokens and cached tokens per request."""
    pending = sorted(workload, key=lambda item: item[0])
    results: dict[str, tuple[list[int], int]] = {}
    tokens: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            fresh = EngineRequest(
                request.request_id,
                list(request.prompt_token_ids),
                request.sampling,
                namespace=request.namespace,
            )
            engine.add_request(fresh)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                results[out.request_id] = (tokens[out.request_id], out.usage.cached_tokens)
        engine.block_manager.check_invariants()
        step += 1
    return results


def test_caching_never_changes_greedy_outputs(loaded) -> None:
    workload = mixed_workload(loaded.config.vocab_size)
    cached_engine = make_engine(loaded, max_num_batched_tokens=96)
    uncached_engine = make_engine(loaded, max_num_batched_tokens=96, enable_prefix_caching=False)
    with_cache = run_workload(cached_engine, workload)
    without_cache = run_workload(uncached_engine, workload)
    assert {k: v[0] for k, v in with_cache.items()} == {k: v[0] for k, v in without_cache.items()}
    assert sum(v[1] for v in with_cache.values()) > 0, "the cached run must actually hit"
    assert sum(v[1] for v in without_cache.values()) == 0
    assert_clean(cached_engine)
    assert_clean(uncached_engine)


@pytest.mark.parametrize(("prefix_len", "suffix_len"), [(96, 12), (101, 12), (100, 8)])
def test_burst_computes_shared_prefix_once(loaded, prefix_len: int, suffix_len: int) -> None:
    """N requests over one uncached prefix: P + N*S prompt tokens, all admitted together.
    (100 + 8: the leader's last block never fills; followers copy it from the live leader.)"""
    rng = random.Random(prefix_len)
    vocab = loaded.config.vocab_size
    prefix = random_tokens(rng, prefix_len, vocab)
    n = 8
    firsts = rng.sample(range(3, vocab), n)  # suffixes share nothing, not even a first token
    engine = make_engine(loaded)
    requests = [
        EngineRequest(
            f"b{i}", prefix + [first] + random_tokens(rng, suffix_len - 1, vocab), greedy(2)
        )
        for i, first in enumerate(firsts)
    ]
    for request in requests:
        engine.add_request(request)
    steps_to_first_tokens, first_tokens, usage = 0, set(), {}
    while engine.has_unfinished:
        for out in engine.step():
            first_tokens.add(out.request_id)
            if out.finished:
                usage[out.request_id] = out.usage
        if len(first_tokens) < n:
            steps_to_first_tokens += 1
    assert sum(u.computed_prompt_tokens for u in usage.values()) == prefix_len + n * suffix_len
    assert all(usage[f"b{i}"].cached_tokens == prefix_len for i in range(1, n))
    assert steps_to_first_tokens <= 1, "followers are admitted together, right after the leader"
    assert_clean(engine)


@pytest.mark.parametrize(("prompt_len", "first_max_tokens"), [(64, 2), (50, 20)])
def test_full_hit_still_computes_the_last_prompt_token(
    loaded, prompt_len: int, first_max_tokens: int
) -> None:
    """A repeated prompt hits all but its last token, also when the hit ends inside a block
    (50 tokens: the first run's generated tokens filled its fourth block, which is copied)."""
    engine = make_engine(loaded)
    prompt = random_tokens(random.Random(1), prompt_len, loaded.config.vocab_size)
    first = engine.generate([prompt], greedy(first_max_tokens))[0]
    second = engine.generate([prompt], greedy(first_max_tokens))[0]
    assert second.usage.cached_tokens == prompt_len - 1
    assert second.usage.computed_prompt_tokens == 1
    assert second.token_ids == first.token_ids
    assert_clean(engine)


def test_cache_aware_order_prefers_hits_but_does_not_starve(loaded) -> None:
    vocab = loaded.config.vocab_size
    rng = random.Random(3)
    hot = random_tokens(rng, 64, vocab)
    engine = make_engine(loaded, max_num_seqs=1, max_wait_steps=8)
    engine.generate([hot + [5]], greedy(1))  # make `hot` cached

    engine.add_request(EngineRequest("cold", random_tokens(rng, 40, vocab), greedy(1)))
    engine.add_request(EngineRequest("warm", hot + [9, 10], greedy(1)))
    order: list[str] = []
    step = 0
    while engine.has_unfinished:
        if step < 40:  # a steady stream of cache hits that would starve a pure LPM order
            engine.add_request(EngineRequest(f"hit{step}", hot + [11 + step], greedy(1)))
        order += [o.request_id for o in engine.step() if o.finished]
        step += 1
    assert order.index("warm") < order.index("cold"), "a long cached match goes first"
    assert order.index("cold") < order.index("hit20"), "the age bound admits the cold request"
    assert_clean(engine)


def test_preemption_under_a_tiny_pool_keeps_outputs(loaded) -> None:
    vocab = loaded.config.vocab_size
    rng = random.Random(5)
    shared = random_tokens(rng, 20, vocab)
    prompts = [shared + random_tokens(rng, rng.randrange(10, 30), vocab) for _ in range(6)]
    roomy = make_engine(loaded)
    expected = [r.token_ids for r in roomy.generate(prompts, greedy(24))]

    tiny = make_engine(loaded, num_blocks=12, max_num_batched_tokens=64)
    results = tiny.generate(prompts, greedy(24))
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    preemptions = tiny.metrics.registry.get_sample_value("prefixcache:num_preemptions_total")
    assert preemptions > 0, "the pool was meant to be too small for the whole batch"
    assert_clean(tiny)


def test_abort_mid_generation_frees_every_block(loaded) -> None:
    engine = make_engine(loaded)
    prompt = random_tokens(random.Random(9), 70, loaded.config.vocab_size)
    engine.add_request(EngineRequest("a", prompt, greedy(50)))
    engine.add_request(EngineRequest("b", prompt[:30], greedy(50)))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    final = engine.abort_request("a")
    assert final is not None and final.finish_reason == "abort" and final.finished
    assert engine.abort_request("a") is None
    engine.abort_request("b")
    assert_clean(engine)


def test_prompt_that_cannot_fit_is_refused_without_side_effects(loaded) -> None:
    engine = make_engine(loaded, num_blocks=4)
    with pytest.raises(ValueError, match="at most"):
        engine.add_request(EngineRequest("big", [5] * 64, greedy(1)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("empty", [], greedy(1)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(EngineRequest("oov", [loaded.config.vocab_size], greedy(1)))
    assert not engine.has_unfinished
    assert_clean(engine)


def test_a_max_model_len_past_the_model_is_capped_and_said(loaded, caplog) -> None:
    """A context longer than the model's positions is capped, with a warning (it was capped
    silently: an operator read their --max-model-len back nowhere)."""
    positions = loaded.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="prefixcache.engine"):
        engine = make_engine(loaded, max_model_len=positions * 4)
    assert engine.max_model_len == positions
    assert f"max_model_len {positions * 4} capped to the model's {positions}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="prefixcache.engine"):
        assert make_engine(loaded, max_model_len=positions // 2).max_model_len == positions // 2
    assert "capped" not in caplog.text


def test_stop_conditions(loaded) -> None:
    engine = make_engine(loaded)
    prompt = random_tokens(random.Random(2), 30, loaded.config.vocab_size)
    free = engine.generate([prompt], greedy(8))[0]
    stop_id = free.token_ids[3]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id  # vLLM's
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert free.stop_reason is None
    assert len(free.text) >= 4  # the demo model's 8 tokens
    needle = free.text[1:3]
    later = free.text[2:4] + "\x00"  # never matched: the other one is first
    cut = engine.generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop=[later, needle])
    )[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == needle
    assert cut.text == free.text[: free.text.index(needle)]
    assert_clean(engine)


def test_segment_usage_splits_cached_tokens(loaded) -> None:
    from prefixcache.engine.request import SegmentSpan

    engine = make_engine(loaded)
    rng = random.Random(4)
    vocab = loaded.config.vocab_size
    system, question = random_tokens(rng, 40, vocab), random_tokens(rng, 10, vocab)
    spans = [SegmentSpan("system", 0, 40), SegmentSpan("question", 40, 50)]
    engine.generate([EngineRequest("x", system + question, greedy(1), segments=spans)])
    other = random_tokens(rng, 10, vocab)
    result = engine.generate([EngineRequest("y", system + other, greedy(1), segments=spans)])[0]
    by_tag = {s.tag: s.cached_tokens for s in result.usage.segments}
    assert by_tag == {"system": 40, "question": 0}


def test_metrics_count_hits_and_tokens(loaded) -> None:
    engine = make_engine(loaded)
    prompt = random_tokens(random.Random(8), 48, loaded.config.vocab_size)
    engine.generate([prompt], greedy(3))
    engine.generate([prompt], greedy(3))
    registry = engine.metrics.registry
    hits = registry.get_sample_value("prefixcache:prefix_cache_hits_total", {"tier": "pool"})
    assert hits == 47
    assert registry.get_sample_value("prefixcache:prefix_cache_queries_total") == 96
    assert registry.get_sample_value("prefixcache:prompt_tokens_computed_total") == 49
    assert registry.get_sample_value("prefixcache:generation_tokens_total") == 6
    assert registry.get_sample_value("prefixcache:time_to_first_token_seconds_count") == 2
    steps = "prefixcache:engine_step_seconds_count"
    assert registry.get_sample_value(steps, {"kind": "prefill"}) == 2  # the 48, then the 1
    assert registry.get_sample_value(steps, {"kind": "decode"}) == 4
    assert registry.get_sample_value("prefixcache:kv_blocks", {"state": "in_use"}) == 0
    assert registry.get_sample_value("prefixcache:kv_cache_usage_perc") == 0.0


def test_kv_cache_usage_is_the_held_fraction_of_the_pool(loaded) -> None:
    """vLLM's ``kv_cache_usage_perc`` (what load-aware routers read): blocks held by running
    requests over the pool's, cached idle ones counted free."""
    engine = make_engine(loaded)
    registry = engine.metrics.registry
    engine.add_request(
        EngineRequest(
            "held", random_tokens(random.Random(3), 64, loaded.config.vocab_size), greedy(8)
        )
    )
    engine.step()
    blocks = {
        s: registry.get_sample_value("prefixcache:kv_blocks", {"state": s})
        for s in ("in_use", "cached_idle", "free")
    }
    assert blocks["in_use"] > 0
    usage = registry.get_sample_value("prefixcache:kv_cache_usage_perc")
    assert usage == blocks["in_use"] / sum(blocks.values())
    while engine.has_unfinished:
        engine.step()
    assert registry.get_sample_value("prefixcache:kv_cache_usage_perc") == 0.0
    assert registry.get_sample_value("prefixcache:kv_blocks", {"state": "cached_idle"}) > 0


def test_last_output_carries_the_request_timeline(loaded) -> None:
    engine = make_engine(loaded)
    prompt = random_tokens(random.Random(9), 40, loaded.config.vocab_size)
    engine.add_request(EngineRequest("timed", prompt, greedy(4)))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    *partial, last = outputs
    assert all(out.timing is None for out in partial)
    t = last.timing
    assert t is not None and last.finished
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert t.decode_seconds > 0 and t.prefill_seconds > 0
    total = t.queue_seconds + t.prefill_seconds + t.decode_seconds
    assert abs(total - t.engine_seconds) < 1e-9


def test_streamed_text_is_the_decoded_output(loaded) -> None:
    """Text deltas, including what the detokenizer held back at the end, add up to the
    decoded output: nothing is lost or doubled; only a last character max_tokens cut before
    its last byte (its U+FFFD) is left out."""
    engine = make_engine(loaded)
    rng = random.Random(12)
    prompts = [random_tokens(rng, 20, loaded.config.vocab_size) for _ in range(4)]
    for result in engine.generate(prompts, greedy(12)):
        assert result.text == loaded.tokenizer.decode(result.token_ids).removesuffix("\ufffd")


def test_decodes_sharing_a_prefix_run_as_one_cascade_group(loaded) -> None:
    rng = random.Random(13)
    vocab = loaded.config.vocab_size
    shared = random_tokens(rng, 100, vocab)
    prompts = [shared + random_tokens(rng, 5, vocab) for _ in range(4)]
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=512)
    plans: list = []
    engine = LLMEngine(config, loaded, EngineHooks(on_plan=plans.append))
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"d{i}", prompt, greedy(6)))
    groups_seen = []
    while engine.has_unfinished:
        engine.step()
        meta = plans[-1]
        if meta.num_prefills == 0 and meta.num_seqs >= 2:  # a decode-only step of a group
            groups_seen.append(
                [(g.end - g.begin, g.num_shared_blocks) for g in meta.cascade_groups]
            )
    assert len(groups_seen) >= 3
    assert all(len(groups) == 1 and groups[0][1] == 6 for groups in groups_seen), groups_seen
    assert groups_seen[0] == [(4, 6)], "all four decodes share the prefix's six blocks"
    uncascaded = make_engine(loaded, enable_cascade=False)
    expected = [r.token_ids for r in uncascaded.generate(prompts, greedy(6))]
    assert [r.token_ids for r in make_engine(loaded).generate(prompts, greedy(6))] == expected
    assert_clean(engine)


def test_an_admin_evictions_tier_writes_count_at_once(loaded) -> None:
    """``evict_all(keep_tier=True)`` spills the idle blocks into the tier: its writes reach
    the metrics when the command returns, not at the next step; its evictions count once."""
    engine = make_engine(loaded, kv_offload="host:0.05")
    prompt = random_tokens(random.Random(9), 48, loaded.config.vocab_size)
    engine.generate([prompt], greedy(1))
    registry = engine.metrics.registry
    writes = "prefixcache:kv_tier_writes_total"
    before = registry.get_sample_value(writes)
    evicted = engine.evict_all(keep_tier=True)
    assert evicted == 3  # the prompt's full blocks, idle
    assert registry.get_sample_value(writes) == before + evicted
    assert registry.get_sample_value("prefixcache:kv_block_evictions_total") == evicted
    engine.generate([random_tokens(random.Random(10), 8, loaded.config.vocab_size)], greedy(1))
    assert registry.get_sample_value(writes) == before + evicted  # not counted again
    assert registry.get_sample_value("prefixcache:kv_block_evictions_total") == evicted
