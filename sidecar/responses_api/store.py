"""Stored responses for ``previous_response_id``: each tenant's recent conversations, in
memory, bounded in bytes per tenant and in all; the oldest go first. An id is looked up only
in the asking tenant's own store, so another tenant's ids are simply not found."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from ..wire import protocol as p

TENANT_BYTES = 16 * 1024**2
TOTAL_BYTES = 64 * 1024**2


@dataclass(slots=True, frozen=True)
class StoredConversation:
    messages: list[p.Message]  # every turn up to and including the response's output
    nbytes: int


class ResponseStore:
    def __init__(self, tenant_bytes: int = TENANT_BYTES, total_bytes: int = TOTAL_BYTES) -> None:
        self.tenant_bytes = tenant_bytes
        self.total_bytes = total_bytes
        self._entries: OrderedDict[tuple[str, str], StoredConversation] = OrderedDict()
        self._bytes_by_tenant: dict[str, int] = {}
        self._bytes = 0

    def get(self, tenant: str, response_id: str) -> list[p.Message] | None:
        entry = self._entries.get((tenant, response_id))
        return None if entry is None else list(entry.messages)

    def put(self, tenant: str, response_id: str, messages: list[p.Message]) -> None:
        nbytes = len(msgspec.json.encode(messages)) + 200
        if nbytes > self.tenant_bytes:
            return  # one conversation larger than a tenant's share: not kept
        self._entries[(tenant, response_id)] = StoredConversation(list(messages), nbytes)
        self._bytes += nbytes
        self._bytes_by_tenant[tenant] = self._bytes_by_tenant.get(tenant, 0) + nbytes
        while self._bytes_by_tenant[tenant] > self.tenant_bytes:
            self._drop(next(key for key in self._entries if key[0] == tenant))
        while self._bytes > self.total_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._bytes_by_tenant[key[0]] -= entry.nbytes
        if not self._bytes_by_tenant[key[0]]:
            del self._bytes_by_tenant[key[0]]

    def __len__(self) -> int:
        return len(self._entries)
