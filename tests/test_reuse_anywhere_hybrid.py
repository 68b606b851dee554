"""``reuse="anywhere"`` on hybrid (sliding-window + global) models (engine/step/chunk_reuse.py).

Two models: a tiny random Gemma 3 saved by transformers (sliding layers on their own rope base,
100, global ones on 50,000 with linear scaling: a chunk re-rotated with the wrong layer's
frequencies fails here), and the demo Llama with every other layer sliding under the windowed
reference backend (so that the first layer can be a global one too). Placed keys are checked
against a full computation's, the repair path against full recomputation, and the flag's
absence against cold outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reuse_anywhere import BS, FP32_EPS, assert_same_outputs, make_rag, outputs, run

from prefixcache.engine import engine as engine_module
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.hybrid.local_pages import NULL_PAGE
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.rope import shift_keys, shift_rotation

transformers = pytest.importorskip("transformers")

from test_gemma3 import make_tiny_hf, save_tiny  # noqa: E402

WINDOW = 40


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    hf = make_tiny_hf(seed=3, sliding_window=WINDOW, max_position_embeddings=1024)
    return load_model(str(save_tiny(hf, folder)), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def windowed_demo(demo: LoadedModel, first_sliding: bool) -> LoadedModel:
    windows = tuple(
        WINDOW if (i % 2 == 0) == first_sliding else 0 for i in range(demo.config.num_layers)
    )
    return dataclasses.replace(demo, config=dataclasses.replace(demo.config, layer_windows=windows))


def make_engine(
    loaded: LoadedModel, repair: int = 16, windowed_reference: bool = False, **overrides: object
) -> LLMEngine:
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        device="cpu",
        num_blocks=256,
        reuse_repair_tokens=repair,
        **overrides,  # type: ignore[arg-type]
    )
    if not windowed_reference:
        engine = LLMEngine(config, loaded)
    else:
        from hybrid_reference import WindowedReferenceBackend

        original = engine_module.create_backend
        engine_module.create_backend = lambda *a, **k: WindowedReferenceBackend()
        try:
            engine = LLMEngine(config, loaded)
        finally:
            engine_module.create_backend = original
    assert isinstance(engine.block_manager, HybridBlockManager)
    return engine


def slot(engine: LLMEngine, table: list[int], layer: int, pos: int) -> torch.Tensor:
    """K and V ``[2, Hk, D]`` of position ``pos`` in ``layer``, through the local pages for a
    sliding layer."""
    block = table[pos // BS]
    if layer in engine.kv_cache.local_layers:
        assert isinstance(engine.block_manager, HybridBlockManager)
        block = engine.block_manager.local.page_of[block]
        assert block != NULL_PAGE
    return engine.kv_cache.layers[layer][block, :, pos % BS]


def check_placed_first_layer(engine: LLMEngine, cold: LLMEngine, seq_id: str) -> int:
    """Layer 0's placed KV equals a full computation's (K within fp32 rounding of the
    re-rotation with that layer's frequencies, V bit for bit), on the positions a later query
    can read: all of a global layer's span, a sliding layer's last window of it. Returns the
    positions checked."""
    seq, cold_seq = engine._sequences[seq_id], cold._sequences["cold"]
    table, cold_table = list(seq.table.block_ids), list(cold_seq.table.block_ids)
    inv = engine.chunk_reuse.layer_inv_freqs[0]
    sliding = 0 in engine.kv_cache.local_layers
    checked = 0
    for p in seq.placements:
        lo = max(p.start, p.end - WINDOW + 1) if sliding else p.start
        for pos in sorted({lo, (lo + p.end) // 2, p.end - 1}):
            got, want = slot(engine, table, 0, pos), slot(cold, cold_table, 0, pos)
            assert torch.equal(got[1], want[1]), f"V at {pos} moves unchanged"
            tol = 8 * FP32_EPS * (pos * float(inv.max()) + 1) * float(want[0].abs().max())
            torch.testing.assert_close(got[0], want[0], atol=tol, rtol=0)
            checked += 1
    return checked


def placed_and_cold(
    loaded: LoadedModel, windowed_reference: bool, doc_lens: list[int], repair: int = 4
) -> tuple[LLMEngine, LLMEngine]:
    rag = make_rag(1, loaded.config.vocab_size, doc_lens)
    engine = make_engine(loaded, repair=repair, windowed_reference=windowed_reference)
    run(engine, rag.request("warm", list(range(len(doc_lens))), reuse=True))
    order = list(reversed(range(len(doc_lens))))
    engine.add_request(rag.request("placed", order, reuse=True, max_tokens=2))
    engine.step()  # admission places every chunk
    assert len(engine._sequences["placed"].placements) == len(doc_lens)
    cold = make_engine(loaded, windowed_reference=windowed_reference)
    cold.add_request(rag.request("cold", order, reuse=False, max_tokens=2))
    cold.step()
    return engine, cold


def test_gemma_sliding_layers_shift_keys_by_their_own_rope_base(gemma: LoadedModel) -> None:
    """Layer 0 of the tiny Gemma is a sliding layer (rope base 100, unscaled): the chunks are
    longer than the window, and their placed keys equal the full computation's, which a shift
    by the global layers' frequencies (base 50,000, scaled by 2) would not give."""
    engine, cold = placed_and_cold(gemma, False, [70, 53, 90])
    freqs = engine.chunk_reuse.layer_inv_freqs
    assert not torch.equal(freqs[0], freqs[1])  # layer 1 is global
    assert check_placed_first_layer(engine, cold, "placed") >= 6
    # and the wrong frequencies would have been caught
    seq, cold_seq = engine._sequences["placed"], cold._sequences["cold"]
    p = seq.placements[-1]
    pos = p.end - 1
    stored = slot(engine, list(seq.table.block_ids), 0, pos)[0]
    back = shift_keys(stored, *shift_rotation(freqs[0], -p.delta))  # where it was computed
    wrong = shift_keys(back, *shift_rotation(freqs[1], p.delta))
    want = slot(cold, list(cold_seq.table.block_ids), 0, pos)[0]
    assert (wrong - want).abs().max() > 1e-3


@pytest.mark.parametrize("first_sliding", [False, True], ids=["global-first", "sliding-first"])
def test_placed_first_layer_kv_on_either_layer_group(
    demo: LoadedModel, first_sliding: bool
) -> None:
    loaded = windowed_demo(demo, first_sliding)
    engine, cold = placed_and_cold(loaded, True, [70, 53, 90])
    assert check_placed_first_layer(engine, cold, "placed") >= 6


prompt_shapes = st.tuples(
    st.lists(st.integers(17, 90), min_size=2, max_size=3),  # document lengths
    st.integers(0, 2**16),  # seed
    st.integers(1, 40),  # system tokens
)


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shape=prompt_shapes, data=st.data())
def test_gemma_repair_covering_whole_chunks_equals_full_recomputation(
    gemma: LoadedModel, shape: tuple[list[int], int, int], data: st.DataObject
) -> None:
    lens, seed, system = shape
    rag = make_rag(seed, gemma.config.vocab_size, lens, system)
    order = data.draw(st.permutations(range(len(lens))))
    engine = make_engine(gemma, repair=max(lens))
    run(engine, rag.request("warm", list(range(len(lens))), reuse=True))
    reused = run(engine, rag.request("reuse", list(order), reuse=True))
    assert reused.usage.reused_tokens == 0
    cold = run(make_engine(gemma), rag.request("cold", list(order), reuse=False))
    assert_same_outputs(engine, reused, cold)


