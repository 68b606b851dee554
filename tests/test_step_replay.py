"""A replayed step (``step/step_replay.py``) gives every logit and every K/V byte of the eager
step, bit for bit: over random schedules of prefill chunks, decodes and shared prefixes
(hypothesis), for Llama, Qwen2 (biases), Qwen3 (q/k norms), GGUF-quantized weights, Gemma 3
(sliding layers on their own pages and backend, GeGLU), Gemma 2 (softcapped attention) and
Llama-family sliding layers; and it stays off, with a reason,
wherever one of its kernels is not the one that would run."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import AttentionBackend, create_backend
from prefixcache.engine.attention.cpu_backend import NUM_REGISTERS, CpuKernelBackend
from prefixcache.engine.attention.torch_backend import TorchBackend
from prefixcache.engine.kernels import cpu_layer_ops, cpu_replay
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.model_config import ModelConfig
from prefixcache.engine.model.registry import causal_lm_class
from prefixcache.engine.step import step_replay
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner
from prefixcache.engine.step.step_replay import StepReplay

BLOCK = 16
REASON = cpu_layer_ops.unavailable_reason()
if REASON is None and not cpu_layer_ops.computes_silu_and_mul(torch.bfloat16):
    REASON = "bf16 layer ops need AVX512_BF16"
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"step replay: {REASON}")


@pytest.fixture(scope="module")
def demo_bf16() -> LoadedModel:
    return load_model("demo", dtype="bfloat16", device="cpu")


def variant(loaded: LoadedModel, model_type: str) -> LoadedModel:
    """The demo's shape as ``model_type`` (qwen2: q/k/v biases; qwen3: q/k norms), random
    weights."""
    config = dataclasses.replace(
        loaded.config, model_type=model_type, attention_bias=model_type == "qwen2"
    )
    return random_model(loaded, config, model_type, seed=1)


def random_model(loaded: LoadedModel, config: ModelConfig, name: str, seed: int) -> LoadedModel:
    """``loaded`` with a bf16 model of ``config``, its weights drawn from N(0, 0.2)."""
    torch.manual_seed(seed)
    model = causal_lm_class(config)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    return dataclasses.replace(loaded, model=model, config=config, fingerprint=name)


WINDOW = 40  # the tiny Gemma's sliding layers: two and a half pages


def tiny_gemma3(demo: LoadedModel, query_pre_attn_scalar: int = 64) -> LoadedModel:
    """A random Gemma 3 of the demo's vocabulary: 6 layers, 5 sliding to 1 global (window
    ``WINDOW``), 4 query heads and 1 KV head of 64, two rope bases, a final softcap."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = ModelConfig.from_dict(
        dict(
            architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
            vocab_size=demo.config.vocab_size, hidden_size=128, intermediate_size=256,
            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=1024, sliding_window=WINDOW, layer_types=kinds,
            query_pre_attn_scalar=query_pre_attn_scalar, rope_theta=1e6,
            rope_local_base_freq=1e4, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        )
    )  # fmt: skip
    return random_model(demo, config, "tiny-gemma3", seed=3)


def tiny_gemma2(demo: LoadedModel) -> LoadedModel:
    """A random Gemma 2 of the demo's vocabulary: 4 layers, every other one sliding (window
    ``WINDOW``), no q/k norms, one rope base, an attention softcap that bites (scores of
    N(0, 0.2) weights reach several units) and a final one."""
    config = ModelConfig.from_dict(
        dict(
            architectures=["Gemma2ForCausalLM"], model_type="gemma2",
            vocab_size=demo.config.vocab_size, hidden_size=128, intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=1024, sliding_window=WINDOW, query_pre_attn_scalar=64,
            attn_logit_softcapping=2.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        )
    )  # fmt: skip
    return random_model(demo, config, "tiny-gemma2", seed=4)


