"""The model an engine serves, from its config: the CPU kernel libraries it will load started
building first (side by side, while the weights load), then the model loaded (or the one
given), with ``--chat-template`` in place of the model's own."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import settings
from ..attention import cpu_kernel_loads
from ..config import EngineConfig
from ..kernels import cpu_gemm, cpu_head_int8, cpu_layer_ops, cpu_library, cpu_qgemm, cpu_replay
from ..model.loader import LoadedModel, auto_dtype, load_model, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from ..text.tokenizer import TokenizerListener


def engine_model(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    on_tokenizer: TokenizerListener | None = None,
) -> LoadedModel:
    """``loaded``, or the model ``config`` names loaded (``on_tokenizer``: as
    ``load_model``'s), with the config's chat template where it sets one."""
    if loaded is None:
        cpu_library.load_in_background(kernel_loads(config))
        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            gguf_weights=config.gguf_weights,
            on_tokenizer=on_tokenizer,
        )
    if config.chat_template is not None:  # --chat-template: the model's own replaced
        tokenizer = loaded.tokenizer.with_chat_template(config.chat_template)
        loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
    return loaded


def kernel_loads(config: EngineConfig) -> list[Callable[[], object]]:
    """The CPU kernel libraries an engine of ``config`` loads, the longest build first (the
    batch-invariant attention's, for the dtype the model will load in: 5.9 s of g++ on a
    2-vCPU Xeon); none off the CPU. AMX's is asked for at any dtype (built only where the CPU
    has AMX)."""
    device = resolve_device(config.device)
    if device.type != "cpu":
        return []
    dtype = auto_dtype(device)  # the dtype the model will load in (the loader logs it)
    if config.dtype not in (None, "auto"):
        with contextlib.suppress(ValueError):  # a bad one: the loader says so, later
            dtype = resolve_dtype(config.dtype, device)
    loads = [*cpu_kernel_loads(config.attention_backend, config.batch_invariant, dtype)]
    # the AVX-512 GEMM, and AMX's where it runs (amx_available asks nothing elsewhere)
    loads += [cpu_layer_ops.available, cpu_gemm.available, cpu_gemm.amx_available]
    if config.gguf_weights != "dequantized":  # GGUF blocks read as they are (quantized, auto)
        loads.append(cpu_qgemm.available)
    if cpu_head_int8.wanted():  # $PREFIXCACHE_INT8_HEAD=1
        loads.append(cpu_head_int8.available)
    if settings.step_replay_enabled():
        loads.append(cpu_replay.available)
    return loads


def build_kernels(config: EngineConfig) -> float:
    """Build (or find built) the CPU kernel libraries an engine of ``config`` loads, side by
    side, and wait for them (``prefixcache serve --build-kernels``); the seconds it took. Each
    library logs what it loaded or why it is off."""
    start = time.perf_counter()
    for thread in cpu_library.load_in_background(kernel_loads(config)):
        thread.join()
    return time.perf_counter() - start
