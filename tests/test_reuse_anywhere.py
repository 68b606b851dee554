"""Position-independent reuse of ``reuse="anywhere"`` segments (engine/step/chunk_reuse.py).

The demo model in float32 on the torch backend: placed keys are checked against the keys a
full computation writes, the repair path against full recomputation, and the flag's absence
(and the KV a flagged request leaves behind) against cold outputs, bit for bit.
"""

from __future__ import annotations

import dataclasses
import random
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.layer_ops import TORCH_OPS
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.rope import RotaryEmbedding, rope_inv_freq, shift_keys, shift_rotation
from prefixcache.engine.request import EngineRequest, SamplingParams, SegmentSpan
from prefixcache.engine.step.chunk_reuse import chunk_namespace, plan_placements, stored_length
from prefixcache.engine.step.generate import GenerationResult

BS = 16
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def make_engine(loaded: LoadedModel, repair: int = 16, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model="demo",
        dtype="float32",
        device="cpu",
        num_blocks=256,
        reuse_repair_tokens=repair,
        **overrides,  # type: ignore[arg-type]
    )
    return LLMEngine(config, loaded)


@dataclasses.dataclass
class Rag:
    """A RAG prompt: system text, documents in a given order, a question."""

    system: list[int]
    docs: list[list[int]]
    question: list[int]

    def request(
        self, rid: str, order: list[int], reuse: bool, namespace: str = "", max_tokens: int = 6
    ) -> EngineRequest:
        tokens, spans = list(self.system), [SegmentSpan("system", 0, len(self.system))]
        for d in order:
            start = len(tokens)
            tokens += self.docs[d]
            spans.append(SegmentSpan(f"doc:{d}", start, len(tokens), "anywhere" if reuse else ""))
        start = len(tokens)
        tokens += self.question
        spans.append(SegmentSpan("question", start, len(tokens)))
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        return EngineRequest(rid, tokens, sampling, namespace=namespace, segments=spans)


def make_rag(seed: int, vocab: int, doc_lens: list[int], system: int = 20) -> Rag:
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    return Rag(toks(system), [toks(n) for n in doc_lens], toks(7))


def run(engine: LLMEngine, request: EngineRequest) -> GenerationResult:
    result = engine.generate([request])[0]
    engine.block_manager.check_invariants()
    return result


