"""Every Redis call on the request path goes through one guard: timed, counted, and skipped for a
while after a failure.

Without the skip, every request during an outage would wait for a connect or read timeout
before failing open or closed; with it, only one call per `retry_s` pays that price and the rest
take the fail-open/closed decision at once. Errors are logged once per outage (not per request)
and counted in tokenyard_redis_errors_total; latency goes to tokenyard_redis_latency_seconds.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from redis.exceptions import RedisError

log = logging.getLogger("tokenyard.redis")
T = TypeVar("T")


class RedisUnavailable(Exception):
    """Redis failed (or is being skipped after a recent failure)."""


class RedisGuard:
    def __init__(self, metrics: Any, retry_s: float = 1.0) -> None:
        self.metrics = metrics
        self.retry_s = retry_s
        self._down_until = 0.0
        self._down = False

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.available():
            raise RedisUnavailable(f"redis skipped for {op}: it failed less than {self.retry_s} s ago")
        t0 = time.perf_counter()
        try:
            result = await fn()
        except (RedisError, OSError, TimeoutError) as e:
            self.failed(op, e)
            raise RedisUnavailable(f"redis failed during {op}: {type(e).__name__}: {e}") from e
        finally:
            self.metrics.redis_latency.labels(op).observe(time.perf_counter() - t0)
        if self._down:
            self._down = False
            log.info("redis is reachable again (%s)", op)
        return result

    def failed(self, op: str, e: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        self._down_until = time.monotonic() + self.retry_s
        if not self._down:
            self._down = True
            log.warning("redis unreachable during %s (%s: %s); retrying every %.1f s", op, type(e).__name__, e,
                        self.retry_s)
