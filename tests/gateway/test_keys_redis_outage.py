"""Redis unreachable (a private redis-server this test stops): cached keys still authenticate,
unknown keys are refused, and limits fail open or closed as configured."""
from __future__ import annotations

import json
import time

import redis
from gateway_helpers import PrivateRedis, mock_deployment, running_gateway

from tokenyard.gateway.auth.api_keys import KeyStore

BODY = {"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _doc(url: str, mode: str, ttl: float) -> dict:
    return {**mock_deployment(max_sleep_ms=5), "redis_url": url, "redis_prefix": "outage:",
            "redis_timeout_ms": 200, "auth": {"key_cache_ttl_s": ttl},
            "rate_limits": {"on_redis_error": mode, "redis_retry_s": 0.2, "requests": 1000, "tokens": 100000}}


def _chat(srv, key: str) -> tuple[int, dict, dict]:
    status, headers, body = srv.request("POST", "/v1/chat/completions", BODY, {"Authorization": f"Bearer {key}"},
                                        timeout=10)
    return status, headers, json.loads(body)


def test_redis_outage_keys_from_cache_and_limits_open_or_closed():
    private = PrivateRedis()
    try:
        client = redis.Redis(port=private.port)
        store = KeyStore(client, "outage:")
        cached, _ = store.create("acme")          # used before the outage: in both gateways' caches
        never_used, _ = store.create("acme")      # valid, but no gateway has seen it
        # "open" with a short cache TTL (so the record is stale and re-read fails), "closed" with a long one.
        with running_gateway(_doc(private.url, "open", 0.1)) as fail_open, \
                running_gateway(_doc(private.url, "closed", 60)) as fail_closed:
            for srv in (fail_open, fail_closed):
                status, headers, _ = _chat(srv, cached)
                assert status == 200 and "x-ratelimit-remaining-tokens" in headers
            private.stop()
            time.sleep(0.2)                       # past the open gateway's cache TTL
            t0 = time.monotonic()
            status, headers, body = _chat(fail_open, cached)
            assert status == 200, body            # authenticated from the (stale) cache, limits failed open
            assert "x-ratelimit-remaining-tokens" not in headers
            assert time.monotonic() - t0 < 1.0
            status, headers, body = _chat(fail_closed, cached)
            assert status == 503 and body["error"]["code"] == "rate_limiter_unavailable"
            assert int(headers["retry-after-ms"]) > 0
            for srv in (fail_open, fail_closed):
                status, _, body = _chat(srv, never_used)
                assert status == 503 and body["error"]["code"] == "auth_unavailable"   # never fail open on auth
                status, _, body = _chat(srv, "ty-not-a-real-key")
                assert status in (401, 503) and status != 200
            # Many requests during the outage stay fast: Redis is skipped between retries.
            t0 = time.monotonic()
            for _ in range(20):
                assert _chat(fail_open, cached)[0] == 200
            assert time.monotonic() - t0 < 2.0
            metrics = fail_open.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_rate_limit_redis_fallbacks_total{engine="mock",mode="open"}' in metrics
            assert "tokenyard_redis_errors_total{op=" in metrics
            closed_metrics = fail_closed.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_rate_limit_redis_fallbacks_total{engine="mock",mode="closed"}' in closed_metrics
            assert 'tokenyard_auth_failures_total{reason="unavailable"}' in closed_metrics
            health = json.loads(fail_open.request("GET", "/health")[2])
            assert health["status"] == "ok"
        client.close()
    finally:
        private.stop()
