"""Routing samples and feedback labels in Redis, per tenant: what the router learns from.

    store = FeedbackStore(redis_asyncio_client, prefix, retention_s, max_labels)
    await store.put_samples([(tenant, request_id, sample), ...])   # the background writer
    sample = await store.sample(tenant, request_id)                 # None: not kept, expired, another tenant's
    new = await store.put_label(tenant, request_id, label)          # True when the id had no label yet
    rows = await store.labels(tenant)                               # {response_id: label}; tenants(): who has any

Redis layout (T is the tenant inside braces, a Redis Cluster hash tag, as the spend ledger's):
    {prefix}learn:{T}:s:{request id}   JSON sample: prompt, prompt_tokens, engine, small, large, score, time;
                                       expires retention_s after the request
    {prefix}learn:{T}:labels           hash: response id -> JSON label (the sample's prompt and engine, the
                                       feedback, the 0/1 training label or null, source, time)
    {prefix}learn:{T}:order            sorted set: response id by the label's write time
    {prefix}learn:tenants              set of tenants with labels

A label is written by one Lua script (lua/label_put.lua): labels older than the retention and, past
max_labels, the oldest are dropped in the same step; both keys expire retention_s after the last
write. One response has at most one label: feedback sent again replaces it (the latest wins), so a
retried POST stores nothing twice. The tenant is part of every key: another tenant's response id is
simply not found.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

_LUA = Path(__file__).resolve().parent / "lua" / "label_put.lua"


def _t(prefix: str, tenant: str) -> str:
    return f"{prefix}learn:{{{tenant}}}"


def sample_key(prefix: str, tenant: str, request_id: str) -> str:
    return f"{_t(prefix, tenant)}:s:{request_id}"


def labels_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:labels"


def order_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:order"


def tenants_key(prefix: str) -> str:
    return f"{prefix}learn:tenants"


def _text(raw: Any) -> str:
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


class FeedbackStore:
    def __init__(self, redis: Any, prefix: str, retention_s: int, max_labels: int) -> None:
        self.redis = redis          # redis.asyncio client
        self.prefix = prefix
        self.retention_s = retention_s
        self.max_labels = max_labels
        self._script = redis.register_script(_LUA.read_text())

    async def put_samples(self, samples: Iterable[tuple[str, str, dict[str, Any]]]) -> int:
        pipe = self.redis.pipeline(transaction=False)
        n = 0
        for tenant, request_id, sample in samples:
            pipe.set(sample_key(self.prefix, tenant, request_id), json.dumps(sample, ensure_ascii=False),
                     ex=self.retention_s)
            n += 1
        if n:
            await pipe.execute()
        return n

    async def sample(self, tenant: str, request_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(sample_key(self.prefix, tenant, request_id))
        return json.loads(raw) if raw is not None else None

    async def put_label(self, tenant: str, response_id: str, label: dict[str, Any], now: float | None = None) -> bool:
        now = time.time() if now is None else now
        new = await self._script(
            keys=[labels_key(self.prefix, tenant), order_key(self.prefix, tenant), tenants_key(self.prefix)],
            args=[response_id, json.dumps(label, ensure_ascii=False, sort_keys=True), repr(now),
                  repr(now - self.retention_s), str(self.max_labels), str(self.retention_s), tenant])
        return int(new) == 1

    async def labels(self, tenant: str, now: float | None = None) -> dict[str, dict[str, Any]]:
        """The tenant's labels within the retention (older ones are dropped by the next write)."""
        cutoff = (time.time() if now is None else now) - self.retention_s
        raw = await self.redis.hgetall(labels_key(self.prefix, tenant))
        rows = {_text(k): json.loads(v) for k, v in raw.items()}
        return {k: v for k, v in rows.items() if float(v.get("time", 0)) >= cutoff}

    async def tenants(self) -> list[str]:
        return sorted(_text(t) for t in await self.redis.smembers(tenants_key(self.prefix)))
