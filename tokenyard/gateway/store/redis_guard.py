"""Every Redis call on the request path goes through one guard: bounded, timed, counted, and
skipped for a while after a failure.

Two different ways a call can fail, kept apart on purpose:

* Redis is down (connect refused, timeout, protocol error): `RedisUnavailable`. The guard then
  skips Redis for `retry_s`, so during an outage only one call per `retry_s` pays the timeout and
  the rest take the fail-open/closed decision at once. Logged once per outage, counted in
  tokenyard_redis_errors_total.
* The gateway is busy: more calls in flight than it allows (`max_in_flight`, the size of the
  connection pool) and no place freed within `wait_s`. That says nothing about Redis, so it must
  never open the limits or lock keys out as an outage would: it raises `RedisBusy`, a 503 with
  Retry-After (load shedding, like a full admission queue), and Redis stays "up". Counted in
  tokenyard_redis_busy_total. The pool is a blocking one sized above `max_in_flight`, so the pool
  itself never runs dry before this bound does; should it anyway ("No connection available",
  "Too many connections"), that too is busy, not down.

A Redis timeout while this gateway's own event loop is running late (measured by a heartbeat)
is busy too: the reply may have sat unread behind a thousand other tasks, which says nothing
about Redis either, and taking it for an outage would open every tenant's limits exactly when
the gateway is most loaded.

Latency (including the wait for a place) goes to tokenyard_redis_latency_seconds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenyard.gateway.edge.errors import Unavailable, retry_headers

log = logging.getLogger("tokenyard.redis")
T = TypeVar("T")
_POOL_EMPTY = ("No connection available", "Too many connections")
BEAT_S = 0.05          # the loop heartbeat's period
LATE_S = 0.1           # a heartbeat this late (within the last LATE_MEMORY_S) means "the loop is behind"
LATE_MEMORY_S = 2.0


class RedisUnavailable(Exception):
    """Redis failed (or is being skipped after a recent failure)."""


class RedisBusy(Unavailable):
    """Too many Redis calls in flight in this gateway: shed with 503 and Retry-After. Deliberately not
    a RedisUnavailable, so nobody fails open (limits) or closed (unknown keys) on it."""

    def __init__(self, op: str, retry_s: float) -> None:
        super().__init__(f"The gateway is busy ({op}); retry shortly", code="gateway_busy",
                         headers=retry_headers(retry_s))


def is_pool_exhausted(e: BaseException) -> bool:
    return isinstance(e, MaxConnectionsError) or (
        isinstance(e, RedisConnectionError) and str(e).startswith(_POOL_EMPTY))


class RedisGuard:
    def __init__(self, metrics: Any, retry_s: float = 1.0, max_in_flight: int = 64, wait_s: float = 1.0) -> None:
        self.metrics = metrics
        self.retry_s = retry_s
        self.max_in_flight = max_in_flight
        self.wait_s = wait_s
        self._places = asyncio.Semaphore(max_in_flight)
        self._down_until = 0.0
        self._down = False
        self.busy_count = 0
        self._busy = _busy_counter(metrics)
        self._late_at = float("-inf")            # when the loop heartbeat was last late
        self._heartbeat: asyncio.Task | None = None

    def loop_is_late(self) -> bool:
        return time.monotonic() - self._late_at < LATE_MEMORY_S

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(BEAT_S)
            if loop.time() - t - BEAT_S > LATE_S:
                self._late_at = time.monotonic()

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    @property
    def in_flight(self) -> int:
        return self.max_in_flight - self._places._value   # noqa: SLF001 - read-only peek for metrics/tests

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.available():
            raise RedisUnavailable(f"redis skipped for {op}: it failed less than {self.retry_s} s ago")
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        t0 = time.perf_counter()
        if self._places.locked():
            try:
                await asyncio.wait_for(self._places.acquire(), self.wait_s)
            except TimeoutError:
                self._shed(op)
        else:
            await self._places.acquire()
        try:
            result = await fn()
        except (RedisError, OSError, TimeoutError) as e:
            if is_pool_exhausted(e) or (isinstance(e, (RedisTimeoutError, TimeoutError)) and self.loop_is_late()):
                self._shed(op)
            self.failed(op, e)
            raise RedisUnavailable(f"redis failed during {op}: {type(e).__name__}: {e}") from e
        finally:
            self._places.release()
            self.metrics.redis_latency.labels(op).observe(time.perf_counter() - t0)
        if self._down:
            self._down = False
            log.info("redis is reachable again (%s)", op)
        return result

    def _shed(self, op: str) -> None:
        self.busy_count += 1
        if self._busy is not None:
            self._busy.labels(op).inc()
        raise RedisBusy(op, max(self.wait_s, 0.05))

    def failed(self, op: str, e: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        self._down_until = time.monotonic() + self.retry_s
        if not self._down:
            self._down = True
            log.warning("redis unreachable during %s (%s: %s); retrying every %.1f s", op, type(e).__name__, e,
                        self.retry_s)


def _busy_counter(metrics: Any) -> Any:
    """tokenyard_redis_busy_total{op} in the gateway's registry (None for metric stand-ins in unit tests)."""
    registry = getattr(metrics, "registry", None)
    if registry is None:
        return None
    from prometheus_client import Counter
    return Counter("tokenyard_redis_busy", "Redis calls shed because too many were in flight in this gateway "
                   "(load, not an outage)", ["op"], registry=registry)
