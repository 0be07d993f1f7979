"""Shared pieces of the test_policy_gateway_* files: two mock engines (small, large) on one
tokenizer, the learned router, the shared Redis under a unique prefix, keys and policy documents."""
from __future__ import annotations

import json
import time
from typing import Any

import redis
from gateway_helpers import ROOT, SHARED_REDIS, mock_deployment

from tokenyard.gateway.auth.api_keys import KeyStore

ARTIFACT = str(ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json")
MODEL = str(ROOT / "models" / "demo-small")

BASE_POLICY = """\
version: 1
description: test policy
engines:
  small: small
  large: large
prices:
  small: {input: 0.1, cached_input: 0.05, output: 0.4}
  large: {input: 1, cached_input: 0.5, output: 4}
router:
  without_score: large
"""


def two_engine_deployment(prefix: str, small: dict | None = None, large: dict | None = None,
                          **top: Any) -> dict[str, Any]:
    doc = mock_deployment()
    doc["engines"] = {
        "small": {"type": "mock", "model": MODEL, "output_len": 12, "prices": {"input": 1, "output": 1},
                  **(small or {})},
        "large": {"type": "mock", "model": MODEL, "output_len": 12, "prices": {"input": 1, "output": 1},
                  **(large or {})}}
    doc.update({"redis_url": SHARED_REDIS, "redis_prefix": prefix, "routing": {"small": "small", "large": "large"},
                "router": {"artifact": ARTIFACT}, **top})
    return doc


def make_keys(prefix: str, *tenants: str) -> dict[str, str]:
    """One user key per tenant, plus "admin" (an admin key named ops-admin)."""
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        store = KeyStore(client, prefix)
        keys = {t: store.create(t, name=f"{t}-key")[0] for t in tenants}
        keys["admin"] = store.create("ops", role="admin", name="ops-admin")[0]
        return keys
    finally:
        client.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def put_policy(srv, admin_key: str, text: str, content_type: str = "application/yaml") -> tuple[int, Any]:
    status, _, body = srv.request("PUT", "/admin/policy", text,
                                  {**bearer(admin_key), "Content-Type": content_type})
    return status, json.loads(body)


def chat(srv, key: str, content: str = "Add 12 and 30.", model: str = "auto", headers: dict | None = None,
         **body: Any) -> tuple[int, dict[str, str], Any]:
    return srv.chat({"model": model, "messages": [{"role": "user", "content": content}], **body},
                    {**bearer(key), **(headers or {})})


def wait_for(predicate, timeout: float = 5.0, step: float = 0.01) -> float:
    """Seconds until predicate() is true (AssertionError after timeout)."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(step)
    return time.monotonic() - t0