def runner_pair(
    loaded: LoadedModel, blocks: int = 48, pages: torch.dtype | None = None
) -> tuple[ModelRunner, ModelRunner]:
    """Two runners on one model (``pages``: the KV dtype, default the model's): the eager one
    (replay dropped) and the replaying one. A hybrid model's sliding layers get a local page
    per block (``with_local_tables``) and their own backend."""
    runners = []
    local = [i for i, w in enumerate(loaded.config.layer_windows) if w]
    for _ in range(2):
        spec = loaded.kv_cache_spec(BLOCK, kv_dtype=pages)
        cache = KVCache(spec, blocks, blocks if local else 0, local)
        local_backend = create_backend("auto", "cpu") if local else None
        backend = create_backend("auto", "cpu")
        runners.append(ModelRunner(loaded, cache, backend, local_backend=local_backend))
    eager, replayed = runners
    assert replayed.replay is not None, replayed.replay_off_reason
    eager.replay = None
    return eager, replayed


def schedule(seed: int, vocab: int, blocks: int) -> list[list[BatchEntry]]:
    """Steps of prefill chunks and decodes for 1-4 sequences, the second reusing the first's
    leading full pages where it can (so cascade groups form), some steps over ``MAX_TOKENS``
    (the replaying runner takes the eager path there)."""
    rng = random.Random(seed)
    nseq = rng.randint(1, 4)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 110))] for _ in range(nseq)]
    tables, next_block = [], 1
    shared = 0
    for i, prompt in enumerate(prompts):
        need = -(-(len(prompt) + 8) // BLOCK)
        if i == 1 and len(prompts[0]) >= BLOCK and rng.random() < 0.6:
            shared = rng.randint(1, len(prompts[0]) // BLOCK)
            prompt[: shared * BLOCK] = prompts[0][: shared * BLOCK]
            tables.append(tables[0][:shared] + list(range(next_block, next_block + need)))
            next_block += need
            continue
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    assert next_block <= blocks
    done = [shared * BLOCK if i == 1 else 0 for i in range(nseq)]
    decodes = [rng.randint(0, 6) for _ in range(nseq)]
    steps: list[list[BatchEntry]] = []
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)) or any(decodes):
        step = []
        for i, prompt in enumerate(prompts):
            if i == 1 and shared and done[0] < len(prompts[0]):
                continue  # the shared pages are written first
            if done[i] < len(prompt):
                n = rng.randint(1, len(prompt) - done[i])
                tokens = prompt[done[i] : done[i] + n]
            elif decodes[i]:
                decodes[i] -= 1
                tokens = [rng.randrange(3, vocab)]
                prompt.append(tokens[0])
            else:
                continue
            end = done[i] + len(tokens)
            step.append(BatchEntry(tokens, done[i], tables[i], compute_logits=end == len(prompt)))
            done[i] = end
        if step:
            steps.append(step)
    return steps


def assert_same(
    loaded: LoadedModel,
    steps: list[list[BatchEntry]],
    blocks: int = 48,
    pages: torch.dtype | None = None,
) -> int:
    """Run ``steps`` eagerly and replayed: equal logits every step, equal pages at the end.
    Returns how many steps replayed."""
    eager, replayed = runner_pair(loaded, blocks, pages)
    replayed_steps = 0
    for step in steps:
        a, b = eager.execute(step), replayed.execute(step)
        assert torch.equal(a, b), [len(e.token_ids) for e in step]
        replayed_steps += sum(len(e.token_ids) for e in step) <= step_replay.MAX_TOKENS
    for x, y in zip(eager.kv_cache.layers, replayed.kv_cache.layers, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    return replayed_steps


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_replayed_steps_equal_eager_ones(demo_bf16: LoadedModel, seed: int) -> None:
    steps = schedule(seed, demo_bf16.config.vocab_size, 48)
    assert_same(demo_bf16, steps)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    pages=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
)
def test_replayed_steps_equal_eager_ones_on_fp8_pages(
    demo_bf16: LoadedModel, seed: int, pages: torch.dtype
) -> None:
    assert_same(demo_bf16, schedule(seed, demo_bf16.config.vocab_size, 48), pages=pages)


