"""Errors that retrying cannot fix say `x-should-retry: false`, so the real openai SDK (which retries
408, 409, 429 and 5xx on its own) sends a budget refusal once; the refusal speaks the policy's
currency units, not micro-units."""
from __future__ import annotations

import httpx2
import openai
import pytest
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, bearer, make_keys, put_policy, two_engine_deployment

from tests.gateway.test_policy_gateway_budget import seed_spend
from tokenyard.gateway.edge.errors import should_retry

POLICY = BASE_POLICY + """\
tenants:
  capped:
    budget: {per_day: "0.00005", at_limit: deny}
"""
MESSAGES = [{"role": "user", "content": "Add 12 and 30."}]


def _counting_client(srv, key: str, sent: list[str]) -> openai.OpenAI:
    hook = {"request": [lambda r: sent.append(r.url.path)]}
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=2, timeout=20,
                         http_client=httpx2.Client(event_hooks=hook))


def test_budget_refusal_is_sent_once_by_the_sdk_and_quotes_currency_units():
    prefix = unique_prefix("budgetsdk")
    keys = make_keys(prefix, "capped", "free")
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            assert put_policy(srv, keys["admin"], POLICY)[0] == 200
            seed_spend(prefix, "capped", 62)                  # 62 micro-units today, budget 50
            srv.gateway.budgets.forget()
            sent: list[str] = []
            client = _counting_client(srv, keys["capped"], sent)
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model="large", messages=MESSAGES)
            assert sent == ["/v1/chat/completions"], f"the SDK sent the refused request {len(sent)} times"
            assert e.value.response.headers["x-should-retry"] == "false"
            assert e.value.code == "insufficient_quota"
            assert "today's spend 0.000062 >= per_day 0.00005" in e.value.message
            # A bad request is not retried either (and says so); a good one carries no such header.
            status, headers, _ = srv.chat({"model": "large", "messages": []}, bearer(keys["free"]))
            assert status == 400 and headers["x-should-retry"] == "false"
            status, headers, _ = srv.chat({"model": "large", "messages": MESSAGES}, bearer(keys["free"]))
            assert status == 200 and "x-should-retry" not in headers
    finally:
        delete_prefix(SHARED_REDIS, prefix)


@pytest.mark.parametrize("status,code,expected", [
    (429, "insufficient_quota", False), (429, "request_too_large", False), (429, "rate_limit_exceeded", None),
    (400, None, False), (401, "invalid_api_key", False), (403, "policy_denied", False), (404, None, False),
    (413, "body_too_large", False), (422, "invalid_policy", False), (408, "request_timeout", None),
    (409, "version_conflict", None), (500, None, None), (503, "overloaded", None)])
def test_should_retry_by_status_and_code(status, code, expected):
    assert should_retry(status, code) is expected