def outputs(result: GenerationResult) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Generated tokens with their logprobs and the top 5, as exact floats."""
    return [(lp.token_id, lp.logprob, list(lp.top)) for lp in result.logprobs]


# -- RoPE re-rotation ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    pos=st.integers(0, 2048),
    delta=st.integers(-1024, 2048),
    seed=st.integers(0, 2**16),
)
def test_rerotated_keys_equal_keys_computed_at_the_new_position(
    pos: int, delta: int, seed: int
) -> None:
    """K rotated for ``pos`` by the model's own rotary, then shifted by ``delta``, equals K
    rotated for ``pos + delta`` within the rounding of float32 angles."""
    new = pos + delta
    if new < 0:
        return
    config = load_model("demo", dtype="float32", device="cpu").config
    rotary = RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(3, config.num_kv_heads, config.head_dim, generator=gen)
    q = torch.zeros(3, config.num_heads, config.head_dim)

    def rotated(p: int) -> torch.Tensor:
        cos, sin = rotary(torch.full((3,), p), torch.float32)
        return TORCH_OPS.rotary(q.clone(), raw.clone(), cos, sin, None)[1]

    shifted = shift_keys(rotated(pos), *shift_rotation(rope_inv_freq(config), delta))
    # An angle a is rounded to within a * eps / 2 (a product and a sum: a few of those).
    max_angle = max(pos, abs(delta), new) * float(rope_inv_freq(config).max())
    tol = 8 * FP32_EPS * (max_angle + 1) * float(raw.abs().max())
    torch.testing.assert_close(shifted, rotated(new), atol=tol, rtol=0)
    if delta:  # and it is a real rotation: unshifted keys are far off
        assert (rotated(pos) - rotated(new)).abs().max() > 100 * tol or max_angle < 1e-3


def test_placed_first_layer_keys_equal_the_full_computation(loaded: LoadedModel) -> None:
    """Layer 0's K and V depend on the token and its position only, so a placed chunk's
    layer-0 KV must be what a full computation writes there: K within fp32 rounding of the
    re-rotation, V bit for bit. Wrong slots, blocks or offsets fail this."""
    vocab = loaded.config.vocab_size
    rag = make_rag(1, vocab, [70, 53, 90])
    engine = make_engine(loaded, repair=4)
    run(engine, rag.request("warm", [0, 1, 2], reuse=True))
    engine.add_request(rag.request("placed", [2, 0, 1], reuse=True, max_tokens=2))
    engine.step()  # admission places every chunk
    seq = engine._sequences["placed"]
    assert [p.segment for p in seq.placements] == [1, 2, 3]
    table = list(seq.table.block_ids)
    cold = make_engine(loaded)
    cold.add_request(rag.request("cold", [2, 0, 1], reuse=False, max_tokens=2))
    cold.step()
    cold_table = list(cold._sequences["cold"].table.block_ids)
    layer, cold_layer = engine.kv_cache.layers[0], cold.kv_cache.layers[0]
    inv = rope_inv_freq(loaded.config)
    for p in seq.placements:
        for pos in (p.start, (p.start + p.end) // 2, p.end - 1):
            got = layer[table[pos // BS], :, pos % BS]
            want = cold_layer[cold_table[pos // BS], :, pos % BS]
            assert torch.equal(got[1], want[1]), "V moves unchanged"
            tol = 8 * FP32_EPS * (pos * float(inv.max()) + 1) * float(want[0].abs().max())
            torch.testing.assert_close(got[0], want[0], atol=tol, rtol=0)


# -- what the engine serves ---------------------------------------------------------------------


prompt_shapes = st.tuples(
    st.lists(st.integers(17, 70), min_size=2, max_size=4),  # document lengths
    st.integers(0, 2**16),  # seed
    st.integers(1, 40),  # system tokens
)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shape=prompt_shapes, data=st.data())
def test_repair_covering_whole_chunks_equals_full_recomputation(
    loaded: LoadedModel, shape: tuple[list[int], int, int], data: st.DataObject
) -> None:
    """k >= every chunk's length: nothing is placed, every flagged token is recomputed, and
    the outputs are the cold outputs bit for bit (the chunks were still found in the store)
    on the batch-invariant kernels; on the torch reference (CPUs without AVX512_BF16), the
    same tokens with logprobs equal up to float rounding."""
    lens, seed, system = shape
    rag = make_rag(seed, loaded.config.vocab_size, lens, system)
    order = data.draw(st.permutations(range(len(lens))))
    engine = make_engine(loaded, repair=max(lens))
    run(engine, rag.request("warm", list(range(len(lens))), reuse=True))
    reused = run(engine, rag.request("reuse", list(order), reuse=True))
    assert reused.usage.reused_tokens == 0
    served = {s.tag: s.served for s in reused.usage.segments}
    assert all(v in ("computed", "cached") for v in served.values())
    cold = run(make_engine(loaded), rag.request("cold", list(order), reuse=False))
    assert_same_outputs(engine, reused, cold)


def assert_same_outputs(engine: LLMEngine, a: GenerationResult, b: GenerationResult) -> None:
    """Bit for bit on the batch-invariant kernels; on the torch reference (CPUs without
    AVX512_BF16, which promises the math, not the bits): the same tokens, logprobs within
    float rounding."""
    if getattr(engine.runner.backend, "batch_invariant", False):
        assert outputs(a) == outputs(b)
        return
    assert [t for t, _, _ in outputs(a)] == [t for t, _, _ in outputs(b)]
    got, want = ([lp for _, lp, _ in outputs(r)] for r in (a, b))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_placed_chunks_change_the_outputs_and_are_reported(loaded: LoadedModel) -> None:
    """k = 0: the placed KV is really used (the logprobs move off the cold ones), and the
    report says which segments were reused and how many tokens each recomputed."""
    rag = make_rag(3, loaded.config.vocab_size, [48, 40, 64], system=32)
    engine = make_engine(loaded, repair=0)
    first = run(engine, rag.request("first", [0, 1, 2], reuse=True))
    assert first.usage.reused_tokens > 0  # computed on their own, then placed
    reused = run(engine, rag.request("reuse", [2, 0, 1], reuse=True))
    report = {s.tag: s for s in reused.usage.segments}
    assert report["system"].served == "cached"
    for d, n in ((0, 48), (1, 40), (2, 64)):
        seg = report[f"doc:{d}"]
        assert seg.served == "reused_anywhere"
        assert seg.reused_tokens == n // BS * BS
        assert seg.recomputed_tokens == n - n // BS * BS
    assert reused.usage.reused_tokens == 48 + 32 + 64
    # only the system prompt, the chunks' tails and the question were computed
    assert reused.usage.computed_prompt_tokens == 0 + 8 + 7
    cold = run(make_engine(loaded), rag.request("cold", [2, 0, 1], reuse=False))
    assert outputs(reused) != outputs(cold)
    metrics = engine.metrics.registry
    stored = metrics.get_sample_value(
        "prefixcache:reuse_anywhere_segments_total", {"source": "stored"}
    )
    computed = metrics.get_sample_value(
        "prefixcache:reuse_anywhere_segments_total", {"source": "computed"}
    )
    assert (stored, computed) == (3, 3)
    placed = metrics.get_sample_value(
        "prefixcache:reuse_anywhere_tokens_total", {"served": "placed"}
    )
    assert placed == 2 * (48 + 32 + 64)
    # the chunk store's own lookups are not prefix-cache lookups: the hit rate counts requests
    stats = engine.block_manager.stats()
    prompts = len(first.prompt_token_ids) + len(reused.prompt_token_ids)
    assert stats.query_tokens == prompts
    assert stats.hit_tokens == reused.usage.cached_tokens == 32
    queries = metrics.get_sample_value("prefixcache:prefix_cache_queries_total")
    assert queries == prompts


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shape=prompt_shapes, data=st.data())
def test_flag_off_and_after_flagged_requests_outputs_are_cold(
    loaded: LoadedModel, shape: tuple[list[int], int, int], data: st.DataObject
) -> None:
    """Approximate (placed) KV never reaches a prefix lookup: after flagged requests in
    several orders, an unflagged request of the very same tokens gets the cold outputs bit for
    bit; so does the unflagged request on an engine that never saw a flag."""
    lens, seed, system = shape
    rag = make_rag(seed, loaded.config.vocab_size, lens, system)
    n = len(lens)
    orders = [list(data.draw(st.permutations(range(n)))) for _ in range(3)]
    engine = make_engine(loaded, repair=data.draw(st.sampled_from([0, 3, 16])))
    for i, order in enumerate(orders):
        run(engine, rag.request(f"flagged-{i}", order, reuse=True))
    after = [run(engine, rag.request(f"plain-{i}", o, reuse=False)) for i, o in enumerate(orders)]
    for i, order in enumerate(orders):
        cold = run(make_engine(loaded), rag.request(f"cold-{i}", order, reuse=False))
        plain = EngineRequest(f"bare-{i}", cold.prompt_token_ids, cold_sampling())
        bare = run(make_engine(loaded), plain)  # no segments at all: today's engine
        assert_same_outputs(engine, after[i], cold)
        assert outputs(cold) == outputs(bare)  # two cold runs: equal on any backend
        assert all(s.served != "reused_anywhere" for s in after[i].usage.segments)


def cold_sampling() -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)


def test_tenants_never_share_chunks(loaded: LoadedModel) -> None:
    rag = make_rag(5, loaded.config.vocab_size, [64, 48])
    engine = make_engine(loaded, repair=0)
    a1 = run(engine, rag.request("a1", [0, 1], reuse=True, namespace="tenant-a"))
    b1 = run(engine, rag.request("b1", [1, 0], reuse=True, namespace="tenant-b"))
    a2 = run(engine, rag.request("a2", [1, 0], reuse=True, namespace="tenant-a"))
    # b computed both chunks on its own (as a1 did); a2 found a's
    chunk_tokens = 64 + 48
    assert b1.usage.computed_prompt_tokens >= chunk_tokens
    assert a1.usage.computed_prompt_tokens >= chunk_tokens
    assert a2.usage.computed_prompt_tokens < chunk_tokens
    roots = {engine.block_manager.root(chunk_namespace(ns)) for ns in ("tenant-a", "tenant-b")}
    roots |= {engine.block_manager.root(ns) for ns in ("tenant-a", "tenant-b")}
    assert len(roots) == 4


def test_plan_places_after_the_hit_within_whole_blocks() -> None:
    """Chunks are stored after the 20-token context before the first flagged segment, up to
    the last block boundary of context + chunk."""
    spans = [
        SegmentSpan("s", 0, 20),
        SegmentSpan("a", 20, 70, "anywhere"),  # 50 tokens: 20 + 44 = 4 whole blocks stored
        SegmentSpan("b", 70, 80, "anywhere"),  # 20 + 10 is under two blocks: computed
        SegmentSpan("c", 80, 112, "anywhere"),  # 20 + 28 stored; 108.. computed
    ]
    assert stored_length(20, 50, BS) == 44 and stored_length(20, 10, BS) == 0
    assert stored_length(0, 50, BS) == 48
    assert plan_placements(spans, 20, 112, 8, BS) == [(1, 28, 64), (3, 88, 108)]
    # a starts inside the exact hit: placed from where the hit ends
    assert plan_placements(spans, 32, 112, 0, BS) == [(1, 32, 64), (3, 80, 108)]
    assert plan_placements(spans, 70, 112, 0, BS) == [(3, 80, 108)]
    assert plan_placements(spans, 0, 112, 48, BS) == []
    # the prompt's last token is always computed
    aligned = [SegmentSpan("s", 0, 16), SegmentSpan("a", 16, 48, "anywhere")]
    assert plan_placements(aligned, 16, 48, 0, BS) == [(1, 16, 47)]


def test_unknown_reuse_value_is_refused(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    request = EngineRequest("r", [1, 2, 3], segments=[SegmentSpan("d", 0, 3, "sometimes")])
    with pytest.raises(ValueError, match="reuse"):
        engine.add_request(request)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shape=prompt_shapes, repair=st.sampled_from([0, 5, 16]), budget=st.integers(3, 40))
def test_placed_requests_equal_whatever_the_step_budget(
    loaded: LoadedModel, shape: tuple[list[int], int, int], repair: int, budget: int
) -> None:
    """One step computes every run between placed spans (one batch entry each, over one
    table); a small budget computes them a few tokens a step. Both give the same outputs bit
    for bit (within rounding on the torch reference), next to another request in the batch."""
    lens, seed, system = shape
    rag = make_rag(seed, loaded.config.vocab_size, lens, system)
    order = list(reversed(range(len(lens))))
    results = []
    for step_budget in (2048, budget):
        engine = make_engine(loaded, repair=repair, max_num_batched_tokens=step_budget)
        run(engine, rag.request("warm", list(range(len(lens))), reuse=True))
        other = make_rag(seed + 1, loaded.config.vocab_size, [30]).request("other", [0], False)
        both = engine.generate([rag.request("reuse", order, reuse=True), other])
        engine.block_manager.check_invariants()
        assert both[0].usage.reused_tokens > 0 or max(lens) < BS + repair
        results.append(both)
    for a, b in zip(results[0], results[1], strict=True):
        assert_same_outputs(engine, a, b)


def test_kv_events_never_publish_chunk_blocks(loaded: LoadedModel) -> None:
    """A router told of a chunk's blocks would route to a miss (no prefix lookup hits the
    chunk store): the events carry the prompts' own blocks, and none of the chunks'."""
    from prefixcache.engine.observability.kv_events import BlockRemoved, BlockStored, block_hash

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    rag = make_rag(11, loaded.config.vocab_size, [48, 40], system=32)
    engine = make_engine(
        loaded, repair=0, kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_token_ids="all"
    )
    assert engine.kv_events is not None and engine.kv_events.publisher is not None
    published: list[object] = []
    engine.kv_events.publisher.publish = lambda events, ts=None: published.extend(events) or 0
    try:
        run(engine, rag.request("first", [0, 1], reuse=True))
        run(engine, rag.request("again", [1, 0], reuse=True))
        chunk_root = engine.block_manager.root(chunk_namespace(""))
        tree = engine.block_manager._tree
        chunk_hashes = {
            block_hash(n.digest)
            for n in tree.nodes()
            if list(n.path_up())[-1].parent_digest == chunk_root
        }
        assert chunk_hashes, "the chunks were not stored"
        stored = {h for e in published if isinstance(e, BlockStored) for h in e.block_hashes}
        assert stored and not stored & chunk_hashes
        engine.evict_all()
        removed = {h for e in published if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removed == stored  # every published block removed; no chunk block ever named
    finally:
        engine.close()
