"""What-if replay against reality: record traffic under policy A, simulate policy B over the
recorded spend records (POST /admin/policy/simulate), then apply B and send the very same requests
through the gateway again, and compare what the ledger actually charged with the prediction.

Tolerance: exact (0 micro-units, 0 requests). With mock engines the token counts are
deterministic (same tokenizer on both engines, fixed reply length, no prefix cache), the learned
router scores the same text identically, and both sides price with the same integer rounding
once per request, so any difference is a bug. (With real engines, completion lengths and prefix
cache hits differ per engine; the simulation then reuses the recorded counts, which is where its
error would come from.)"""
from __future__ import annotations

import json
import time
from collections import Counter

import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, chat, make_keys, put_policy, two_engine_deployment

from tests.gateway.test_spend_ledger import read_records

POLICY_B = BASE_POLICY.replace("  without_score: large\n", "  without_score: large\n  threshold: 0.5\n") + """\
rules:
  - name: beta-off
    match: {tenants: [beta]}
    action: {deny: "beta is off"}
  - name: batch-small
    match: {tags: {batch: "true"}}
    action: {pin: small, max_tokens: 4, priority: batch}
  - name: acme-router
    match: {tenants: acme, models: [large]}
    action: {router: true}
"""

TRAFFIC = [  # tenant, model, content, extra body
    ("acme", "auto", "Add 12 and 30.", {}),
    ("acme", "large", "Reverse the order of these words: red sun", {}),
    ("acme", "large", "Sort these numbers: 9 3 7 1", {"max_tokens": 8}),
    ("beta", "auto", "Upper-case this: hello", {}),
    ("beta", "small", "Count the letters in banana", {}),
    ("gamma", "auto", "What is the capital of France? Then add 2 and 2.", {"metadata": {"batch": "true"}}),
    ("gamma", "large", "Copy this text exactly: the quick brown fox", {"metadata": {"batch": "true"}}),
    ("gamma", "auto", "Reverse these words: one two three four five six", {}),
    ("acme", "auto", "Add 1234 and 4321, then reverse the digits of the result.", {}),
    ("gamma", "small", "Sort: pear apple fig", {"max_tokens": 6}),
]


def send_all(srv, keys) -> Counter:
    codes = Counter()
    for tenant, model, content, extra in TRAFFIC:
        codes[chat(srv, keys[tenant], content, model=model, **extra)[0]] += 1
    return codes


def test_simulation_predicts_the_replayed_spend_exactly():
    prefix = unique_prefix("polsim")
    keys = make_keys(prefix, "acme", "beta", "gamma")
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            assert put_policy(srv, keys["admin"], BASE_POLICY)[0] == 200          # policy A
            t_a = time.time()
            assert send_all(srv, keys) == Counter({200: len(TRAFFIC)})
            wait_ledger(srv)
            t_b = time.time()
            status, _, raw = srv.request("POST", f"/admin/policy/simulate?start={t_a - 1}&end={t_b}", POLICY_B,
                                         {**bearer(keys["admin"]), "Content-Type": "application/yaml"})
            assert status == 200, raw
            sim = json.loads(raw)
            assert sim["records"] == len(TRAFFIC) and sim["current_version"] == 1
            recorded = [r for r in read_records(client, prefix, ("acme", "beta", "gamma")) if r["time"] < t_b]
            # Replaying A under A gives back what was charged (sanity of the replay itself).
            assert sim["current"]["spend_total"] == sum(r["cost_micros"] for r in recorded)
            prop = sim["proposed"]
            assert prop["denied"] == 2 and prop["served"] == len(TRAFFIC) - 2

            assert put_policy(srv, keys["admin"], POLICY_B)[0] == 200            # now really run B
            codes = send_all(srv, keys)
            wait_ledger(srv)
            actual = [r for r in read_records(client, prefix, ("acme", "beta", "gamma")) if r["time"] >= t_b]
            assert codes == Counter({200: prop["served"], 403: prop["denied"]})
            by_engine = Counter()
            for r in actual:
                by_engine[r["engine"]] += r["cost_micros"]
                assert r["policy_version"] == 2
            # Tolerance: exact.
            assert sum(r["cost_micros"] for r in actual) == prop["spend_total"]
            assert dict(by_engine) == {e: v for e, v in prop["spend_by_engine"].items() if v or e in by_engine}
            assert Counter(r["engine"] for r in actual) == Counter(prop["requests_by_engine"])
            assert sum(r["engine"] == "large" for r in actual) == prop["large_calls"]
            by_tenant = Counter()
            for r in actual:
                by_tenant[r["tenant"]] += r["cost_micros"]
            assert dict(by_tenant) == prop["spend_by_tenant"]
            assert sim["proposed"]["spend_total"] != sim["current"]["spend_total"]   # B really differs
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
