"""The fused CPU layer ops give torch's unfused results bit for bit, in each dtype they compute
here (bf16 on AVX512_BF16, fp32 on AVX2 + FMA too), and the decoder's fused-residual
restructure leaves the torch path's results as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layer_ops_cases import DTYPES, REASON, rand

from prefixcache.engine.kernels import cpu_layer_ops
from prefixcache.engine.model import layer_ops, llama
from prefixcache.engine.model.model_config import ModelConfig

needs_bf16_silu = pytest.mark.skipif(
    REASON is not None or not cpu_layer_ops.computes_silu_and_mul(torch.bfloat16),
    reason=f"CPU layer ops' SiLU-and-mul (bf16, AVX512_BF16): {REASON or 'not this build'}",
)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def test_unavailable_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_CPU_KERNELS", "0")
    assert cpu_layer_ops.unavailable_reason() == "PREFIXCACHE_CPU_KERNELS=0"
    monkeypatch.delenv("PREFIXCACHE_CPU_KERNELS")
    avx2_only = "flags\t\t: fpu sse2 avx avx2 fma\n"
    assert "avx512_bf16" in (cpu_layer_ops.unavailable_reason(avx2_only) or "")


SHAPES = [(1, 512), (7, 512), (33, 64), (5, 100), (3, 200), (64, 896), (2, 4096), (1, 5000)]
SHAPES += [(2049, 512), (300, 2048)]  # over the parallel threshold


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_rms_norm_is_torchs_bit_for_bit(rows: int, cols: int, dtype: torch.dtype) -> None:
    """Odd row counts, hidden sizes off multiples of 8/16/32 (the sum's ragged tails), long
    rows (the sum's ladder of levels), the parallel path; a strided input."""
    wide = rand(rows, cols + 24, seed=rows * cols, scale=3.0, dtype=dtype)
    x = wide[:, 5 : 5 + cols]  # rows strided, as a slice of a wider tensor
    weight = rand(cols, seed=cols, dtype=dtype)
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5))
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_shorter_than_a_vector_sum_in_torchs_order(dtype: torch.dtype) -> None:
    """Below 8 columns torch's sum takes four scalar accumulators, not the vector ladder: every
    width 1..17 over many rows (hypothesis seldom draws these widths)."""
    for cols in range(1, 18):
        x = rand(256, cols, seed=cols, scale=30.0, dtype=dtype)
        weight = rand(cols, seed=cols + 1, dtype=dtype)
        assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_fused_add_rms_norm_is_torchs_add_then_norm(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    x = rand(rows, cols, seed=1, scale=2.0, dtype=dtype)
    residual = rand(rows, cols, seed=2, scale=5.0, dtype=dtype)
    weight = rand(cols, seed=3, dtype=dtype)
    want_sum = residual + x
    want = torch_rms_norm(want_sum, weight, 1e-5)
    out, new_residual = cpu_layer_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, want_sum)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "d"),
    [
        (1, 8, 2, 64),
        (37, 8, 2, 64),
        (5, 4, 4, 128),
        (3, 12, 2, 32),
        (9, 3, 1, 80),
        (2048, 8, 2, 64),
    ],
)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_in_place_is_rotate_half_bit_for_bit(
    tokens: int, hq: int, hk: int, d: int, qk_norm: bool, dtype: torch.dtype
) -> None:
    """q and k as views of one fused qkv output (the engine's layout), head dims whose halves
    are not a multiple of 16, llama3-scaled frequencies at long positions; with Qwen3's
    per-head q/k RMSNorm first (torch: a norm over each head, then the rotation)."""
    config = ModelConfig.from_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=hq * d,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=hq,
            num_key_value_heads=hk,
            head_dim=d,
            vocab_size=32,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, original_max_position_embeddings=8192
            ),
        )
    )
    positions = torch.randint(0, 100_000, (tokens,), generator=torch.Generator().manual_seed(d))
    cos, sin = llama.RotaryEmbedding(config)(positions, dtype)
    qkv = rand(tokens, (hq + 2 * hk) * d, seed=tokens, scale=2.0, dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    norms = (rand(d, seed=d + 1, dtype=dtype), rand(d, seed=d + 2, dtype=dtype), 1e-6)
    norms = norms if qk_norm else None
    want_q, want_k = q, k
    if norms is not None:
        want_q, want_k = torch_rms_norm(q, norms[0], 1e-6), torch_rms_norm(k, norms[1], 1e-6)
    want_q, want_k = layer_ops._rotate(want_q, cos, sin), layer_ops._rotate(want_k, cos, sin)
    cpu_layer_ops.rotary_(q, k, cos, sin, norms)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v untouched"


def every_bf16_gate(inter: int) -> torch.Tensor:
    """``gate_up`` ``[T, 2 inter]``: every non-NaN bf16 value once as a gate (a multiple of 64
    of them), a random up."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    gates = bits.view(torch.bfloat16)
    gates = gates[~torch.isnan(gates)]
    gate = gates[: gates.numel() // 64 * 64].view(-1, inter)
    return torch.cat([gate, rand(*gate.shape, seed=inter, scale=3.0)], dim=1)


@needs_bf16_silu
def test_silu_and_mul_is_torchs_for_every_bf16_gate() -> None:
    """Every finite or infinite bf16 gate value, through torch's vectorized rows (32 wide) and
    its scalar path (a one-column, strided gate), times a random up."""
    for inter in (32, 1):
        gate_up = every_bf16_gate(inter)
        want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        got = cpu_layer_ops.silu_and_mul(gate_up)  # silu(-inf) is NaN in both
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@needs_bf16_silu
@pytest.mark.parametrize(("rows", "inter"), [(1, 1408), (33, 1408), (5, 100), (3, 7), (2048, 1408)])
def test_silu_and_mul_shapes(rows: int, inter: int) -> None:
    gate_up = rand(rows, 2 * inter, seed=rows + inter, scale=4.0)
    want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    assert torch.equal(cpu_layer_ops.silu_and_mul(gate_up), want)


@needs_bf16_silu
def test_gelu_tanh_and_mul_is_torchs_for_every_bf16_gate() -> None:
    """Every bf16 gate value times a random up: equal to ``F.gelu(gate, approximate="tanh") *
    up`` through torch's vectorized loop (rows a multiple of 64 wide; the model's 2,048 and
    every Gemma 3's). torch's scalar tail (a row's last ``inter % 64``, here one wide) uses
    another tanh: it differs at four gates only (GELU of -5.06 ... -5.16 is -0 in the vector
    loop, -1.5e-7 in the scalar one: products under 1e-6); the kernel gives the vector loop's
    value in every position, so a value never depends on its column."""
    for inter in (64, 1):
        gate_up = every_bf16_gate(inter)
        gate = gate_up[:, :inter]
        want = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
        got = cpu_layer_ops.gelu_tanh_and_mul(gate_up)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        if inter == 64:
            assert same.all(), gate[~same].tolist()
        else:
            assert sorted(gate[~same].tolist()) == [-5.15625, -5.125, -5.09375, -5.0625]
            assert (got[~same].float() - want[~same].float()).abs().max() < 1e-6


@needs_bf16_silu
@pytest.mark.parametrize(("rows", "inter"), [(1, 2048), (64, 2048), (5, 100), (3, 7), (300, 640)])
def test_gelu_tanh_and_mul_shapes(rows: int, inter: int) -> None:
    gate_up = rand(rows, 2 * inter, seed=rows + inter, scale=4.0)
    want = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
    assert torch.equal(cpu_layer_ops.gelu_tanh_and_mul(gate_up), want)
    row = cpu_layer_ops.gelu_tanh_and_mul(gate_up[rows // 2 : rows // 2 + 1])
    assert torch.equal(row[0], want[rows // 2]), "a row alone gets its bits in the batch"


def tiny_config(**overrides: object) -> ModelConfig:
    raw: dict[str, object] = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=200,  # not a multiple of 16
        intermediate_size=300,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=300,
        rms_norm_eps=1e-5,
    )
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(
        qh, kh.transpose(0, 1), vh.transpose(0, 1), is_causal=True
    ).transpose(0, 1)


def random_model(config: ModelConfig, dtype: torch.dtype) -> llama.LlamaForCausalLM:
    torch.manual_seed(0)
    model = llama.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.to(dtype)


def unfused_reference(
    model: llama.LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The decoder as it was before the residual add moved into the norms (torch ops)."""
    m = model.model
    x = m.embed_tokens(ids)
    rotation = m.rotary_emb(positions, x.dtype)
    eps = m.norm.eps
    for layer in m.layers:
        h = torch_rms_norm(x, layer.input_layernorm.weight, eps)
        x = x + layer.self_attn(h, rotation, causal_attend)
        x = x + layer.mlp(torch_rms_norm(x, layer.post_attention_layernorm.weight, eps))
    return torch_rms_norm(x, m.norm.weight, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prepared", [False, True])
def test_torch_path_of_the_fused_residual_layout_is_unchanged(
    dtype: torch.dtype, prepared: bool
) -> None:
    model = random_model(tiny_config(), dtype)
    ids = torch.randint(0, 300, (77,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(77)
    with torch.inference_mode():
        if prepared:
            model.prepare()
        model.set_fused_ops(False)
        got = model(ids, positions, causal_attend)
        want = unfused_reference(model, ids, positions)
    assert torch.equal(got, want)


def test_prepare_fuses_the_dtypes_the_ops_compute() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(tiny_config(), dtype)
        model.prepare()
        assert model.fused_ops == cpu_layer_ops.computes(dtype)
        if not model.fused_ops:
            with pytest.raises(ValueError, match="does not compute"):
                model.set_fused_ops(True)
    fp16 = random_model(tiny_config(), torch.float16)
    fp16.prepare()
    assert not fp16.fused_ops
    if cpu_layer_ops.computes(torch.float32):  # fp32: torch's SiLU-and-mul (its exp)
        assert layer_ops.fused_ops_for(torch.float32) is layer_ops.FUSED_NORMS_OPS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_on_the_fused_ops_equals_torch_ops(kind: str, dtype: torch.dtype) -> None:
    """Whole prepared models (Qwen3: per-head q/k norms before the rotary): the fused path's
    hidden states are the torch path's bit for bit, prefill and a decode-sized batch."""
    overrides = (
        dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3") if kind == "qwen3" else {}
    )
    model = random_model(tiny_config(**overrides), dtype)
    with torch.inference_mode():
        model.prepare()
        assert model.fused_ops
        assert (model.model.layers[0].self_attn.q_norm is not None) == (kind == "qwen3")
        for n in (77, 1, 32):
            ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n))
            positions = torch.arange(n) + 500
            fused = model(ids, positions, causal_attend)
            model.set_fused_ops(False)
            plain = model(ids, positions, causal_attend)
            reference = unfused_reference(model, ids, positions)
            model.set_fused_ops(True)
            assert torch.equal(fused, plain), n
            assert torch.equal(plain, reference), n
