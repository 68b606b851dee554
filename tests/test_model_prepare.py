"""``LlamaForCausalLM.prepare()`` (fused QKV and gate/up GEMMs, pre-packed bf16 weights) changes
how the model computes, never what: outputs equal the unprepared model's bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixcache.engine.model.loader import load_model


def causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    qh, kh, vh = (
        t.transpose(0, 1) for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    )
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepared_model_computes_the_same_bits(dtype: str) -> None:
    loaded = load_model("demo", dtype=dtype, device="cpu")
    model = loaded.model
    assert not model.prepared  # the loader hands out an unprepared model
    ids = torch.randint(
        0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
    )
    positions = torch.arange(37)
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions, causal_attend))
        q_weight = model.model.layers[0].self_attn.q_proj.weight.clone()
        # torch's GEMMs: fusing and pre-packing change no bit (the batch-invariant kernel,
        # the default, sums in its own order: see the test below)
        model.prepare(batch_invariant=False)
        model.prepare(batch_invariant=False)  # idempotent
        after = model.compute_logits(model(ids, positions, causal_attend))
    assert torch.equal(before, after)
    # the checkpoint's parameter names still hold the checkpoint's values
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_weight)
    assert set(model.state_dict()) == set(load_model("demo", dtype=dtype).model.state_dict())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_prepare_stays_close_to_torch(dtype: str) -> None:
    """The default ``prepare()`` (the batch-invariant GEMM where it loads) sums each dot
    product in its own order: the logits stay within rounding of torch's."""
    loaded = load_model("demo", dtype=dtype, device="cpu")
    model = loaded.model
    ids = torch.randint(
        0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(2)
    )
    positions = torch.arange(37)
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions, causal_attend))
        model.prepare()
        after = model.compute_logits(model(ids, positions, causal_attend))
    tol = 1e-4 if dtype == "float32" else 0.15
    torch.testing.assert_close(after, before, atol=tol, rtol=tol)


def test_the_invariant_prepare_frees_the_layer_weights_it_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch-invariant GEMMs pack their own copy, so ``prepare()`` lets the layer weights
    go (meta tensors of the same names, shapes and dtypes, whose values raise when read; the
    tied embedding's rows then come from the head's packing: tests/test_head_embedding.py),
    and the logits are the bits of the same model that kept them."""
    from prefixcache.engine.kernels import cpu_gemm
    from prefixcache.engine.model import llama

    if not cpu_gemm.available():
        pytest.skip("the batch-invariant GEMM does not load here")
    ids = torch.randint(0, 500, (29,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(29)
    kept = load_model("demo", dtype="bfloat16", device="cpu").model
    with monkeypatch.context() as m:
        m.setattr(llama, "release_weights", lambda linears, projection: None)
        m.setattr(llama, "embed_from_head", lambda model: False)
        kept.prepare()
    model = load_model("demo", dtype="bfloat16", device="cpu").model
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    embedding = model.model.embed_tokens.weight.clone()
    model.prepare()
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    layer = model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert lin.weight.device.type == "meta" and lin.weight.dtype == torch.bfloat16
        with pytest.raises((RuntimeError, NotImplementedError)):
            lin.weight.float().sum().item()  # an error, never a read of freed memory
    assert kept.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    assert model.fused_ops == kept.fused_ops
    assert torch.equal(model.model.embed_tokens(torch.arange(embedding.shape[0])), embedding)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, causal_attend))
        want = kept.compute_logits(kept(ids, positions, causal_attend))
    assert torch.equal(ours, want)
