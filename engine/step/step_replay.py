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
or Gemma 3 model on the batch-invariant GEMMs (``Gemm``'s packed kernel or GGUF-quantized
weights), the fused layer ops with SiLU- or GELU-and-mul, and the CPU row-attention backend
over pages in the model's dtype or fp8 (the K/V write rounds as ``kv_dtype.to_kv`` does, in
the kernel). A hybrid model's sliding layers (Gemma 3's, Mistral's, Qwen2's with
``use_sliding_window``) attend through their own backend (the local pages' plan): its
registers follow the global one's; Gemma's sliding layers rotate by the local rope base.
Where a step reads only some rows' logits (``forward``'s ``rows``: a prompt's last token, or
none in a chunk that ends before it), the program stops after the last layer's K/V write;
those rows' queries and residuals are gathered to the buffers' first rows and a second
program, recorded per kept count, runs the rest of the layer on them alone (their attention
over a one-row plan each, ``CpuKernelBackend.kept_registers``): each row's bits are the
whole step's, as in the eager path (``AttentionBackend.forward_rows``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import settings
from ..attention import AttentionBackend, kv_dtype
from ..attention.cpu_backend import NUM_REGISTERS, CpuKernelBackend
from ..kernels import cpu_layer_ops, cpu_replay
from ..kernels.cpu_qgemm import QuantizedLinear
from ..kernels.cpu_replay import KernelCall, Program
from ..kernels.linear import Gemm
from ..model.gemma3 import Gemma3ForCausalLM, Gemma3Model
from ..model.llama import LlamaForCausalLM

# Steps up to this many tokens replay. The 4-7 ms of Python a SmolLM2 step saves is 35 % of a
# batch-1 decode, 9 % of a 128-token chunk, 8 % at 256, 5 % at 512 (bench/step_replay.py).
MAX_TOKENS = 256
MAX_PROGRAMS = 128  # recorded (token count, threads) programs kept, least recently used out


