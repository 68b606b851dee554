"""A small step's forward as one recorded program of kernel calls (``kernels/cpu_replay``).

At batch 1 a Llama-family decode makes ten kernel calls a layer (two norms with the
residual adds fused in, four GEMMs, rotary, the K/V write, attention, SiLU-and-mul), and on CPU each costs a few microseconds of Python and ``ctypes`` around a few of
work: ~95 us a layer, 40 % of SmolLM2's quantized decode step (``bench/step_overhead.py``).
``StepReplay`` records the same calls once per token count, over buffers it owns, mirroring
``LlamaModel.forward`` with the fused ops; each step then copies in its embeddings and
rotary angles and runs the program in one call, its attention plan and K/V rows passed as
registers. Every call is the eager path's own (``KernelCall``), with the same arguments
but the buffers, so every row gets the same bits (tests/test_step_replay.py compares).

It applies where every op of the layer is a kernel of the engine's: a prepared bf16 Llama
model on the batch-invariant GEMMs (``Gemm``'s packed kernel or GGUF-quantized weights),
the fused layer ops with SiLU-and-mul, and the CPU row-attention backend over pages in the
model's dtype or fp8 (the K/V write rounds as ``kv_dtype.to_kv`` does, in the kernel). All rows go through the last layer (the eager path drops the rows without
logits after attention): rows are independent, so the kept rows' bits are the same.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import settings
from ..attention import AttentionBackend, kv_dtype
from ..attention.cpu_backend import CpuKernelBackend
from ..kernels import cpu_layer_ops, cpu_replay
from ..kernels.cpu_qgemm import QuantizedLinear
from ..kernels.cpu_replay import KernelCall, Program
from ..kernels.linear import Gemm
from ..model.llama import LlamaForCausalLM

# Steps up to this many tokens replay. The 4-7 ms of Python a SmolLM2 step saves is 35 % of a
# batch-1 decode, 9 % of a 128-token chunk, 8 % at 256, 5 % at 512 (bench/step_replay.py).
MAX_TOKENS = 256
MAX_PROGRAMS = 128  # recorded (token count, threads) programs kept, least recently used out


def unsupported_reason(
    model: torch.nn.Module, backend: AttentionBackend, page_dtype: torch.dtype
) -> str | None:
    """Why a step of ``model`` on ``backend`` cannot replay here (None when it can)."""
    if not settings.step_replay_enabled():
        return f"{settings.STEP_REPLAY_ENV}=0"
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the Llama-family decoder"
    if not (model.prepared and model.fused_ops):
        return "the model does not run the fused layer ops"
    dtype = model.model.norm.weight.dtype
    if not cpu_layer_ops.computes_silu_and_mul(dtype):
        return f"{dtype} weights (the fused SiLU-and-mul computes bf16 only)"
    if page_dtype != dtype and not kv_dtype.is_fp8(page_dtype):
        return f"{page_dtype} pages under {dtype} weights"
    if not isinstance(backend, CpuKernelBackend) or not backend.batch_invariant:
        return f"the attention backend is {backend.name}, not the CPU row kernel"
    projections = []
    for layer in model.model.layers:
        projections += [layer.self_attn.qkv, layer.self_attn.out]
        projections += [layer.mlp.gate_up, layer.mlp.down]
    if not all(_kernel_of(p) is not None for p in projections):
        return "a projection is not on the engine's batch-invariant GEMM"
    if not cpu_replay.available():
        return "the replay library does not load"
    return None


def _kernel_of(projection: object) -> Gemm | QuantizedLinear | None:
    if isinstance(projection, Gemm) and projection.invariant is not None:
        return projection
    return projection if isinstance(projection, QuantizedLinear) else None


def _projection_call(projection: object, x: torch.Tensor, out: torch.Tensor) -> KernelCall:
    kernel = _kernel_of(projection)
    assert kernel is not None  # unsupported_reason checked every projection
    if isinstance(kernel, Gemm):
        assert kernel.invariant is not None
        return kernel.invariant.call(x, out)
    return kernel.call(x, out)


class StepReplay:
    """``model``'s forward over steps of at most ``max_tokens`` tokens, as programs recorded
    per token count (and thread count) over one set of buffers sized for ``max_tokens``.
    ``kv_layers``: the pages of each layer; ``backend``: the step's planned attention."""

    __slots__ = ("_backend", "_buffers", "_kv_layers", "_model", "_programs", "max_tokens")

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: CpuKernelBackend,
        kv_layers: list[torch.Tensor],
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self._model, self._backend, self._kv_layers = model, backend, kv_layers
        self.max_tokens = max_tokens
        cfg = model.config
        dtype = model.model.norm.weight.dtype
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(max_tokens, *shape, dtype=dtype)

        self._buffers = {
            "residual": buffer(cfg.hidden_size),
            "hidden": buffer(cfg.hidden_size),  # each layer's MLP out, normed in place
            "qkv": buffer((hq + 2 * hk) * d),
            "attention": buffer(hq, d),
            "attention_out": buffer(cfg.hidden_size),
            "gate_up": buffer(2 * cfg.intermediate_size),
            "act": buffer(cfg.intermediate_size),
            "cos": buffer(1, d // 2),
            "sin": buffer(1, d // 2),
        }
        self._programs: OrderedDict[tuple[int, int], Program] = OrderedDict()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of every token (the backend planned for
        this step): a view of a buffer the next call overwrites."""
        t = input_ids.shape[0]
        if not 0 < t <= self.max_tokens:
            raise ValueError(f"a replayed step holds 1 to {self.max_tokens} tokens, not {t}")
        inner = self._model.model
        buffers = self._buffers
        buffers["residual"][:t].copy_(inner.embed_tokens(input_ids))
        cos, sin = inner.rotary_emb(positions, buffers["cos"].dtype)
        buffers["cos"][:t].copy_(cos)
        buffers["sin"][:t].copy_(sin)
        key = (t, torch.get_num_threads())
        program = self._programs.get(key)
        if program is None:  # recording takes ~5 ms for SmolLM2's 30 layers
            program = self._programs[key] = self._record(t)
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        program.run(self._backend.step_registers())
        return buffers["hidden"][:t]

    def _record(self, t: int) -> Program:
        """The calls of ``LlamaModel.forward`` (fused ops) over ``t`` rows of the buffers."""
        cfg = self._model.config
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = {name: buf[:t] for name, buf in self._buffers.items()}
        residual, hidden = b["residual"], b["hidden"]
        q, k, v = b["qkv"].view(t, hq + 2 * hk, d).split((hq, hk, hk), dim=1)
        calls: list[KernelCall] = []
        inner = self._model.model
        for i, layer in enumerate(inner.layers):
            norm = layer.input_layernorm
            if i == 0:  # the embedding is the residual; its norm goes to `hidden`
                calls.append(cpu_layer_ops.norm_call(residual, norm.weight, norm.eps, hidden))
            else:  # residual += the last MLP's out, normed in place
                calls.append(
                    cpu_layer_ops.norm_call(hidden, norm.weight, norm.eps, hidden, residual)
                )
            attn = layer.self_attn
            calls.append(_projection_call(attn.qkv, hidden, b["qkv"]))
            calls.append(cpu_layer_ops.rotary_call(q, k, b["cos"], b["sin"], attn.qk_norms()))
            recorded = self._backend.record_layer(q, k, v, self._kv_layers[i], b["attention"])
            assert recorded is not None  # unsupported_reason checked the backend and pages
            calls += recorded
            out = b["attention_out"]
            calls.append(_projection_call(attn.out, b["attention"].view(t, hq * d), out))
            post = layer.post_attention_layernorm
            calls.append(cpu_layer_ops.norm_call(out, post.weight, post.eps, out, residual))
            calls.append(_projection_call(layer.mlp.gate_up, out, b["gate_up"]))
            calls.append(cpu_layer_ops.silu_call(b["gate_up"], b["act"]))
            calls.append(_projection_call(layer.mlp.down, b["act"], hidden))
        final = inner.norm
        calls.append(cpu_layer_ops.norm_call(hidden, final.weight, final.eps, hidden, residual))
        keep = [*self._buffers.values(), *self._kv_layers]
        return Program(calls, keep)
