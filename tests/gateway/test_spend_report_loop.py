"""A large spend report is built off the event loop (issue 46.8): while GET /v1/spend/report groups
25,000 stream records into ~25,000 groups (two dimensions at once: the request stream is read),
/health keeps answering.

Before, grouping, JSON encoding and a 10,000-record page of parsing each ran on the loop in one
piece: /health stalled 2.5 s for 40,000 records on the test machine. Bound: the slowest /health
answer while the report is built stays under 0.5 s (what remains is 200-record parsing slices and
the scheduling of a loaded 2-core machine)."""
from __future__ import annotations

import json
import random
import threading
import time

import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.spend.redis_keys import stream_key, tenants_key
from tokenyard.gateway.spend.usage import UsageRecord

N = 25_000
HEALTH_BOUND_S = 0.5


def _write(prefix: str) -> None:
    """The records straight into the tenant's request stream (what the ledger's script XADDs): the
    stream-sourced report reads nothing else, and this is seconds faster than the script per record."""
    rng = random.Random(3)
    now = time.time()
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(N):
            rec = UsageRecord(request_id=f"r{i}", time=now - rng.randint(0, 3000), engine="mock",
                              requested_model="auto", route_reason="pinned", prompt_tokens=10, cached_tokens=0,
                              completion_tokens=5, cost_micros=rng.randint(0, 1000), status="ok",
                              finish_reason="stop", ttft_s=0.01, e2e_s=0.02, stream=False, tenant="acme",
                              key_id=f"k{i % 50}", user=f"u{rng.randint(0, 5000)}",
                              tags={"team": rng.choice(["a", "b", "c"])})
            pipe.xadd(stream_key(prefix, "acme"), {"r": json.dumps(rec.to_dict(), separators=(",", ":"))})
        pipe.sadd(tenants_key(prefix), "acme")
        pipe.execute()
    finally:
        client.close()


def test_health_answers_while_a_large_report_is_built():
    prefix = unique_prefix("reploop")
    client = redis.Redis.from_url(SHARED_REDIS)
    admin = KeyStore(client, prefix).create("ops", role="admin")[0]
    client.close()
    try:
        _write(prefix)
        with running_gateway({**mock_deployment(), "redis_url": SHARED_REDIS, "redis_prefix": prefix}) as srv:
            result: dict = {}

            def report() -> None:
                t0 = time.monotonic()
                status, _, body = srv.request("GET", "/v1/spend/report?group_by=key,user&start=2h",
                                              headers={"Authorization": f"Bearer {admin}"}, timeout=120)
                result.update(status=status, body=body, seconds=time.monotonic() - t0)

            worker = threading.Thread(target=report)
            worker.start()
            health: list[float] = []
            while worker.is_alive():
                t0 = time.monotonic()
                assert srv.request("GET", "/health", headers={"Authorization": ""})[0] == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.01)
            worker.join()
            assert result["status"] == 200, result["body"][:300]
            report_body = json.loads(result["body"])
            assert report_body["source"] == "stream" and report_body["total"]["requests"] == N
            assert len(health) >= 5, (len(health), result["seconds"])     # the report took a while
            assert max(health) < HEALTH_BOUND_S, (max(health), result["seconds"], len(health))
    finally:
        delete_prefix(SHARED_REDIS, prefix)
