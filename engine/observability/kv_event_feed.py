"""``KVEventFeed``: the engine's KV events, from the block manager's listener to the publisher.

A fresh pool starts with AllBlocksCleared (a restarted replica tells its subscribers to forget
what it held); ``flush`` hands what was recorded since the last one to the publisher, which
never waits.
"""

from __future__ import annotations

from typing import Literal

from ..config import EngineConfig
from ..memory.prefix_tree import root_digest
from .kv_events import BlockEventRecorder, KVEventPublisher


class KVEventFeed:
    def __init__(self, config: EngineConfig, identity: bytes) -> None:
        self.identity = identity
        roots: frozenset[bytes] | Literal["all"] = "all"
        if config.kv_events_token_ids != "all":
            listed = (
                config.kv_events_token_namespaces if config.kv_events_token_ids == "listed" else ()
            )
            roots = frozenset(root_digest(identity, ns) for ns in listed)
        self.recorder = BlockEventRecorder(config.block_size, roots)  # the manager's listener
        self.publisher: KVEventPublisher | None = KVEventPublisher(
            config.kv_events_endpoint or "",
            config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
        )
        self.recorder.all_cleared()
        self.flush()

    def hide_namespace(self, namespace: str) -> None:
        """Publish nothing of ``namespace``'s blocks (an engine-internal store)."""
        hidden = self.recorder.hidden_roots
        if len(hidden) >= 65536:  # bounded; chunk_reuse tells a namespace again after its own clear
            hidden.clear()
        hidden.add(root_digest(self.identity, namespace))

    def flush(self) -> None:
        if self.publisher is not None and (events := self.recorder.drain()):
            self.publisher.publish(events)

    def close(self) -> None:
        """Send what is recorded and queued, then stop publishing."""
        if self.publisher is not None:
            self.flush()
            self.publisher.close()
            self.publisher = None