def unsupported_reason(
    model: torch.nn.Module,
    backend: AttentionBackend,
    page_dtype: torch.dtype,
    local_backend: AttentionBackend | None = None,
) -> str | None:
    """Why a step of ``model`` on ``backend`` (and ``local_backend`` for its sliding layers)
    cannot replay here (None when it can)."""
    if not settings.step_replay_enabled():
        return f"{settings.STEP_REPLAY_ENV}=0"
    if type(model) not in (LlamaForCausalLM, Gemma3ForCausalLM):
        return f"{type(model).__name__} is neither the Llama-family decoder nor Gemma 3"
    if not (model.prepared and model.fused_ops):
        return "the model does not run the fused layer ops"
    dtype = model.model.norm.weight.dtype
    if not cpu_layer_ops.computes_silu_and_mul(dtype):
        return f"{dtype} weights (the fused SiLU- and GELU-and-mul compute bf16 only)"
    if page_dtype != dtype and not kv_dtype.is_fp8(page_dtype):
        return f"{page_dtype} pages under {dtype} weights"
    for b in (backend, local_backend) if local_backend is not None else (backend,):
        if not isinstance(b, CpuKernelBackend) or not b.batch_invariant:
            name = None if b is None else b.name
            return f"the attention backend is {name}, not the CPU row kernel"
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
    ``kv_layers``: the pages of each layer; ``backend``: the step's planned attention;
    ``local_backend``: a hybrid model's sliding layers' (planned over their local pages)."""

    __slots__ = ("_backend", "_buffers", "_kv_layers", "_local_backend", "_model", "_programs")
    __slots__ += ("max_tokens",)

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: CpuKernelBackend,
        kv_layers: list[torch.Tensor],
        max_tokens: int = MAX_TOKENS,
        local_backend: CpuKernelBackend | None = None,
    ) -> None:
        self._model, self._backend, self._kv_layers = model, backend, kv_layers
        self._local_backend = local_backend
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
            "q_kept": buffer(hq, d),  # the kept rows' queries (forward's rows)
            "attention_out": buffer(cfg.hidden_size),
            "gate_up": buffer(2 * cfg.intermediate_size),
            "act": buffer(cfg.intermediate_size),
            "cos": buffer(1, d // 2),
            "sin": buffer(1, d // 2),
        }
        if isinstance(model, Gemma3ForCausalLM):
            self._buffers["mlp_out"] = buffer(cfg.hidden_size)
            self._buffers["cos_local"] = buffer(1, d // 2)
            self._buffers["sin_local"] = buffer(1, d // 2)
        self._programs: OrderedDict[tuple[int, ...], tuple[Program, ...]] = OrderedDict()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of every token (the backends planned for
        this step), or ``[len(rows), hidden]`` of ``rows`` only (int64, ascending, distinct;
        every token's K/V still written): a view of a buffer the next call overwrites."""
        t = input_ids.shape[0]
        if not 0 < t <= self.max_tokens:
            raise ValueError(f"a replayed step holds 1 to {self.max_tokens} tokens, not {t}")
        inner = self._model.model
        buffers = self._buffers
        rotations = [("cos", "sin", inner.rotary_emb)]
        if isinstance(inner, Gemma3Model):
            x = inner.embed(input_ids)
            rotations.append(("cos_local", "sin_local", inner.rotary_emb_local))
        else:
            x = inner.embed_tokens(input_ids)
        buffers["residual"][:t].copy_(x)
        for cos_name, sin_name, rotary in rotations:
            cos, sin = rotary(positions, buffers["cos"].dtype)
            buffers[cos_name][:t].copy_(cos)
            buffers[sin_name][:t].copy_(sin)
        kept = t if rows is None else rows.numel()
        key = (t, torch.get_num_threads()) if kept == t else (t, torch.get_num_threads(), kept)
        programs = self._programs.get(key)
        if programs is None:  # recording takes ~5 ms for SmolLM2's 30 layers
            programs = self._programs[key] = self._record(t, None if kept == t else kept)
            if len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        registers = self._backend.step_registers()
        if self._local_backend is not None:
            registers += self._local_backend.step_registers()
        programs[0].run(registers)
        if kept == t:
            return buffers["hidden"][:t]
        assert rows is not None
        if kept:  # the kept rows to the buffers' first rows, then the last layer's rest
            q = self._qkv({"qkv": buffers["qkv"][:t]})[0]
            buffers["q_kept"][:kept].copy_(q.index_select(0, rows))
            buffers["residual"][:kept].copy_(buffers["residual"][:t].index_select(0, rows))
            programs[1].run(self._last_backend().kept_registers(rows))
        return buffers["hidden"][:kept]

    def _record(self, t: int, kept: int | None) -> tuple[Program, ...]:
        """The calls of the model's forward (fused ops) over ``t`` rows of the buffers; with
        ``kept``, two programs: up to the last layer's K/V write, and the rest of that layer
        over the buffers' first ``kept`` rows (``forward`` gathers them between)."""
        b = {name: buf[:t] for name, buf in self._buffers.items()}
        if isinstance(self._model, Gemma3ForCausalLM):
            calls = self._record_gemma(b, kept)
        else:
            calls = self._record_llama(b, kept)
        keep = [*self._buffers.values(), *self._kv_layers]
        return tuple(Program(part, keep) for part in calls)

    def _last_backend(self) -> CpuKernelBackend:
        last = len(self._model.model.layers) - 1
        backend = self._local_backend if self._slides(last) else self._backend
        assert backend is not None
        return backend

    def _qkv(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        cfg = self._model.config
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = b["qkv"].shape[0]
        return b["qkv"].view(t, hq + 2 * hk, d).split((hq, hk, hk), dim=1)

    def _slides(self, layer: int) -> bool:
        """Whether the layer attends over the local pages (none where the cache kept every
        layer global: a window no sequence outgrows)."""
        return self._local_backend is not None and self._model.config.window_of(layer) > 0

    def _attend(
        self, b: dict[str, torch.Tensor], layer: int, local: bool, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor,
    ) -> list[KernelCall]:  # fmt: skip
        backend = self._local_backend if local else self._backend
        assert backend is not None  # unsupported_reason checked a hybrid model's backends
        first = NUM_REGISTERS if local else 0
        recorded = backend.record_layer(q, k, v, self._kv_layers[layer], b["attention"], first)
        assert recorded is not None  # unsupported_reason checked the backend and pages
        return recorded

    def _attention(
        self, b: dict[str, torch.Tensor], parts: list[list[KernelCall]], layer: int,
        kept: int | None,
    ) -> dict[str, torch.Tensor] | None:  # fmt: skip
        """The layer's attention calls onto ``parts[-1]``, returning ``b``. At the last layer
        with ``kept``: its K/V write ends that part and a new one starts with the attention of
        the kept rows, gathered by ``forward`` to the buffers' first ``kept`` rows, which it
        returns (None where no row is kept: nothing runs past the write)."""
        q, k, v = self._qkv(b)
        recorded = self._attend(b, layer, self._slides(layer), q, k, v)
        if kept is None or layer < len(self._model.model.layers) - 1:
            parts[-1] += recorded
            return b
        write = recorded[0]
        assert write.kind == cpu_replay.WRITE_KV
        parts[-1].append(write)
        if not kept:
            return None
        rows = {name: buf[:kept] for name, buf in self._buffers.items()}
        kv_layer = self._kv_layers[layer]
        attend = self._last_backend().record_attend(rows["q_kept"], kv_layer, rows["attention"])
        parts.append([attend])
        return rows

    def _record_llama(self, b: dict[str, torch.Tensor], kept: int | None) -> list[list[KernelCall]]:
        """``LlamaModel.forward``'s calls (``_record``)."""
        residual, hidden = b["residual"], b["hidden"]
        q, k, _ = self._qkv(b)
        t = q.shape[0]
        calls: list[KernelCall] = []
        parts = [calls]
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
            if attn.use_rope:  # SmolLM3's NoPE layers: no rotation
                calls.append(cpu_layer_ops.rotary_call(q, k, b["cos"], b["sin"], attn.qk_norms()))
            now = self._attention(b, parts, i, kept)
            if now is None:  # no row kept: nothing runs past the last layer's K/V write
                return parts
            b, calls, residual, hidden = now, parts[-1], now["residual"], now["hidden"]
            t = hidden.shape[0]
            out = b["attention_out"]
            calls.append(_projection_call(attn.out, b["attention"].view(t, -1), out))
            post = layer.post_attention_layernorm
            calls.append(cpu_layer_ops.norm_call(out, post.weight, post.eps, out, residual))
            calls.append(_projection_call(layer.mlp.gate_up, out, b["gate_up"]))
            calls.append(cpu_layer_ops.silu_call(b["gate_up"], b["act"]))
            calls.append(_projection_call(layer.mlp.down, b["act"], hidden))
        final = inner.norm
        calls.append(cpu_layer_ops.norm_call(hidden, final.weight, final.eps, hidden, residual))
        return parts

    def _record_gemma(self, b: dict[str, torch.Tensor], kept: int | None) -> list[list[KernelCall]]:
        """``Gemma3Model.forward``'s calls: ``hidden`` holds each layer's normed input, each
        sublayer's output goes through its post-norm into the residual and the next pre-norm
        in one call (the last one's next norm is the final one)."""
        residual, hidden = b["residual"], b["hidden"]
        q, k, _ = self._qkv(b)
        t = q.shape[0]
        inner = self._model.model
        layers = list(inner.layers)
        first = layers[0].input_layernorm.scale
        calls = [
            cpu_layer_ops.gemma_norms_call(residual, None, None, first, hidden, inner.norm.eps)
        ]
        parts = [calls]
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            calls.append(_projection_call(attn.qkv, hidden, b["qkv"]))
            cos, sin = (b["cos_local"], b["sin_local"]) if layer.sliding else (b["cos"], b["sin"])
            norms = attn.qk_norms()
            calls.append(cpu_layer_ops.rotary_call(q, k, cos, sin, norms, gemma_norms=True))
            now = self._attention(b, parts, i, kept)
            if now is None:  # no row kept: nothing runs past the last layer's K/V write
                return parts
            b, calls, residual, hidden = now, parts[-1], now["residual"], now["hidden"]
            t = hidden.shape[0]
            out = b["attention_out"]
            calls.append(_projection_call(attn.out, b["attention"].view(t, -1), out))
            post, pre = layer.post_attention_layernorm.scale, layer.pre_feedforward_layernorm.scale
            calls.append(
                cpu_layer_ops.gemma_norms_call(out, residual, post, pre, hidden, layer.eps)
            )
            calls.append(_projection_call(layer.mlp.gate_up, hidden, b["gate_up"]))
            calls.append(cpu_layer_ops.gelu_call(b["gate_up"], b["act"]))
            calls.append(_projection_call(layer.mlp.down, b["act"], b["mlp_out"]))
            post = layer.post_feedforward_layernorm.scale
            nxt = inner.norm if i == len(layers) - 1 else layers[i + 1].input_layernorm
            calls.append(
                cpu_layer_ops.gemma_norms_call(
                    b["mlp_out"], residual, post, nxt.scale, hidden, layer.eps
                )
            )
        return parts