def test_gemma_placed_chunks_are_served_reported_and_leave_cold_outputs(
    gemma: LoadedModel,
) -> None:
    """Placed chunks are reported as such and change the outputs; a request without the
    flag afterwards gets the cold outputs; the local pages of a long generation after a
    placed prompt slide out of the window as a plain request's do."""
    rag = make_rag(5, gemma.config.vocab_size, [64, 80, 48])
    engine = make_engine(gemma, repair=4)
    run(engine, rag.request("warm", [0, 1, 2], reuse=True))
    placed = run(engine, rag.request("placed", [2, 0, 1], reuse=True, max_tokens=40))
    served = {s.tag: s.served for s in placed.usage.segments}
    assert {served[f"doc:{d}"] for d in range(3)} == {"reused_anywhere"}
    assert placed.usage.reused_tokens > 100
    cold_engine = make_engine(gemma)
    cold = run(cold_engine, rag.request("cold", [2, 0, 1], reuse=False, max_tokens=40))
    assert outputs(placed) != outputs(cold)  # placed KV is approximate
    after = run(engine, rag.request("after", [2, 0, 1], reuse=False, max_tokens=40))
    assert_same_outputs(engine, after, cold)
    stats = engine.block_manager.stats()
    assert stats.num_local_held == 0


def test_gemma_long_decode_after_placement_holds_only_its_window(gemma: LoadedModel) -> None:
    """Placed KV is never committed, yet a placed sequence's blocks still slide out of the
    window: its held local pages stay within a window's worth while it decodes."""
    rag = make_rag(8, gemma.config.vocab_size, [64, 80])
    engine = make_engine(gemma, repair=4)
    run(engine, rag.request("warm", [0, 1], reuse=True))
    engine.add_request(rag.request("placed", [1, 0], reuse=True, max_tokens=120))
    manager = engine.block_manager
    assert isinstance(manager, HybridBlockManager)
    most = 0
    while engine.has_unfinished:
        engine.step()
        manager.check_invariants()
        seq = engine._sequences.get("placed")
        if seq is not None and seq.num_output_tokens > 0:
            most = max(most, manager.stats().num_local_held)
    assert 0 < most <= -(-(WINDOW - 1) // BS) + 2


def test_hybrid_chunks_are_found_again_and_never_shared(gemma: LoadedModel) -> None:
    rag = make_rag(9, gemma.config.vocab_size, [48, 40], system=24)
    engine = make_engine(gemma, repair=0)
    run(engine, rag.request("a", [0, 1], reuse=True, namespace="t1"))
    computed = engine.chunk_reuse.computed_tokens
    again = run(engine, rag.request("b", [1, 0], reuse=True, namespace="t1"))
    assert engine.chunk_reuse.computed_tokens == computed  # both found in the store
    assert again.usage.reused_tokens > 0
    run(engine, rag.request("c", [1, 0], reuse=True, namespace="t2"))
    assert engine.chunk_reuse.computed_tokens > computed  # another tenant computes its own


def test_chunk_tokens_whose_local_pages_were_taken_are_computed(gemma: LoadedModel) -> None:
    """A stored chunk whose local pages were detached under pressure (an idle page taken by
    another block) is placed only after them; the placed sequence still reads back only KV
    its window holds (no null page: NaN there would reach the logits)."""
    rag = make_rag(12, gemma.config.vocab_size, [90, 70], system=8)
    engine = make_engine(gemma, repair=0)
    for i in engine.kv_cache.local_layers:
        engine.kv_cache.layers[i][0].fill_(float("nan"))
    run(engine, rag.request("warm", [0, 1], reuse=True))
    manager = engine.block_manager
    assert isinstance(manager, HybridBlockManager)
    local = manager.local
    # detach every idle local page behind a chunk's window (as pressure would)
    detached = 0
    for page in list(local._behind):
        block = local.block_of[page]
        local._behind.pop(page)
        local.page_of[block], local.block_of[page] = NULL_PAGE, -1
        local._free.append(page)
        detached += 1
    assert detached > 0
    manager.check_invariants()
    result = run(engine, rag.request("placed", [1, 0], reuse=True))
    assert all(torch.isfinite(torch.tensor([lp.logprob for lp in result.logprobs])))
    assert result.usage.reused_tokens > 0