def with_local_tables(steps: list[list[BatchEntry]]) -> list[list[BatchEntry]]:
    """Each entry's local table: block b's local page is b (every page kept; the kernel reads
    only the window's)."""
    return [[dataclasses.replace(e, local_table=list(e.block_table)) for e in s] for s in steps]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_gemma3_replays_exactly(demo_bf16: LoadedModel, seed: int) -> None:
    """Sliding layers over their local pages and backend (registers after the global one's),
    global ones over the blocks, GeGLU, the embedding scale and two rope bases: every logit
    and page byte of the eager step; prompts up to 110 tokens cross the 40-token window."""
    loaded = tiny_gemma3(demo_bf16)
    steps = with_local_tables(schedule(seed, loaded.config.vocab_size, 48))
    assert_same(loaded, steps)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_gemma2_replays_exactly(demo_bf16: LoadedModel, seed: int) -> None:
    """No q/k norms, one rope base, and the attention softcap inside the recorded kernel."""
    loaded = tiny_gemma2(demo_bf16)
    steps = with_local_tables(schedule(seed, loaded.config.vocab_size, 48))
    assert assert_same(loaded, steps) > 0


def test_gemma_with_its_own_attention_scale_replays_exactly(demo_bf16: LoadedModel) -> None:
    """query_pre_attn_scalar != head_dim (Gemma 2 / 3 27B): the scale is the backends'
    argument, recorded like any other."""
    loaded = tiny_gemma3(demo_bf16, query_pre_attn_scalar=48)
    steps = with_local_tables(schedule(11, loaded.config.vocab_size, 48))
    assert assert_same(loaded, steps) > 0


def whole_last_layer(mp: pytest.MonkeyPatch) -> None:
    """The last layer's attention over every row, its logits rows picked after (eager and
    replayed), as before ``forward_rows``."""
    mp.setattr(CpuKernelBackend, "forward_rows", AttentionBackend.forward_rows)
    forward = StepReplay.forward

    def whole(self, input_ids, positions, rows=None):  # type: ignore[no-untyped-def]
        hidden = forward(self, input_ids, positions)
        return hidden if rows is None else hidden.index_select(0, rows)

    mp.setattr(StepReplay, "forward", whole)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), gemma=st.booleans())
