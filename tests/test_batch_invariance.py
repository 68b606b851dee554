"""Bitwise cache- and batch-invariance at the default dtype: a position's logits depend only on
the tokens up to it, not on how much came from the cache, where chunked prefill cut, which
requests share the step (prefills, decodes, prefill groups, cascade groups) or the row's place.

Prompts, cached lengths, chunk sizes and companions are drawn by hypothesis; every comparison
is ``torch.equal``, in bf16 (the default here) and fp32. Runs where the CPU has the
batch-invariant kernels (AVX512_BF16); the torch reference backend promises the same math,
not the same bits, and is not checked here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import create_backend, row_kernels
from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
from prefixcache.engine.kernels import cpu_gemm
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BS = 16
NUM_BLOCKS = 640

pytestmark = [
    pytest.mark.skipif(
        row_kernels.load_rows() is None or not cpu_gemm.available(),
        reason=f"no batch-invariant CPU kernels here ({row_kernels.row_unavailable_reason()})",
    ),
    # A hang bound, not a speed bound: emulated bf16 on an AVX2 box beside two busy loops took
    # 212 s for one hypothesis test (68 s quiet), near the suite's 300 s default.
    pytest.mark.timeout(900),
]


@dataclass
class Pages:
    """Fresh, scattered physical blocks for each new sequence."""

    rng: random.Random
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("test pool exhausted")
        out, self.free = self.free[:n], self.free[n:]
        return out


def n_blocks(tokens: int) -> int:
    return -(-tokens // BS)


def runner_for(loaded: LoadedModel, kv_dtype: torch.dtype | None = None) -> ModelRunner:
    cache = KVCache(loaded.kv_cache_spec(BS, kv_dtype), num_blocks=NUM_BLOCKS)
    backend = create_backend("auto", "cpu")
    assert isinstance(backend, CpuKernelBackend)
    runner = ModelRunner(loaded, cache, backend)
    assert backend.batch_invariant
    return runner


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def demo_bf16() -> LoadedModel:
    return load_model("demo", dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def demo_fp32() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A transformers-saved Llama (head dim 64, grouped KV heads)."""
    transformers = pytest.importorskip("transformers")
    import json
    import shutil

    from prefixcache.engine.model.demo_model import ASSETS

    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = Path(tmp_path_factory.mktemp("llama"))
    model.save_pretrained(folder)
    shutil.copy(ASSETS / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    return str(folder)


@pytest.fixture(scope="module")
def hf_llama_bf16(hf_llama_folder: str) -> LoadedModel:
    return load_model(hf_llama_folder, dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def hf_llama_fp32(hf_llama_folder: str) -> LoadedModel:
    return load_model(hf_llama_folder, dtype="float32", device="cpu")


def cold_logits(runner: ModelRunner, pages: Pages, prompt: list[int]) -> torch.Tensor:
    return runner.execute([BatchEntry(prompt, 0, pages.take(n_blocks(len(prompt))))])[0]


def check_variants(
    loaded: LoadedModel,
    seed: int,
    length: int,
    cut: int,
    chunk: int,
    kv_dtype: torch.dtype | None = None,
) -> None:
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    runner = runner_for(loaded, kv_dtype)
    pages = Pages(rng)
    prompt = tokens(rng, length, vocab)
    cut = max(1, min(cut, length - 1))
    cold = cold_logits(runner, pages, prompt)

    # Warm: the first `cut` tokens came from the cache (any cut, block-aligned or not).
    table = pages.take(n_blocks(length))
    runner.execute([BatchEntry(prompt[:cut], 0, table, compute_logits=False)])
    warm = runner.execute([BatchEntry(prompt[cut:], cut, table)])[0]
    assert torch.equal(warm, cold), f"warm (cut {cut}) != cold"

    # Chunked prefill, `chunk` tokens a step.
    table = pages.take(n_blocks(length))
    for start in range(0, length, chunk):
        part = prompt[start : start + chunk]
        last = start + len(part) == length
        out = runner.execute([BatchEntry(part, start, table, compute_logits=last)])
    assert torch.equal(out[0], cold), f"chunked ({chunk}) != cold"

    # Decode: the last token alone over the rest in the cache.
    table = pages.take(n_blocks(length))
    runner.execute([BatchEntry(prompt[:-1], 0, table, compute_logits=False)])
    decoded = runner.execute([BatchEntry(prompt[-1:], length - 1, table)])[0]
    assert torch.equal(decoded, cold), "decode != cold"

    # Batched: the same warm suffix in one step with companions: a cold prefill, another
    # prefill after the same cached blocks (a prefill group), and decodes, two of them
    # sharing a long prefix (a cascade group); the prompt's entry sits at a random place.
    table = pages.take(n_blocks(length))
    runner.execute([BatchEntry(prompt[:cut], 0, table, compute_logits=False)])
    shared_blocks = cut // BS
    entries: list[BatchEntry] = []
    other = tokens(rng, rng.randint(2, 90), vocab)
    entries.append(BatchEntry(other, 0, pages.take(n_blocks(len(other)))))
    if shared_blocks:
        suffix = tokens(rng, rng.randint(2, 40), vocab)
        own = pages.take(n_blocks(shared_blocks * BS + len(suffix)) - shared_blocks)
        entries.append(BatchEntry(suffix, shared_blocks * BS, table[:shared_blocks] + own))
    base = tokens(rng, 16 * rng.randint(4, 8) + rng.randint(0, 15), vocab)
    base_table = pages.take(n_blocks(len(base)))
    runner.execute([BatchEntry(base, 0, base_table, compute_logits=False)])
    common = len(base) // BS
    for _ in range(3):  # decodes whose first `common` blocks are the same pages
        tail = tokens(rng, rng.randint(1, 20), vocab)
        t = base_table[:common] + pages.take(n_blocks(common * BS + len(tail) + 1) - common)
        runner.execute([BatchEntry(tail, common * BS, t, compute_logits=False)])
        entries.append(BatchEntry(tokens(rng, 1, vocab), common * BS + len(tail), t))
    place = rng.randint(0, len(entries))
    entries.insert(place, BatchEntry(prompt[cut:], cut, table))
    batched = runner.execute(entries)[place]
    assert torch.equal(batched, cold), f"batched (place {place} of {len(entries)}) != cold"

    # A decode in a cascade group: the prompt's last token next to decodes that share its
    # leading blocks.
    table = pages.take(n_blocks(length))
    runner.execute([BatchEntry(prompt[:-1], 0, table, compute_logits=False)])
    group = [BatchEntry(prompt[-1:], length - 1, table)]
    lead = (length - 1) // BS
    for _ in range(2):
        tail = tokens(rng, rng.randint(1, 20), vocab)
        t = table[:lead] + pages.take(n_blocks(lead * BS + len(tail) + 1) - lead)
        runner.execute([BatchEntry(tail, lead * BS, t, compute_logits=False)])
        group.append(BatchEntry(tokens(rng, 1, vocab), lead * BS + len(tail), t))
    rng.shuffle(group)
    place = next(i for i, e in enumerate(group) if e.block_table is table)
    assert torch.equal(runner.execute(group)[place], cold), "cascade-grouped decode != cold"


CASES = dict(
    seed=st.integers(0, 2**31),
    length=st.integers(2, 400),
    cut=st.integers(1, 399),
    chunk=st.integers(1, 130),
)
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(**CASES)
def test_demo_model_bf16_is_cache_and_batch_invariant(
    demo_bf16: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(demo_bf16, seed, length, cut, chunk)


@SETTINGS
@given(**CASES)
def test_transformers_llama_bf16_is_cache_and_batch_invariant(
    hf_llama_bf16: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(hf_llama_bf16, seed, length, cut, chunk)


@SETTINGS
@given(**CASES)
def test_demo_model_fp32_is_cache_and_batch_invariant(
    demo_fp32: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(demo_fp32, seed, length, cut, chunk)


@SETTINGS
@given(**CASES)
def test_transformers_llama_fp32_is_cache_and_batch_invariant(
    hf_llama_fp32: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(hf_llama_fp32, seed, length, cut, chunk)


# fp8 pages (--kv-cache-dtype): every variant reads the same rounded K/V, so cold, warm,
# chunked and batched stay bit-equal to each other (fp8 compared with fp8).
@SETTINGS
@given(**CASES)
def test_transformers_llama_bf16_with_fp8_e4m3_pages_is_cache_and_batch_invariant(
    hf_llama_bf16: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(hf_llama_bf16, seed, length, cut, chunk, torch.float8_e4m3fn)


@SETTINGS
@given(**CASES)
def test_demo_model_fp32_with_fp8_e5m2_pages_is_cache_and_batch_invariant(
    demo_fp32: LoadedModel, seed: int, length: int, cut: int, chunk: int
) -> None:
    check_variants(demo_fp32, seed, length, cut, chunk, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n"), [(576, 1728), (1536, 576), (576, 49152 // 8), (64, 96)])
def test_gemm_rows_do_not_depend_on_their_batch(dtype: torch.dtype, k: int, n: int) -> None:
    """Each row's output equals that row computed alone, for every M and offset tried."""
    gen = torch.Generator().manual_seed(k * n)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    gemm = cpu_gemm.PackedLinear(w, bias)
    x = torch.randn(300, k, generator=gen).to(dtype)
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(300)])
    for m in [*range(2, 20), 31, 33, 64, 65, 127, 256, 300]:
        assert torch.equal(gemm(x[:m]), alone[:m]), f"M={m}"
    assert torch.equal(gemm(x[7:250]), alone[7:250])
    ref = x.float() @ w.float().T + bias.float()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gemm(x).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("k", "n"), [(576, 1728), (64, 96), (48, 100)])
def test_gemm_float_out_is_the_sums_the_bf16_output_rounds(k: int, n: int) -> None:
    """The LM head's fp32 logits: the same sums, per row whatever the batch, which the bf16
    output is the rounding of (K = 48 takes the AVX-512 kernel where the others take AMX)."""
    gen = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    rounded, exact = cpu_gemm.PackedLinear(w, bias), cpu_gemm.PackedLinear(w, bias, True)
    assert exact.kernel == rounded.kernel
    x = torch.randn(70, k, generator=gen).bfloat16()
    sums = exact(x)
    assert sums.dtype == torch.float32 and sums.shape == (70, n)
    assert torch.equal(sums.bfloat16(), rounded(x))
    assert not torch.equal(sums, sums.bfloat16().float())  # really unrounded
    for m in (1, 17, 33):
        assert torch.equal(exact(x[:m]), sums[:m])
    assert torch.equal(exact(x[5:9]), sums[5:9])


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**31), length=st.integers(20, 300), chunk=st.integers(16, 96))
def test_engine_logprobs_are_bitwise_equal_cold_reloaded_chunked_and_batched(
    demo_bf16: LoadedModel, seed: int, length: int, chunk: int
) -> None:
    """Through the engine at the default dtype: the greedy tokens and their logprobs of a
    request are the same bits cold, after its prefix was spilled to the host tier and
    reloaded, with chunked prefill, and sent together with other requests."""
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.request import EngineRequest, SamplingParams

    rng = random.Random(seed)
    vocab = demo_bf16.config.vocab_size
    prompt = tokens(rng, length, vocab)
    others = [tokens(rng, rng.randint(5, 120), vocab) for _ in range(3)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)

    def engine(**overrides: object) -> LLMEngine:
        config = EngineConfig(model="demo", device="cpu", num_blocks=96, kv_offload="host:0.05")
        for key, value in overrides.items():
            setattr(config, key, value)
        return LLMEngine(config, demo_bf16)

    def answer(eng: LLMEngine, rid: str, batch: list[list[int]] = ()) -> tuple:  # type: ignore[assignment]
        reqs = [EngineRequest(rid, list(prompt), sampling)]
        reqs += [EngineRequest(f"{rid}-{i}", p, sampling) for i, p in enumerate(batch)]
        result = eng.generate(reqs)[0]
        return result.token_ids, [lp.logprob for lp in result.logprobs], result.usage

    cold_tokens, cold_lps, _ = answer(engine(enable_prefix_caching=False), "cold")
    tiered = engine()
    answer(tiered, "first")
    tiered.evict_all(keep_tier=True)
    tokens_r, lps_r, usage = answer(tiered, "reloaded")
    assert usage.cached_tokens_by_tier is not None and usage.cached_tokens_by_tier["host"] > 0
    assert (tokens_r, lps_r) == (cold_tokens, cold_lps), "reloaded from the tier != cold"
    chunked = engine(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert answer(chunked, "chunked")[:2] == (cold_tokens, cold_lps), "chunked != cold"
    assert answer(engine(), "batched", others)[:2] == (cold_tokens, cold_lps), "batched != cold"
    tiered.close()
