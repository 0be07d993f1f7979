"""Edges the rest of the suite let through (issue 45.12): each test here fails when its mutation is
applied (checked by hand when it was written):
  - the limiter never refunding the tokens a request did not use (only the upper bound was tested);
  - cached prompt tokens billed at the full input price (the mock engine always reported 0 cached);
  - a rule's inclusive prompt_tokens bounds made exclusive (no rule was evaluated at its boundary),
    and a budget reached at, not only over, its limit."""
from __future__ import annotations

import time
from datetime import datetime, timezone

import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix
from policy_gateway_helpers import bearer

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.policies import EngineState, RequestFeatures, TenantSpend, decide, load_policy

MESSAGES = [{"role": "user", "content": "Add 12 and 30."}]


def _key(prefix: str, tenant: str) -> str:
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        return KeyStore(client, prefix).create(tenant)[0]
    finally:
        client.close()


def test_unused_tokens_are_available_again_exactly():
    prefix = unique_prefix("refundexact")
    # 1000 tokens an hour: the bucket regains 0.28 tokens a second, so the counts below are exact
    # (remaining is floored) for the second or two the test takes.
    doc = {**mock_deployment(output_len=4), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"window_s": 3600, "requests": 0, "tokens": 1000}}
    key = _key(prefix, "acme")
    try:
        with running_gateway(doc) as srv:
            body = {"model": "mock", "messages": MESSAGES, "max_tokens": 200}
            status, headers, first = srv.chat(body, bearer(key))
            p, c = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
            assert status == 200 and c < 10
            assert int(headers["x-ratelimit-remaining-tokens"]) == 1000 - (p + 200)      # reserved the worst case
            time.sleep(0.3)                                                               # the refund runs after the reply
            status, headers, _ = srv.chat(body, bearer(key))
            # The first request's unused 200 - c came back: it holds p + c, the second p + 200.
            assert status == 200 and int(headers["x-ratelimit-remaining-tokens"]) == 1000 - (p + c) - (p + 200)
            # ...so a request that fits only with those tokens back is admitted.
            time.sleep(0.3)
            left = 1000 - 2 * (p + c)
            status, _, body3 = srv.chat({**body, "max_tokens": left - p}, bearer(key))
            assert status == 200, body3
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_cached_prompt_tokens_are_billed_at_the_cached_price():
    # Deployment prices are micro-units per 1M tokens: 3, 1 and 5 micro-units a token (exact, no rounding).
    doc = mock_deployment(output_len=6, cached_tokens=5,   # (6 tokens, then EOS)
                          prices={"input": 3_000_000, "cached_input": 1_000_000, "output": 5_000_000})
    with running_gateway(doc) as srv:
        status, _, body = srv.chat({"model": "mock", "messages": MESSAGES}, None)
        assert status == 200
        u = body["usage"]
        p, c = u["prompt_tokens"], u["completion_tokens"]
        assert u["prompt_tokens_details"]["cached_tokens"] == 5 and c > 0 and p > 5
        rec = srv.gateway.usage.records[-1]
        assert rec.cached_tokens == 5
        assert rec.cost_micros == (p - 5) * 3 + 5 * 1 + c * 5          # not p * 3 + c * 5


POLICY = """\
version: 1
engines: {small: demo-small, large: demo-large}
prices:
  demo-small: {input: 0.05, cached_input: 0.01, output: 0.2}
  demo-large: {input: 0.25, cached_input: 0.05, output: 1.0}
rules:
  - name: mid-small
    match: {prompt_tokens: {min: 100, max: 200}}
    action: {pin: demo-small}
  - name: top-only
    match: {prompt_tokens: {max: 50}}
    action: {pin: demo-small, max_tokens: 8}
tenants:
  capped:
    budget: {per_day: "0.0001", at_limit: deny}
"""
NOON = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
IDLE = {"demo-small": EngineState(10.0), "demo-large": EngineState(10.0)}


def _decide(prompt_tokens: int, tenant: str = "t1", spend: TenantSpend = TenantSpend()):
    r = RequestFeatures(tenant=tenant, time=NOON, prompt_tokens=prompt_tokens, max_tokens=256)
    return decide(load_policy(POLICY), r, spend, IDLE, 0.0)


def test_rule_prompt_token_bounds_are_inclusive_at_both_ends():
    assert [_decide(n).reason for n in (99, 100, 101, 199, 200, 201)] == \
        ["router", "rule:mid-small", "rule:mid-small", "rule:mid-small", "rule:mid-small", "router"]
    assert [(_decide(n).reason, _decide(n).max_tokens) for n in (49, 50, 51)] == \
        [("rule:top-only", 8), ("rule:top-only", 8), ("router", 256)]


def test_budget_is_reached_at_its_limit_not_only_over_it():
    assert not _decide(10, "capped", TenantSpend(today=99, month=99)).denied
    d = _decide(10, "capped", TenantSpend(today=100, month=100))
    assert d.denied and d.error.code == "insufficient_quota"
