"""Budgets are held at admission (worst-case cost, atomically in Redis) and settled with the actual
cost: concurrent requests against a small budget overshoot it by at most one request's worst case
(it was 39x with the check-before, charge-after rule), every hold is settled or released, and a
hold whose gateway died expires and is given back."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import redis.asyncio as aioredis
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, make_keys, put_policy, two_engine_deployment, wait_for

from tokenyard.gateway.spend.budget_hold import BudgetHolds, BudgetReached, Meter
from tokenyard.policies.budgets import Scope
from tokenyard.policies.schema import Budget

MAX_TOKENS = 16
CONCURRENT = 32
POLICIES = {
    "key": BASE_POLICY + 'tenants:\n  acme:\n    key_budgets:\n      "*": {per_day: "0.0002", at_limit: deny}\n',
    "tenant": BASE_POLICY + 'tenants:\n  acme:\n    budget: {per_day: "0.0002", at_limit: deny}\n',
}
LIMIT = 200     # micro-units


@pytest.mark.parametrize("scope", ["key", "tenant"])
def test_concurrent_requests_overshoot_a_budget_by_at_most_one_request(scope):
    prefix = unique_prefix(f"budgethold{scope}")
    keys = make_keys(prefix, "acme")
    # Every request is in flight at once: the first token comes 300 ms after arrival.
    doc = two_engine_deployment(prefix, large={"ttft_ms": 300, "output_len": 12})
    try:
        with running_gateway(doc) as srv:
            assert put_policy(srv, keys["admin"], POLICIES[scope])[0] == 200
            body = {"model": "large", "messages": [{"role": "user", "content": "Add 12 and 30."}],
                    "max_tokens": MAX_TOKENS}
            with ThreadPoolExecutor(CONCURRENT) as pool:
                results = list(pool.map(lambda _: srv.chat(body, bearer(keys["acme"])), range(CONCURRENT)))
            wait_ledger(srv)
            ok = [r for r in results if r[0] == 200]
            refused = [r for r in results if r[0] != 200]
            assert all(r[0] == 429 and r[2]["error"]["code"] == "insufficient_quota" for r in refused), refused[:1]
            assert all(r[1]["x-should-retry"] == "false" for r in refused)
            records = [r for r in srv.gateway.usage.records if r.tenant == "acme"]
            assert len(records) == len(ok) >= 1
            spent = sum(r.cost_micros for r in records)
            # Prices: large input 1, output 4 per 1M tokens = 1 and 4 micro-units per token.
            worst = records[0].prompt_tokens * 1 + MAX_TOKENS * 4
            assert spent <= LIMIT + worst, f"spent {spent} against a budget of {LIMIT} (one request: {worst})"
            assert len(ok) >= LIMIT // worst            # refused only once the holds reached the limit
            # Every hold was settled with its actual cost: the meter equals what the records cost.
            # (settles run in the background: wait for the last one)
            client = redis.Redis.from_url(SHARED_REDIS)
            meters = [k for k in client.scan_iter(match=f"{prefix}bm:*") if not k.endswith(b":held")]
            assert len(meters) == 1
            wait_for(lambda: client.zcard(meters[0] + b":held") == 0)
            assert int(client.get(meters[0])) == spent
            client.close()
            # What the worst cases held and did not spend came back: below the limit, one more is served.
            if spent < LIMIT:
                assert srv.chat(body, bearer(keys["acme"]))[0] == 200
            status, _, refused_body = srv.chat(body, bearer(keys["acme"]))
            assert status == 429 and "counting requests in flight" in refused_body["error"]["message"]
            wait_ledger(srv)
            assert sum(r.cost_micros for r in srv.gateway.usage.records if r.tenant == "acme") <= LIMIT + worst
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_an_unsettled_hold_expires_and_is_given_back():
    prefix = unique_prefix("budgetholdttl")

    class Guard:
        async def call(self, op, fn):
            return await fn()

    async def run() -> None:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        holds = BudgetHolds(client, prefix, Guard(), None, ttl_s=0.2)
        meter = Meter(Scope("", "", "", Budget(per_day=100, at_limit="deny")), "day", 100, 0, True)
        now = time.time()
        await holds.reserve("t", [meter], 60, now)       # the gateway "dies": never settled
        second = await holds.reserve("t", [meter], 60, now)     # 60 < 100: admitted, 120 held
        with pytest.raises(BudgetReached) as e:
            await holds.reserve("t", [meter], 1, now)
        assert e.value.value == 120
        key = holds._meter_key("t", meter, now)
        second.settle(10)                                 # 50 of its 60 come back
        await holds.drain()
        assert int(await client.get(key)) == 70
        await asyncio.sleep(0.25)                         # the first hold expires: its 60 come back
        third = await holds.reserve("t", [meter], 5, now)
        assert int(await client.get(key)) == 15
        third.release()
        await holds.drain()
        assert int(await client.get(key)) == 10 and await client.zcard(key + ":held") == 0
        await client.aclose()

    try:
        asyncio.run(run())
    finally:
        delete_prefix(SHARED_REDIS, prefix)
