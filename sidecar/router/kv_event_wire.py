"""KV event batches as vLLM publishes them (``vllm/distributed/kv_events.py``), for reading.

Our own structs, decoding the forms vLLM has used: an array batch ``[ts, events, rank]`` whose
events are maps tagged by ``type`` (vLLM 0.32: ``{"type": "BlockStored", ...}``, fields at
their defaults omitted), the same batch with array events (``[tag, field, ...]``, older vLLM
and its example subscriber), and an all-map batch (``{"ts": ..., "events": [...]}``).
Fields after ``medium`` have defaults, so older and newer publishers both decode; unknown
trailing fields are ignored. A block hash is an integer or bytes (vLLM's ExternalBlockHash).
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _StoredMap(BlockStored, tag="BlockStored", array_like=False, tag_field="type"):
    pass


class _RemovedMap(BlockRemoved, tag="BlockRemoved", array_like=False, tag_field="type"):
    pass


class _ClearedMap(AllBlocksCleared, tag="AllBlocksCleared", array_like=False, tag_field="type"):
    pass


class _BatchMap(msgspec.Struct):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


class _BatchOfMaps(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


_array_of_maps = msgspec.msgpack.Decoder(_BatchOfMaps)
_array = msgspec.msgpack.Decoder(EventBatch)
_map = msgspec.msgpack.Decoder(_BatchMap)


def decode_batch(payload: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` for a payload in none of the forms."""
    batch: _BatchOfMaps | _BatchMap
    try:
        batch = _array_of_maps.decode(payload)
    except msgspec.DecodeError:
        try:
            return _array.decode(payload)
        except msgspec.DecodeError:
            batch = _map.decode(payload)
    return EventBatch(batch.ts, list(batch.events), batch.data_parallel_rank)
