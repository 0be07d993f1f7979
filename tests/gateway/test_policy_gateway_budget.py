"""Budgets through real requests: the tenant's spend so far comes from the spend rollups (seeded
here as the ledger would have written them), and at the limit the policy downgrades or denies."""
from __future__ import annotations

import time

import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, chat, make_keys, put_policy, two_engine_deployment

from tokenyard.gateway.spend.redis_keys import hours_key, rollup_key, tenants_key

POLICY = BASE_POLICY + """\
tenants:
  thrifty:
    budget: {per_day: 1, at_limit: downgrade}
  capped:
    budget: {per_month: "2.5", at_limit: deny}
"""


def seed_spend(prefix: str, tenant: str, micros: int, hours_ago: int = 0) -> None:
    """What the ledger's Lua script leaves for records worth `micros` in an hour of this UTC day/month."""
    client = redis.Redis.from_url(SHARED_REDIS)
    hour = int(time.time()) // 3600 - hours_ago
    client.hincrby(rollup_key(prefix, tenant, hour), "large|cost_micros", micros)
    client.hincrby(rollup_key(prefix, tenant, hour), "large|requests", 1)
    client.zadd(hours_key(prefix, tenant), {str(hour): hour})
    client.sadd(tenants_key(prefix), tenant)
    client.close()


def test_budget_downgrade_and_deny_from_the_rollups():
    prefix = unique_prefix("polbudget")
    keys = make_keys(prefix, "thrifty", "capped")
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            assert put_policy(srv, keys["admin"], POLICY)[0] == 200
            # Under budget: the client's engine.
            status, headers, _ = chat(srv, keys["thrifty"], model="large")
            assert status == 200 and headers["x-tokenyard-engine"] == "large"
            status, headers, _ = chat(srv, keys["capped"], model="large")
            assert status == 200 and headers["x-tokenyard-engine"] == "large"
            # Today's spend reaches the per_day budget (1 unit = 1,000,000 micro-units); this month's 2.5.
            seed_spend(prefix, "thrifty", 1_000_000)
            seed_spend(prefix, "capped", 2_500_000)
            srv.gateway.budgets.forget()                     # skip the 2 s per-tenant cache
            status, headers, body = chat(srv, keys["thrifty"], model="large")
            assert status == 200 and headers["x-tokenyard-engine"] == "small"
            assert headers["x-tokenyard-route-reason"] == "budget_downgrade"
            status, headers, body = chat(srv, keys["capped"], model="large")
            assert status == 429 and body["error"]["code"] == "insufficient_quota"
            assert body["error"]["type"] == "insufficient_quota"
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_budget_checks_total{outcome="reached"} 2.0' in metrics
            assert 'tokenyard_budget_checks_total{outcome="within"} 2.0' in metrics
            assert 'tokenyard_policy_decisions_total{action="downgrade"} 1.0' in metrics
            assert 'tokenyard_policy_decisions_total{action="budget_deny"} 1.0' in metrics
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_budget_check_fails_open_when_redis_cannot_be_read():
    prefix = unique_prefix("polbudgetdown")
    keys = make_keys(prefix, "capped")
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            assert put_policy(srv, keys["admin"], POLICY)[0] == 200
            seed_spend(prefix, "capped", 9_000_000)
            srv.gateway.budgets.forget()


            class Down:                                # a client whose every pipeline fails
                def pipeline(self, **_):
                    raise redis.ConnectionError("down")
            srv.gateway.budgets.redis = Down()
            status, headers, _ = chat(srv, keys["capped"], model="large")
            assert status == 200                                   # served: budgets fail open
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_budget_checks_total{outcome="unavailable"} 1.0' in metrics
    finally:
        delete_prefix(SHARED_REDIS, prefix)
