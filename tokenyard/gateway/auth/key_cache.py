"""Authentication from key records cached in each gateway, kept fresh by Redis pub/sub.

    rec = await cache.authenticate(request.headers.get("authorization"))   # KeyRecord, or 401/503

A record read from Redis is trusted for `ttl_s`, then read again on its next use. Revocations
and updates are pushed on `{prefix}keys:events`: the record is dropped at once, so the next use
re-reads it (and sees it revoked). When the subscription drops, events may have been missed, so
on every (re)subscribe all cached records are marked stale.

While Redis is unreachable: a key whose record is cached (fresh or stale) still authenticates,
since it was valid moments ago and revocations would have reached us; a key unknown to the cache
is refused (503 auth_unavailable): failing open covers limits and spend, never authentication.
Only records of real keys are cached, so random keys cannot fill the cache.

Refusing strangers cheaply (a flood of made-up keys must not crowd out real ones):
* a token that is not shaped like a key ("ty-" + 43 url-safe characters) and is not a key this
  gateway was given (the development key) is refused without asking Redis;
* a key Redis does not know is remembered as unknown for `negative_ttl_s` (a bounded map; a key
  made meanwhile is announced on the events channel, which clears its entry);
* concurrent uses of one key share one Redis read, and at most `max_lookups` reads are in flight
  at once, so lookups never hold more than that share of the Redis pool; a read that cannot start
  within the guard's wait is shed (503 gateway_busy with Retry-After), never taken for an outage.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from tokenyard.gateway.auth.api_keys import KeyRecord, events_channel, hash_key, key_id_of, record_name
from tokenyard.gateway.edge.errors import Unauthorized, Unavailable
from tokenyard.gateway.store.redis_guard import RedisBusy, RedisGuard, RedisUnavailable

log = logging.getLogger("tokenyard.keys")
_KEY_SHAPE = re.compile(r"^ty-[A-Za-z0-9_-]{43}$")   # api_keys.generate_key: "ty-" + token_urlsafe(32)
MAX_UNKNOWN = 100_000                                 # remembered unknown key ids (oldest dropped first)


class _Entry:
    __slots__ = ("record", "fetched")

    def __init__(self, record: KeyRecord, fetched: float) -> None:
        self.record = record
        self.fetched = fetched


class KeyCache:
    def __init__(self, redis: Any, prefix: str, ttl_s: float, guard: RedisGuard | None, metrics: Any,
                 negative_ttl_s: float = 5.0, max_lookups: int = 16) -> None:
        self.redis = redis              # redis.asyncio client; None: records only from preload() (tests)
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.guard = guard
        self.metrics = metrics
        self.negative_ttl_s = negative_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._unknown: dict[str, float] = {}                  # key id -> until when it is known to be unknown
        self._reading: dict[str, asyncio.Future] = {}         # key id -> the Redis read in flight for it
        self._lookups = asyncio.Semaphore(max_lookups)
        self._given: set[str] = set()                         # ids of preloaded keys, whatever their shape
        self.redis_reads = 0                                  # HGETALLs sent (tests: the flood stays cheap)

    def preload(self, record: KeyRecord) -> None:
        self._entries[record.key_id] = _Entry(record, time.monotonic())
        self._given.add(record.key_id)

    def __len__(self) -> int:
        return len(self._entries)

    async def authenticate(self, header: str | None) -> KeyRecord:
        scheme, _, token = (header or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise self._refuse("missing", "You didn't provide an API key. Send 'Authorization: Bearer <key>'.")
        key_hash = hash_key(token)
        key_id = key_id_of(key_hash)
        entry = self._entries.get(key_id)
        record = entry.record if entry is not None else None
        fresh = entry is not None and time.monotonic() - entry.fetched < self.ttl_s
        if entry is None and key_id not in self._given and (not _KEY_SHAPE.match(token) or self._known_unknown(key_id)):
            raise self._refuse("invalid", "Incorrect API key provided.")
        if self.redis is not None and not fresh:
            try:
                record = await self._fetch(key_id)
            except RedisBusy:
                if entry is None:
                    raise
                # Busy, not down: the cached record (valid moments ago) serves.
            except RedisUnavailable:
                if entry is None:
                    self.metrics.auth_failures.labels("unavailable").inc()
                    raise Unavailable("API keys cannot be verified right now; retry shortly", code="auth_unavailable",
                                      headers={"retry-after": "1"}) from None
                # Stale but known: keep serving it while Redis is away.
        if record is None or not record.matches(key_hash):
            raise self._refuse("invalid", "Incorrect API key provided.")
        if record.revoked is not None:
            raise self._refuse("revoked", "This API key has been revoked.")
        return record

    async def lookup(self, key_id: str) -> KeyRecord | None:
        """The record of a key id (a dashboard session holds the id, never the key): the cached one
        while fresh, else re-read from Redis; a stale cached one while Redis is unreachable."""
        entry = self._entries.get(key_id)
        if entry is not None and (self.redis is None or time.monotonic() - entry.fetched < self.ttl_s):
            return entry.record
        if self.redis is None:
            return None
        try:
            return await self._fetch(key_id)
        except RedisBusy:
            if entry is None:
                raise
            return entry.record
        except RedisUnavailable:
            if entry is None:
                raise Unavailable("API keys cannot be verified right now; retry shortly", code="auth_unavailable",
                                  headers={"retry-after": "1"}) from None
            return entry.record

    def _known_unknown(self, key_id: str) -> bool:
        until = self._unknown.get(key_id)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._unknown[key_id]
        return False

    async def _fetch(self, key_id: str) -> KeyRecord | None:
        """One Redis read per key id at a time: concurrent callers share it (and its outcome)."""
        pending = self._reading.get(key_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._reading[key_id] = future
        try:
            record = await self._read(key_id)
        except BaseException as e:
            future.set_exception(e)
            future.exception()          # retrieved: nobody else waiting is not an error
            raise
        else:
            future.set_result(record)
            return record
        finally:
            del self._reading[key_id]

    async def _read(self, key_id: str) -> KeyRecord | None:
        wait_s = self.guard.wait_s if self.guard is not None else 1.0
        if not self._lookups.locked():
            await self._lookups.acquire()
        else:
            try:
                await asyncio.wait_for(self._lookups.acquire(), wait_s)
            except TimeoutError:
                raise RedisBusy("key_lookup", wait_s) from None
        try:
            self.redis_reads += 1
            raw = await self.guard.call("key_lookup", lambda: self.redis.hgetall(record_name(self.prefix, key_id)))
        finally:
            self._lookups.release()
        if not raw:
            self._entries.pop(key_id, None)
            if len(self._unknown) >= MAX_UNKNOWN:
                self._unknown.pop(next(iter(self._unknown)))
            self._unknown[key_id] = time.monotonic() + self.negative_ttl_s
            return None
        record = KeyRecord.from_redis(raw)
        self._entries[key_id] = _Entry(record, time.monotonic())
        return record

    def _refuse(self, reason: str, message: str) -> Unauthorized:
        self.metrics.auth_failures.labels(reason).inc()
        return Unauthorized(message, code="invalid_api_key")

    def forget(self, key_id: str) -> None:
        self._entries.pop(key_id, None)
        self._unknown.pop(key_id, None)     # a key just made is announced with "update <id>"

    def mark_all_stale(self) -> None:
        for entry in self._entries.values():
            entry.fetched = float("-inf")
        self._unknown.clear()               # events may have been missed: a key may have been made

    async def listen(self, pubsub_client: Any, reconnect_s: float = 1.0) -> None:
        """Follow the key events channel until cancelled, resubscribing after any failure.

        pubsub_client: a client without a read timeout (a subscription is idle most of the time)."""
        channel = events_channel(self.prefix)
        while True:
            pubsub = pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self.mark_all_stale()   # whatever happened while we were not subscribed, re-read it
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    data = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
                    _, _, key_id = data.partition(" ")
                    self.forget(key_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: resubscribe later
                log.warning("key events subscription lost (%s: %s); resubscribing", type(e).__name__, e)
                self.mark_all_stale()
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 - the connection is already broken
                    pass
            await asyncio.sleep(reconnect_s)
