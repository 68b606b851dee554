"""GGUF weights kept quantized (``--gguf-weights``): the embedding gives the dequantizing
loader's rows bit for bit, the logits stay within bf16 error of the dequantized model, the
mode is in the fingerprint, and greedy answers through the engine do not depend on caching,
chunking or batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gguf import PROMPT, Q, demo_vocab, random_checkpoint, run_logits, write_gguf  # noqa: E402

from prefixcache.engine.config import EngineConfig  # noqa: E402
from prefixcache.engine.engine import LLMEngine  # noqa: E402
from prefixcache.engine.kernels import cpu_gemm, cpu_layer_ops, cpu_qgemm  # noqa: E402
from prefixcache.engine.kernels.linear import Gemm  # noqa: E402
from prefixcache.engine.model import gguf_weights  # noqa: E402
from prefixcache.engine.model.llama import _Concat, fused_projection  # noqa: E402
from prefixcache.engine.model.loader import ModelLoadError, load_model  # noqa: E402
from prefixcache.engine.model.quantized_linear import QEmbedding, QLinear  # noqa: E402
from prefixcache.engine.request import EngineRequest, SamplingParams  # noqa: E402

REASON = cpu_qgemm.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU quantized GEMM: {REASON}")
# the model dtypes the kernel computes here (bf16 on AVX512_BF16, fp32 on AVX2 + FMA)
DTYPES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            REASON is not None or not cpu_qgemm.computes(getattr(torch, name)),
            reason=f"{name}: {REASON or cpu_qgemm.dtype_reason(getattr(torch, name))}",
        ),
    )
    for name in ("bfloat16", "float32")
]


@pytest.fixture(scope="module", params=[Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K], ids=lambda q: q.name)
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"q-{request.param.name}")
    model = random_checkpoint(folder, len(demo_vocab()[0]), tied=request.param != Q.Q4_1)
    path = folder / "tiny.gguf"
    write_gguf(path, model, request.param)
    return path


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_model_matches_the_dequantized_one(gguf_file: Path, dtype: str) -> None:
    quant = load_model(str(gguf_file), dtype=dtype, device="cpu", gguf_weights="quantized")
    dequant = load_model(str(gguf_file), dtype=dtype, device="cpu", gguf_weights="dequantized")
    exact = load_model(str(gguf_file), dtype="float32", device="cpu")  # default: dequantized
    model = quant.model
    assert isinstance(model.model.embed_tokens, QEmbedding)
    assert isinstance(model.lm_head, QLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, QLinear)
    assert not any(name.endswith("proj.weight") for name in model.state_dict())
    assert not isinstance(exact.model.lm_head, QLinear)
    assert quant.fingerprint != dequant.fingerprint == exact.fingerprint
    if quant.config.tie_word_embeddings:  # one packing for both
        assert model.lm_head.qweight is model.model.embed_tokens.qweight
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(ids), dequant.model.model.embed_tokens(ids))
    ref = run_logits(exact, PROMPT)
    scale = ref.abs().max()
    unprepared = run_logits(quant, PROMPT)
    model.prepare()
    assert model.fused_ops == cpu_layer_ops.computes(getattr(torch, dtype))
    assert isinstance(model.model.layers[0].self_attn.qkv, cpu_qgemm.QuantizedLinear)
    prepared = run_logits(quant, PROMPT)
    assert torch.equal(prepared, unprepared)  # fusing changes no element's arithmetic
    dequant.model.prepare()
    same_dtype = run_logits(dequant, PROMPT)
    err_quant = ((prepared - ref).abs().max() / scale).item()
    err_dequant = ((same_dtype - ref).abs().max() / scale).item()
    if dtype == "bfloat16":  # bf16 activations either way: no further from float32 than bf16
        assert err_quant < max(3e-2, 1.5 * err_dequant), (err_quant, err_dequant)
        assert (prepared.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    else:  # fp32: s * sum(x q) against sum(x (s q)), fp32 rounding apart
        assert err_quant < 1e-4, err_quant
        assert torch.equal(prepared.argmax(-1), ref.argmax(-1))


def test_modes_resolve_where_they_can_run(gguf_file: Path) -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        runs = cpu_qgemm.computes(dtype)
        assert gguf_weights.resolve_mode("auto", dtype, cpu) == runs
        assert not gguf_weights.resolve_mode("dequantized", dtype, cpu)
        if runs:
            assert gguf_weights.resolve_mode("quantized", dtype, cpu)
        else:
            with pytest.raises(ValueError, match="--gguf-weights quantized"):
                gguf_weights.resolve_mode("quantized", dtype, cpu)
    with pytest.raises(ValueError, match="float16"):
        gguf_weights.resolve_mode("quantized", torch.float16, cpu)
    with pytest.raises((ValueError, ModelLoadError)):
        load_model(str(gguf_file), dtype="bfloat16", device="cpu", gguf_weights="int4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_projections_fall_back_to_one_kernel_each(gguf_file: Path, dtype: str) -> None:
    loaded = load_model(str(gguf_file), dtype=dtype, device="cpu", gguf_weights="quantized")
    attn = loaded.model.model.layers[0].self_attn
    plain = torch.nn.Linear(attn.k_proj.in_features, 16, bias=False).to(getattr(torch, dtype))
    mixed = fused_projection((attn.q_proj, plain), batch_invariant=True)
    assert isinstance(mixed, _Concat)
    x = torch.randn(3, attn.q_proj.in_features).to(getattr(torch, dtype))
    want = torch.cat([attn.q_proj(x), Gemm(plain.weight, None)(x)], dim=1)
    assert torch.equal(mixed(x), want)
    if cpu_gemm.available():
        assert isinstance(mixed.linears[1], Gemm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_answers_do_not_depend_on_cache_chunks_or_batch(gguf_file: Path, dtype: str) -> None:
    loaded = load_model(str(gguf_file), dtype=dtype, device="cpu", gguf_weights="quantized")
    assert isinstance(loaded.model.lm_head, QLinear)
    shared = [(7 * i + 3) % 2000 + 3 for i in range(70)]
    prompts = [shared + [(11 * i + j) % 1900 + 5 for j in range(5 + 3 * i)] for i in range(4)]

    def run(batched: bool, **overrides: object) -> list[list[int]]:
        config = EngineConfig(model=str(gguf_file), num_blocks=256, block_size=16)
        for key, value in overrides.items():
            setattr(config, key, value)
        eng = LLMEngine(config, loaded=loaded)
        reqs = [
            EngineRequest(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        if batched:
            return [r.token_ids for r in eng.generate(reqs)]
        return [eng.generate([r])[0].token_ids for r in reqs]

    cold = run(False, enable_prefix_caching=False)
    assert run(False) == cold  # the shared part cached after the first request
    assert run(False, max_num_batched_tokens=24, enable_prefix_caching=False) == cold
    assert run(True) == cold