def test_the_last_layer_on_its_logits_rows_alone_gives_the_whole_steps_bits(
    demo_bf16: LoadedModel, seed: int, gemma: bool
) -> None:
    """Only the rows whose logits are read attend in the last layer (none in a chunk that
    samples nothing), eager and replayed (two programs around the gather): every logit and
    page byte of the step whose last layer attends every row."""
    loaded = tiny_gemma3(demo_bf16) if gemma else demo_bf16
    steps = schedule(seed, loaded.config.vocab_size, 48)
    steps = with_local_tables(steps) if gemma else steps
    kept = runner_pair(loaded)
    with pytest.MonkeyPatch.context() as mp:
        whole_last_layer(mp)
        whole = runner_pair(loaded)
        expected = [(whole[0].execute(step), whole[1].execute(step)) for step in steps]
    for step, (a, b) in zip(steps, expected, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(kept[0].execute(step), a)
        assert torch.equal(kept[1].execute(step), a)
    for runner in (*kept, whole[1]):
        for x, y in zip(whole[0].kv_cache.layers, runner.kv_cache.layers, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_gemma3_replays_at_all(demo_bf16: LoadedModel) -> None:
    loaded = tiny_gemma3(demo_bf16)
    steps = with_local_tables(schedule(5, loaded.config.vocab_size, 48))
    assert assert_same(loaded, steps) > 0
    _, replayed = runner_pair(loaded)
    replayed.execute(steps[0])
    assert replayed.replay is not None
    ((key, programs),) = replayed.replay._programs.items()
    past_write = not (len(key) == 3 and key[2] == 0)  # a chunk with logits to give
    assert sum(p.kinds.count(cpu_replay.GELU) for p in programs) == 5 + past_write
    assert programs[0].num_registers == 2 * NUM_REGISTERS  # the local backend's follow


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), every_layer=st.booleans())
def test_sliding_llama_layers_replay_exactly(
    demo_bf16: LoadedModel, seed: int, every_layer: bool
) -> None:
    """Mistral (every layer slides) and Qwen2 with ``use_sliding_window`` (the layers from
    ``max_window_layers`` on): the sliding layers attend through the local backend, windowed."""
    n = demo_bf16.config.num_layers
    windows = tuple(WINDOW if every_layer or i >= n // 2 else 0 for i in range(n))
    config = dataclasses.replace(demo_bf16.config, layer_windows=windows)
    loaded = random_model(demo_bf16, config, f"sliding-{every_layer}", seed=2)
    assert assert_same(loaded, with_local_tables(schedule(seed, config.vocab_size, 48))) > 0


def test_nope_layers_replay_exactly(demo_bf16: LoadedModel) -> None:
    """SmolLM3's layers without RoPE: no rotary call recorded for them, the same bits."""
    n = demo_bf16.config.num_layers
    rope = tuple(i % 2 == 0 for i in range(n))
    config = dataclasses.replace(demo_bf16.config, model_type="smollm3", rope_layers=rope)
    loaded = random_model(demo_bf16, config, "nope", seed=6)
    assert assert_same(loaded, schedule(8, config.vocab_size, 48)) > 0
    _, replayed = runner_pair(loaded)
    replayed.execute(schedule(8, config.vocab_size, 48)[0])
    (programs,) = replayed.replay._programs.values()
    assert sum(p.kinds.count(cpu_replay.ROTARY) for p in programs) == sum(rope)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_biases_and_qk_norms_replay_exactly(demo_bf16: LoadedModel, model_type: str) -> None:
    loaded = variant(demo_bf16, model_type)
    steps = schedule(7, loaded.config.vocab_size, 48) + schedule(11, loaded.config.vocab_size, 48)
    assert assert_same(loaded, steps[: len(steps) // 2]) > 0


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantized_weights_replay_exactly(tmp_path: Path, qtype: str) -> None:
    test_gguf = pytest.importorskip("test_gguf")
    folder = tmp_path / qtype
    folder.mkdir()
    model = test_gguf.random_checkpoint(folder, len(test_gguf.demo_vocab()[0]), tied=True)
    path = folder / "tiny.gguf"
    test_gguf.write_gguf(path, model, getattr(test_gguf.Q, qtype))
    loaded = load_model(str(path), dtype="bfloat16", device="cpu", gguf_weights="quantized")
    assert assert_same(loaded, schedule(3, loaded.config.vocab_size, 48)) > 0


def test_programs_are_recorded_per_token_and_thread_count(
    demo_bf16: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_replay, "MAX_PROGRAMS", 3)
    eager, replayed = runner_pair(demo_bf16)
    threads = torch.get_num_threads()
    steps = [
        [BatchEntry([5, 6, 7], 0, [1])],
        [BatchEntry([8], 3, [1])],
        [BatchEntry([9], 4, [1])],  # the 1-token program again
        [BatchEntry([10, 11], 5, [1])],  # on one thread
        [BatchEntry([12, 13, 14, 15], 7, [1])],  # the least recently used (3 tokens) goes
    ]
    try:
        for i, step in enumerate(steps):
            torch.set_num_threads(1 if i >= 3 else threads)
            assert torch.equal(eager.execute(step), replayed.execute(step))
    finally:
        torch.set_num_threads(threads)
    assert replayed.replay is not None
    # a prefill's programs stop at the last layer's K/V write (then its one logits row's)
    assert list(replayed.replay._programs) == [(1, threads), (2, 1, 1), (4, 1, 1)]


def test_replay_stays_off_where_a_kernel_would_differ(
    demo_bf16: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def reason(loaded: LoadedModel, backend: str = "auto", pages: torch.dtype | None = None):
        cache = KVCache(loaded.kv_cache_spec(BLOCK, kv_dtype=pages), 8)
        runner = ModelRunner(loaded, cache, create_backend(backend, "cpu"))
        assert (runner.replay is None) == (runner.replay_off_reason is not None)
        return runner.replay_off_reason

    assert reason(demo_bf16) is None
    gemma = tiny_gemma3(demo_bf16, query_pre_attn_scalar=48)
    local = [i for i, w in enumerate(gemma.config.layer_windows) if w]
    cache = KVCache(gemma.kv_cache_spec(BLOCK), 8, 8, local)
    runner = ModelRunner(gemma, cache, create_backend("auto", "cpu"), local_backend=TorchBackend())
    assert runner.replay is None and "torch" in (runner.replay_off_reason or "")
    runner = ModelRunner(  # query_pre_attn_scalar != head_dim: the backends' scale, replayed
        gemma, cache, create_backend("auto", "cpu"), local_backend=create_backend("auto", "cpu")
    )
    assert runner.replay_off_reason is None and runner.shape.scale == 48**-0.5
    assert "float32" in reason(load_model("demo", dtype="float32", device="cpu"))
    assert reason(demo_bf16, pages=torch.float8_e4m3fn) is None  # fp8 pages replay too
    assert "torch" in reason(demo_bf16, backend="torch")
    monkeypatch.setenv("PREFIXCACHE_STEP_REPLAY", "0")
    assert "PREFIXCACHE_STEP_REPLAY" in reason(demo_bf16)


def test_a_failing_call_stops_the_program_with_its_index(demo_bf16: LoadedModel) -> None:
    _, replayed = runner_pair(demo_bf16)
    replayed.execute([BatchEntry([5, 6, 7], 0, [1])])
    assert replayed.replay is not None
    program = replayed.replay._programs[(3, torch.get_num_threads(), 1)][0]
    bad = torch.full((3,), 1 << 40, dtype=torch.int64)  # K rows far outside the pages
    registers = list(replayed.backend.step_registers())  # type: ignore[attr-defined]
    registers[-1] = bad.data_ptr()
    with pytest.raises(ValueError, match=rf"call 3 \(kind {cpu_replay.WRITE_KV}\) returned 1"):
        program.run(registers)


def test_float_arguments_are_encoded_as_ctypes_would_pass_them() -> None:
    assert cpu_replay._word(1, cpu_replay.NORM, 9) == 0x3F800000  # an int eps: 1.0f
    assert cpu_replay._word(0.5, cpu_replay.ATTEND, 16) == 0x3F000000
    assert cpu_replay._word(7, cpu_replay.NORM, 8) == 7
    with pytest.raises(TypeError, match="is a float"):
        cpu_replay._word(None, cpu_replay.ROTARY, 15)
    with pytest.raises(TypeError, match="integer or address"):
        cpu_replay._word(0.5, cpu_replay.NORM, 8)


def test_a_model_switched_to_torchs_ops_steps_eagerly(demo_bf16: LoadedModel) -> None:
    _, replayed = runner_pair(demo_bf16)
    assert replayed.replay is not None
    replayed.execute([BatchEntry([5, 6, 7], 0, [1])])
    recorded = dict(replayed.replay._programs)
    demo_bf16.model.set_fused_ops(False)
    try:
        replayed.execute([BatchEntry([8, 9], 3, [1])])  # would record a 2-token program
    finally:
        demo_bf16.model.set_fused_ops(True)
    assert dict(replayed.replay._programs) == recorded
