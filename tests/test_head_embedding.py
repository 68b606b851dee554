"""A tied embedding read from the LM head's packed copy (``PackedLinear.weight_rows``,
``quantized_linear.embed_from_head``): the rows are the table's to the bit, whatever the
packing (bf16 or fp32 panels, Q8 or Q6_K blocks), the table itself is let go at
``prepare()``, and the model's logits are those of the same model that kept it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.kernels import cpu_gemm
from prefixcache.engine.model import llama
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.quantized_linear import HeadEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_gemm.available(), reason="the batch-invariant GEMM does not load here"
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 150),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    picks=st.lists(st.integers(0, 10**6), max_size=80),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_panels_give_back_the_weights_rows(
    n: int, k: int, dtype: torch.dtype, picks: list[int], threads: int, seed: int
) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    packed = cpu_gemm.PackedLinear(w, None, float_out=True)
    assert packed.gives_rows
    ids = torch.tensor([p % n for p in picks], dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(packed.weight_rows(ids), w[ids])
        assert torch.equal(packed.weight_rows(torch.arange(n).view(-1, 1)), w.view(n, 1, k))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("form", ["q8", "q6_k", "q4_k"])
@pytest.mark.parametrize(("n", "k"), [(1000, 640), (33, 64), (5, 2048)])
def test_blocks_give_back_the_dequantized_rows(form: str, n: int, k: int) -> None:
    """Q8 blocks (Q8_0, Q5_0) and Q6_K's give bf16(q * scale), the weight they were checked
    to be; 4-bit blocks on AMX give none (the table stays); without AMX the panels kept beside
    the blocks give every form's rows."""
    test_cpu_amx = pytest.importorskip("test_cpu_amx")
    source, w = test_cpu_amx.block_source(n, k, n + k, form)
    packed = cpu_gemm.PackedLinear.from_blocks(w, None, source, float_out=True)
    if packed is None:
        pytest.skip("GGUF blocks run on AMX or AVX-512 BF16 only")
    assert packed.kernel != "avx512" or packed.few_rows_kernel is not None
    if form == "q4_k" and packed.kernel != "avx512":
        assert not packed.gives_rows
        with pytest.raises(ValueError, match="does not give"):
            packed.weight_rows(torch.tensor([0]))
        return
    assert packed.gives_rows
    ids = torch.from_numpy(np.random.default_rng(k).integers(0, n, size=300))
    assert torch.equal(packed.weight_rows(ids), w[ids])
    assert torch.equal(packed.weight_rows(torch.arange(n)), w)


def test_rows_outside_the_weight_are_refused() -> None:
    packed = cpu_gemm.PackedLinear(torch.randn(10, 8).bfloat16(), None)
    for bad in ([10], [-1], [0, 3, 11]):
        with pytest.raises(IndexError, match="outside"):
            packed.weight_rows(torch.tensor(bad))
    assert packed.weight_rows(torch.tensor([], dtype=torch.int64)).shape == (0, 8)


def logits(model: llama.LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    test_model_prepare = pytest.importorskip("test_model_prepare")
    with torch.inference_mode():
        hidden = model(ids, torch.arange(ids.numel()), test_model_prepare.causal_attend)
        return model.compute_logits(hidden)


def kept_table(path: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> llama.LlamaForCausalLM:
    """The model at ``path`` prepared with its embedding table kept."""
    model = load_model(path, dtype=dtype, device="cpu").model
    with monkeypatch.context() as m:
        m.setattr(llama, "embed_from_head", lambda model: False)
        model.prepare()
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    return model


def assert_reads_the_head(path: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(path, dtype=dtype, device="cpu").model
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table  # tied
    values, gone = table.detach().clone(), weakref.ref(table)
    names = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    del table
    model.prepare()
    embedding = model.model.embed_tokens
    assert isinstance(embedding, HeadEmbedding)
    gc.collect()
    assert gone() is None  # nothing holds the table any more
    assert embedding.weight.device.type == model.lm_head.weight.device.type == "meta"
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == names
    every = torch.arange(values.shape[0])
    assert torch.equal(embedding(every), values)
    ids = torch.randint(0, values.shape[0], (31,), generator=torch.Generator().manual_seed(5))
    want = kept_table(path, dtype, monkeypatch)
    assert torch.equal(logits(model, ids), logits(want, ids))
    assert torch.equal(logits(model, ids[:1]), logits(want, ids[:1]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_model_reads_its_embedding_from_the_head_panels(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_reads_the_head("demo", dtype, monkeypatch)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_a_gguf_model_reads_its_embedding_from_the_heads_blocks(
    tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    test_gguf = pytest.importorskip("test_gguf")
    checkpoint = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=True)
    path = tmp_path / "tiny.gguf"
    test_gguf.write_gguf(path, checkpoint, getattr(test_gguf.Q, qtype))
    model = load_model(str(path), dtype="bfloat16", device="cpu").model
    model.prepare()
    if model.head.invariant.kernel != "q8_amx":
        pytest.skip("GGUF blocks run on AMX only (the panels case is tested above)")
    assert_reads_the_head(str(path), "bfloat16", monkeypatch)


def test_an_untied_head_leaves_the_embedding_alone(tmp_path: Path) -> None:
    test_gguf = pytest.importorskip("test_gguf")
    checkpoint = test_gguf.random_checkpoint(tmp_path, len(test_gguf.demo_vocab()[0]), tied=False)
    path = tmp_path / "untied.gguf"
    test_gguf.write_gguf(path, checkpoint, test_gguf.Q.Q8_0)
    model = load_model(str(path), dtype="bfloat16", device="cpu").model
    model.prepare()
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert model.model.embed_tokens.weight.device.type == "cpu"
