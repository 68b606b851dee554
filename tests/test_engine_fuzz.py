"""Random interleavings of submit / step / abort on small pools: the engine never crashes,
never leaks a block, keeps the pool invariant after every step, and every request ends."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, SamplingParams

BASES = [[7 + i for i in range(40)], [300 + i for i in range(23)]]  # two shared prefixes


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


submit = st.tuples(
    st.just("submit"),
    st.integers(0, len(BASES)),  # which shared prefix (len(BASES): none)
    st.integers(0, 40),  # how much of it
    st.lists(st.integers(3, 2000), min_size=1, max_size=20),  # own suffix
    st.integers(1, 12),  # max_tokens
    st.sampled_from(["", "tenant-b"]),
    st.integers(0, 2),  # priority
)
action = st.one_of(
    submit,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    actions=st.lists(action, min_size=1, max_size=30),
    num_blocks=st.integers(6, 24),
    budget=st.sampled_from([8, 32, 256]),
    caching=st.booleans(),
)
def test_random_workloads_end_clean(loaded, actions, num_blocks, budget, caching) -> None:
    config = EngineConfig(
        model="demo",
        dtype="float32",
        device="cpu",
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        enable_prefix_caching=caching,
    )
    engine = LLMEngine(config, loaded)
    submitted: list[str] = []
    finished: dict[str, str] = {}

    def run_step() -> None:
        for out in engine.step():
            assert out.request_id not in finished, "a request finished twice"
            if out.finished:
                finished[out.request_id] = out.finish_reason
        engine.block_manager.check_invariants()

    for act in actions:
        if act[0] == "submit":
            _, base, keep, suffix, max_tokens, tenant, priority = act
            prompt = (BASES[base][:keep] if base < len(BASES) else []) + suffix
            rid = f"r{len(submitted)}"
            request = EngineRequest(
                rid, prompt, SamplingParams(max_tokens=max_tokens), tenant, priority
            )
            try:
                engine.add_request(request)
            except ValueError:
                continue  # refused cleanly: too long for this pool
            submitted.append(rid)
        elif act[0] == "step":
            for _ in range(act[1]):
                run_step()
        elif submitted:
            rid = submitted[act[1] % len(submitted)]
            out = engine.abort_request(rid)
            if out is not None:
                finished[rid] = out.finish_reason
    for _ in range(2000):
        if not engine.has_unfinished:
            break
        run_step()
    assert not engine.has_unfinished, "the engine stopped making progress"
    assert set(finished) == set(submitted)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
