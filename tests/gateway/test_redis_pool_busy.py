"""A full Redis pool is load, not an outage (tokenyard/gateway/store/redis_guard.py): calls beyond the guard's
places wait a bounded time and are then shed with 503 gateway_busy + Retry-After; Redis stays
"available", no error is counted, nothing fails open. A real outage still is one. And the
pool built by the gateway is a blocking one of the configured size."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from gateway_helpers import SHARED_REDIS, mock_deployment, running_gateway, unique_prefix
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.store.redis_guard import RedisBusy, RedisGuard, RedisUnavailable, is_pool_exhausted


def _errors(metrics: GatewayMetrics) -> float:
    return sum(s.value for m in metrics.redis_errors.collect() for s in m.samples if s.name.endswith("_total"))


def test_calls_beyond_the_places_are_shed_as_busy_not_down():
    async def main():
        metrics = GatewayMetrics(lambda: {})
        guard = RedisGuard(metrics, retry_s=5.0, max_in_flight=2, wait_s=0.1)

        async def slow():
            await asyncio.sleep(0.4)
            return "ok"

        results = await asyncio.gather(*(guard.call("rate_limit", slow) for _ in range(3)), return_exceptions=True)
        assert results.count("ok") == 2
        busy = [r for r in results if isinstance(r, RedisBusy)]
        assert len(busy) == 1 and busy[0].status == 503 and busy[0].code == "gateway_busy"
        assert "retry-after" in busy[0].headers and not isinstance(busy[0], RedisUnavailable)
        assert guard.available() and _errors(metrics) == 0 and guard.busy_count == 1

        async def pool_dry():
            raise MaxConnectionsError("Too many connections")
        with pytest.raises(RedisBusy):
            await guard.call("key_lookup", pool_dry)
        assert guard.available() and _errors(metrics) == 0

        async def down():
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        with pytest.raises(RedisUnavailable):
            await guard.call("key_lookup", down)
        assert not guard.available() and _errors(metrics) == 1
    asyncio.run(main())


def test_pool_exhaustion_errors_are_recognised():
    assert is_pool_exhausted(MaxConnectionsError("Too many connections"))
    assert is_pool_exhausted(RedisConnectionError("No connection available."))
    assert not is_pool_exhausted(RedisConnectionError("Connection refused"))


def test_gateway_builds_a_blocking_pool_of_the_configured_size():
    doc = {**mock_deployment(), "redis_url": SHARED_REDIS, "redis_prefix": unique_prefix("pool"),
           "redis_pool_size": 7, "redis_pool_wait_ms": 300}
    with running_gateway(doc) as srv:
        pool = srv.gateway.redis.connection_pool
        assert isinstance(pool, aioredis.BlockingConnectionPool)
        assert pool.max_connections == 7 + 8 and pool.timeout == 0.3
        assert srv.gateway.guard.max_in_flight == 7 and srv.gateway.guard.wait_s == 0.3


def test_a_timeout_while_the_loop_is_late_is_busy_not_an_outage():
    from redis.exceptions import TimeoutError as RedisTimeoutError

    async def main():
        metrics = GatewayMetrics(lambda: {})
        guard = RedisGuard(metrics, retry_s=5.0, max_in_flight=4, wait_s=0.1)

        async def timeout():
            raise RedisTimeoutError("Timeout reading from socket")
        with pytest.raises(RedisUnavailable):           # loop on time: a timeout is an outage
            await guard.call("rate_limit", timeout)
        guard._down_until = 0.0
        await asyncio.sleep(0.06)
        import time
        time.sleep(0.3)                                  # the loop falls behind (a thousand tasks)
        await asyncio.sleep(0.06)
        assert guard.loop_is_late()
        with pytest.raises(RedisBusy):
            await guard.call("rate_limit", timeout)
        assert guard.available() and _errors(metrics) == 1
    asyncio.run(main())
