"""A key's own --rpm/--tpm is never loosened by a policy's rate class: with the shipped default
policy (tokenyard/policies/examples/default.yaml: every tenant in the "standard" class, 600 requests per
minute) a key made with --rpm 5 gets 5 requests, and its headers say 5. The class still limits the
tenant's keys together, and a stricter class tightens a key's looser limit."""
from __future__ import annotations

import redis
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix
from policy_gateway_helpers import MODEL, bearer, put_policy

from tokenyard.gateway.auth.api_keys import KeyStore

SHIPPED_POLICY = (ROOT / "tokenyard" / "policies" / "examples" / "default.yaml").read_text()
MESSAGES = [{"role": "user", "content": "Add 12 and 30."}]


def _deployment(prefix: str) -> dict:
    doc = mock_deployment()
    # Mock engines under the names the shipped policy prices and routes between.
    doc["engines"] = {n: {"type": "mock", "model": MODEL, "output_len": 4} for n in
                      ("demo-small", "demo-large", "smollm2-135m")}
    doc.update({"redis_url": SHARED_REDIS, "redis_prefix": prefix,
                "routing": {"small": "demo-small", "large": "demo-large"}})
    return doc


def test_key_rpm_wins_over_the_shipped_policy_rate_class():
    prefix = unique_prefix("keyrpm")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    five = store.create("acme", name="five", rpm=5)[0]
    other = store.create("acme", name="other")[0]                # no limits of its own
    trial = store.create("trial-co", name="loose", rpm=1000)[0]  # looser than its class (burst 20)
    admin = store.create("ops", role="admin", name="ops-admin")[0]
    client.close()
    try:
        with running_gateway(_deployment(prefix)) as srv:
            assert put_policy(srv, admin, SHIPPED_POLICY)[0] == 200
            results = [srv.chat({"model": "demo-small", "messages": MESSAGES}, bearer(five)) for _ in range(8)]
            statuses = [s for s, _, _ in results]
            assert statuses == [200] * 5 + [429] * 3, statuses
            first, refused = results[0][1], results[5]
            assert first["x-ratelimit-limit-requests"] == "5" and first["x-ratelimit-remaining-requests"] == "4"
            assert refused[2]["error"]["code"] == "rate_limit_exceeded"
            assert refused[1]["x-ratelimit-limit-requests"] == "5" and "retry-after" in refused[1]
            assert f"key {store_key_id(prefix, 'five')}" in refused[2]["error"]["message"]
            # The tenant's class still counts every key of the tenant together: 5 + 1 taken (less what
            # the bucket regained since, 10 a second), and the refused 3 were charged nowhere.
            status, headers, _ = srv.chat({"model": "demo-small", "messages": MESSAGES}, bearer(other))
            assert status == 200 and headers["x-ratelimit-limit-requests"] == "600"
            assert 594 <= int(headers["x-ratelimit-remaining-requests"]) <= 599
            # A class stricter than the key's own limit governs: trial's burst is 20 requests.
            status, headers, _ = srv.chat({"model": "demo-small", "messages": MESSAGES}, bearer(trial))
            assert status == 200 and headers["x-ratelimit-limit-requests"] == "20"
            assert headers["x-ratelimit-remaining-requests"] == "19"
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def store_key_id(prefix: str, name: str) -> str:
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        return next(r.key_id for r in KeyStore(client, prefix).list() if r.name == name)
    finally:
        client.close()
