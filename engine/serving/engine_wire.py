"""The messages between an engine client (API side) and the engine core (engine_core.py).

The client sends ``Add``/``Abort``/``Call``/``Shutdown``; the core answers ``Ready`` (or
``Failed``) once at start (``ProcessEngine``'s core sends ``TokenizerAhead`` before it), then
``Step`` after every engine step (the step's outputs with the stats they leave behind) and
``Reply`` to every ``Call``. ``ProcessEngine`` sends them as msgpack over one duplex pipe;
``AsyncEngine`` hands the same objects across threads. Requests and outputs travel as the
engine's own dataclasses (msgspec encodes them natively). Torch-free.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prefixcache.sdk.cache_stats import CacheStats

from ..api import RequestRecord
from ..request import EngineRequest, RequestOutput
from ..text.tokenizer import TokenizerSpec

# -- API side -> core ------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    request: EngineRequest
    arrival: float  # time.monotonic() on the API side (the same clock across processes)


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Call(msgspec.Struct, tag=True, array_like=True):
    """Run an admin method of ``LLMEngine`` (the core's allow-list: pin, unpin, evict_all, ...)."""

    call_id: int
    method: str
    args: list[Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = Add | Abort | Call | Shutdown

# -- core -> API side ------------------------------------------------------------------------


class Sample(msgspec.Struct, array_like=True):
    name: str
    labels: dict[str, str]
    value: float


class MetricFamily(msgspec.Struct, array_like=True):
    """One Prometheus family of the core's registry, as its samples (for the API's /metrics)."""

    name: str
    documentation: str
    type: str
    unit: str
    samples: list[Sample]


class TokenizerAhead(msgspec.Struct, tag=True, array_like=True):
    """The model's own tokenizer, sent as soon as the core knows it (before the weights load):
    the API side builds its copy meanwhile, and keeps it if ``Ready``'s fingerprint agrees."""

    tokenizer: TokenizerSpec


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_name: str
    tokenizer: TokenizerSpec  # the API side builds the same one from it, any model source
    tokenizer_fingerprint: str
    max_model_len: int
    block_size: int
    dtype: str
    cache_identity: bytes
    output_identity: bytes
    sampling_defaults: dict[str, float]
    stats: CacheStats
    metrics: list[MetricFamily]


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str


class Refusal(msgspec.Struct, array_like=True):
    request_id: str
    message: str  # LLMEngine.validate's: ProcessEngine.generate raises it as ValueError


class Step(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]
    refused: list[Refusal]
    stats: CacheStats | None  # None: unchanged since the last message
    num_waiting: int
    num_running: int
    metrics: list[MetricFamily] | None  # None: not refreshed this time
    error: str | None = None  # LLMEngine.error: why the last step failed as a whole
    records: list[RequestRecord] = []  # finished requests since the last Step (the dashboard's)


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any  # the method's result (over a pipe: plain msgpack values, converted by type)
    error: str | None  # the message of the ValueError the method raised
    stats: CacheStats
    metrics: list[MetricFamily] | None  # None: the client reads the registry itself


ToApi = TokenizerAhead | Ready | Failed | Step | Reply


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    return msgspec.msgpack.Decoder(ToCore)  # type: ignore[arg-type]


def api_decoder() -> msgspec.msgpack.Decoder[ToApi]:
    return msgspec.msgpack.Decoder(ToApi)  # type: ignore[arg-type]
