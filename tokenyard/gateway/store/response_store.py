"""Stored responses of the Responses API, per tenant: what GET / DELETE /v1/responses/{id} and
`previous_response_id` read.

    store = ResponseStore.of(gw)                    # Redis when the gateway has it, else memory
    await store.put(tenant, response_id, {"response": {...}, "messages": [...]})
    await store.get(tenant, response_id)            # None: never stored, expired, deleted, or another tenant's
    await store.delete(tenant, response_id)         # True when it was there

One Redis string per response, `{prefix}resp:{tenant}:{id}`, JSON, expiring `responses.retention_days`
after it was written. The tenant is part of the key, so another tenant's id is simply not found (a
404, never a 403 that would confirm the id exists). Without Redis the same entries live in this
process's memory (a bounded LRU with the same expiry): a single gateway in tests or a development
run, not shared and lost at restart. A Redis error is a 503 (`store_unavailable`), never a 500.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from tokenyard.gateway.edge.errors import Unavailable


class ResponseStore:
    def __init__(self, redis: Any, prefix: str, retention_s: int, memory_max: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.retention_s = retention_s
        self.memory_max = memory_max
        self._memory: OrderedDict[str, tuple[float, str]] = OrderedDict()   # key -> (expires at, JSON)

    @classmethod
    def of(cls, gw: Any) -> "ResponseStore":
        """The gateway's store, made on first use (kept on the gateway object)."""
        store = getattr(gw, "_response_store", None)
        if store is None:
            settings = gw.deployment.responses
            store = cls(gw.redis, gw.deployment.redis_prefix, settings.retention_s, settings.memory_max)
            gw._response_store = store
        return store

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.prefix}resp:{tenant}:{response_id}"

    async def put(self, tenant: str, response_id: str, entry: dict[str, Any]) -> None:
        data = json.dumps(entry, ensure_ascii=False)
        key = self._key(tenant, response_id)
        if self.redis is None:
            self._memory[key] = (time.time() + self.retention_s, data)
            self._memory.move_to_end(key)
            while len(self._memory) > self.memory_max:
                self._memory.popitem(last=False)
            return
        try:
            await self.redis.set(key, data, ex=self.retention_s)
        except Exception as e:  # noqa: BLE001 - any Redis failure: the client learns the response was not kept
            raise Unavailable("The response could not be stored; retry, or send store: false",
                              code="store_unavailable") from e

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        key = self._key(tenant, response_id)
        if self.redis is None:
            held = self._memory.get(key)
            if held is None or held[0] < time.time():
                self._memory.pop(key, None)
                return None
            return json.loads(held[1])
        try:
            data = await self.redis.get(key)
        except Exception as e:  # noqa: BLE001
            raise Unavailable("Stored responses cannot be read right now; retry", code="store_unavailable") from e
        return json.loads(data) if data is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        if self.redis is None:
            held = self._memory.pop(key, None)
            return held is not None and held[0] >= time.time()
        try:
            return bool(await self.redis.delete(key))
        except Exception as e:  # noqa: BLE001
            raise Unavailable("Stored responses cannot be changed right now; retry", code="store_unavailable") from e
