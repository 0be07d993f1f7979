"""A what-if under the policy in force equals the ledger, to the micro-unit, whatever the traffic
mix (issue 45.3): n > 1 chat choices, multi-prompt text completions (n > 1 too), Batch API lines
(charged the policy's batch price), prefix-cache hits (cached prompt tokens, priced lower),
streaming, and a policy rule that caps max_tokens and one that routes by prompt length.

Through the gateway on two mock engines; the mock reports no cache hits of its own, so its step
is wrapped to report half of each prompt as cached (deterministic), which is what a real prefix
cache hit looks like in the usage record. Tolerance: exact (0 micro-units), per tenant and total.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import redis
from batch_helpers import client as sdk_client
from batch_helpers import jsonl, wait_batch
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, sse_events, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, chat, make_keys, put_policy, two_engine_deployment

from tests.gateway.test_spend_ledger import read_records

POLICY = BASE_POLICY + """\
batch_price_percent: 40
rules:
  - name: acme-capped
    match: {tenants: [acme]}
    action: {pin: small, max_tokens: 6}
  - name: long-prompts-large
    match: {prompt_tokens: {min: 40}}
    action: {pin: large}
  - name: short-prompts-small
    match: {prompt_tokens: {max: 39}}
    action: {pin: small}
"""

SHORT = "Add 1 and 2."
LONG = "Reverse the order of these words, then count them: " + " ".join(["alpha beta gamma delta"] * 3)


def _report_cache_hits(engine) -> None:
    """Half of every prompt reported as a prefix-cache hit (what the engine's usage would say)."""
    step = engine.step

    def wrapped():
        outs = step()
        for out in outs:
            out.num_cached_tokens = out.num_prompt_tokens // 2
        return outs
    engine.step = wrapped


def _completions(srv, key: str, body: dict) -> tuple[int, dict]:
    status, _, raw = srv.request("POST", "/v1/completions", body, bearer(key))
    return status, json.loads(raw)


def _send(srv, keys) -> None:
    # n > 1 under the rule's max_tokens cap: 3 choices of 6 tokens each
    status, _, body = chat(srv, keys["acme"], "Add 12 and 30.", n=3)
    assert status == 200 and len(body["choices"]) == 3, body
    assert body["usage"]["completion_tokens"] == 18
    # a text-completion batch of two prompts (the longer one routes), n = 2, max_tokens 5
    status, body = _completions(srv, keys["beta"], {"model": "auto", "prompt": [SHORT, LONG], "n": 2,
                                                    "max_tokens": 5})
    assert status == 200 and len(body["choices"]) == 4, body
    # the same shape where the longest prompt alone is short but the prompts together are long
    status, body = _completions(srv, keys["beta"], {"model": "auto", "prompt": [SHORT] * 6 + ["Add 3 and 4. " * 2]})
    assert status == 200, body
    # streaming, with usage
    status, _, raw = srv.request("POST", "/v1/chat/completions",
                                 {"model": "auto", "stream": True, "stream_options": {"include_usage": True},
                                  "messages": [{"role": "user", "content": LONG}]}, bearer(keys["beta"]))
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    assert chat(srv, keys["beta"], SHORT, model="large")[0] == 200
    # Batch API lines: charged batch_price_percent of the prices
    c = sdk_client(srv, keys["gamma"])
    _batch(c, "/v1/chat/completions", [{"model": "auto", "n": 2, "max_tokens": 3,
                                        "messages": [{"role": "user", "content": SHORT}]},
                                       {"model": "auto", "messages": [{"role": "user", "content": LONG}]}])
    _batch(c, "/v1/completions", [{"model": "auto", "prompt": [SHORT, LONG], "n": 2, "max_tokens": 4}])


def _batch(c, url: str, bodies: list[dict]) -> None:
    lines = [json.dumps({"custom_id": f"l{i}", "method": "POST", "url": url, "body": b}) for i, b in enumerate(bodies)]
    f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
    done = wait_batch(c, b.id)
    assert done.status == "completed" and done.request_counts.completed == len(bodies), done


def test_simulate_under_the_current_policy_equals_the_ledger():
    prefix = unique_prefix("simledger")
    keys = make_keys(prefix, "acme", "beta", "gamma")
    rc = redis.Redis.from_url(SHARED_REDIS)
    doc = two_engine_deployment(prefix, batch={"lease_s": 1.0, "poll_s": 0.05})
    try:
        with running_gateway(doc) as srv:
            for name in ("small", "large"):
                _report_cache_hits(srv.engine(name).engine)
            assert put_policy(srv, keys["admin"], POLICY)[0] == 200
            t0 = time.time()
            _send(srv, keys)
            wait_ledger(srv)
            t1 = time.time()
            recorded = read_records(rc, prefix, ("acme", "beta", "gamma"))
            assert len(recorded) == 8
            # the mix really is mixed (else the test proves nothing)
            assert any(r["cached_tokens"] for r in recorded)
            assert sum(r.get("tenant") == "gamma" for r in recorded) == 3
            assert {r["engine"] for r in recorded} == {"small", "large"}
            status, _, raw = srv.request("POST", f"/admin/policy/simulate?start={t0 - 1}&end={t1 + 1}", POLICY,
                                         {**bearer(keys["admin"]), "Content-Type": "application/yaml"})
            assert status == 200, raw
            sim = json.loads(raw)
            assert sim["records"] == len(recorded)
            ledger_by_tenant = Counter()
            for r in recorded:
                ledger_by_tenant[r["tenant"]] += r["cost_micros"]
            for side in ("current", "proposed"):      # the same document on both sides
                # Tolerance: exact, in integer micro-units.
                assert sim[side]["spend_total"] == sum(r["cost_micros"] for r in recorded), side
                assert sim[side]["spend_by_tenant"] == dict(ledger_by_tenant), side
                assert sim[side]["requests_by_engine"] == dict(Counter(r["engine"] for r in recorded)), side
            assert sim["delta"]["spend_total"] == 0
    finally:
        rc.close()
        delete_prefix(SHARED_REDIS, prefix)
