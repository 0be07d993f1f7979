"""The policy admin API and the request path under a policy, through real requests (mock engines,
shared Redis under a unique prefix): precise 422s, rule order, rollback to the exact hash, caps,
rate classes, the learned router's wiring (headers, metrics, usage record), start-up import."""
from __future__ import annotations

import json

import pytest
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, chat, make_keys, put_policy, two_engine_deployment

from tokenyard.gateway.config.deployment import parse_deployment
from tokenyard.gateway.server.app import create_app
from tokenyard.gateway.state import StartupError

BAD = BASE_POLICY + """\
rules:
  - name: cap
    match:
      prompt_tokens: {min: 10, max: lots}
    action:
      priority: urgent
"""


def where(token: str) -> tuple[int, int]:
    """1-based line and column of token in BAD, as an editor shows them."""
    for n, line in enumerate(BAD.splitlines(), 1):
        if token in line:
            return n, line.index(token) + 1
    raise AssertionError(token)


@pytest.fixture
def gw():
    prefix = unique_prefix("polapi")
    keys = make_keys(prefix, "acme", "beta")
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            yield srv, keys, prefix
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_invalid_policy_is_422_with_line_column_path_and_running_policy_stays(gw):
    srv, keys, _ = gw
    assert put_policy(srv, keys["admin"], BASE_POLICY)[0] == 200
    status, body = put_policy(srv, keys["admin"], BAD)
    assert status == 422 and body["error"]["code"] == "invalid_policy"
    problems = {p["path"]: p for p in body["error"]["problems"]}
    bad_max = problems["rules[0].match.prompt_tokens.max"]
    assert (bad_max["line"], bad_max["column"]) == where("lots") and "integer" in bad_max["message"]
    prio = problems["rules[0].action.priority"]
    assert (prio["line"], prio["column"]) == where("urgent") and prio["allowed"] == ["interactive", "batch"]
    # Unknown engine for this deployment: valid schema, refused with the allowed engines.
    status, body = put_policy(srv, keys["admin"], BASE_POLICY.replace("small: small\n", "small: tiny\n", 1)
                              .replace("  small: {", "  tiny: {"))
    assert status == 422 and body["error"]["problems"][0]["path"] == "engines.small"
    assert body["error"]["problems"][0]["allowed"] == ["large", "small"]
    current = json.loads(srv.request("GET", "/admin/policy", headers=bearer(keys["admin"]))[2])
    assert current["version"] == 1 and srv.gateway.policy.number == 1
    # Tenant keys may not touch policies; JSON bodies work (and errors point into the JSON).
    assert put_policy(srv, keys["acme"], BASE_POLICY)[0] == 403
    assert srv.request("GET", "/admin/policy/history", headers=bearer(keys["acme"]))[0] == 403
    import yaml
    as_json = json.dumps(yaml.safe_load(BASE_POLICY.replace("test policy", "json policy")), indent=1)
    status, body = put_policy(srv, keys["admin"], as_json, "application/json")
    assert status == 200 and body["version"] == 2 and body["author"] == "ops-admin"
    status, body = put_policy(srv, keys["admin"], '{"version": 1, "engines": {"small": "small"}}', "application/json")
    assert status == 422 and all(p["line"] == 1 for p in body["error"]["problems"])


def test_rule_order_decides_through_real_requests(gw):
    srv, keys, _ = gw
    pin_first = BASE_POLICY + """\
rules:
  - name: acme-large
    match: {tenants: [acme]}
    action: {pin: large, max_tokens: 3}
  - name: acme-deny
    match: {tenants: acme}
    action: {deny: "acme is paused"}
"""
    assert put_policy(srv, keys["admin"], pin_first)[0] == 200
    status, headers, body = chat(srv, keys["acme"], model="small")
    assert status == 200 and headers["x-tokenyard-engine"] == "large"
    assert headers["x-tokenyard-route-reason"] == "rule:acme-large" and headers["x-tokenyard-policy-version"] == "1"
    assert body["usage"]["completion_tokens"] == 3                       # the rule's cap
    status, headers, body = chat(srv, keys["beta"], model="small")      # no rule: the client's engine
    assert status == 200 and headers["x-tokenyard-engine"] == "small" and headers["x-tokenyard-route-reason"] == "pinned"
    # The same two rules the other way round: the deny now comes first.
    acme_rule = "  - name: acme-large\n    match: {tenants: [acme]}\n    action: {pin: large, max_tokens: 3}\n"
    deny_first = pin_first.replace(acme_rule, "") + acme_rule
    assert put_policy(srv, keys["admin"], deny_first)[0] == 200
    status, headers, body = chat(srv, keys["acme"], model="small")
    assert status == 403 and body["error"]["code"] == "policy_denied" and body["error"]["message"] == "acme is paused"
    assert body["error"]["type"] == "permission_error"
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert 'tokenyard_policy_decisions_total{action="deny"} 1.0' in metrics
    assert "tokenyard_policy_version 2.0" in metrics


def test_rollback_restores_the_exact_previous_policy(gw):
    srv, keys, _ = gw
    a = "# operator comment kept\n" + BASE_POLICY
    b = BASE_POLICY.replace("without_score: large", "without_score: small")
    v1 = put_policy(srv, keys["admin"], a)[1]
    v2 = put_policy(srv, keys["admin"], b)[1]
    assert v1["hash"] != v2["hash"] and "-  without_score: large" in v2["diff"]
    unchanged = put_policy(srv, keys["admin"], b + "\n# same meaning\n")[1]
    assert unchanged["applied"] is False and unchanged["version"] == 2
    status, _, raw = srv.request("POST", "/admin/policy/rollback/1", headers=bearer(keys["admin"]))
    v3 = json.loads(raw)
    assert status == 200 and v3["version"] == 3 and v3["hash"] == v1["hash"] and v3["document"] == a
    assert v3["note"] == "rollback to version 1" and v3["author"] == "ops-admin"
    status, headers, doc = srv.request("GET", "/admin/policy?format=yaml", headers=bearer(keys["admin"]))
    assert doc.decode() == a and headers["x-tokenyard-policy-hash"] == v1["hash"]
    assert srv.gateway.policy.version.hash == v1["hash"]
    hist = json.loads(srv.request("GET", "/admin/policy/history", headers=bearer(keys["admin"]))[2])
    assert [v["version"] for v in hist["data"]] == [3, 2, 1] and hist["current"] == 3
    assert srv.request("POST", "/admin/policy/rollback/9", headers=bearer(keys["admin"]))[0] == 404
    status, _, raw = srv.request("POST", "/admin/policy/validate", BAD, headers=bearer(keys["admin"]))
    assert status == 200 and json.loads(raw)["valid"] is False


def test_rate_class_of_the_policy_limits_the_tenant(gw):
    srv, keys, _ = gw
    doc = BASE_POLICY + """\
rate_classes:
  tiny: {requests_per_min: 2, tokens_per_min: 100000, burst: 2}
tenants:
  acme: {rate_class: tiny}
"""
    assert put_policy(srv, keys["admin"], doc)[0] == 200
    results = [chat(srv, keys["acme"], model="small")[0] for _ in range(3)]
    assert results == [200, 200, 429]
    assert chat(srv, keys["beta"], model="small")[0] == 200      # other tenants: the deployment's limits


def test_learned_router_scores_auto_requests_into_headers_metrics_and_records(gw):
    srv, keys, _ = gw
    status, headers, _ = chat(srv, keys["acme"], "Reverse the order of these words: red sun")
    assert status == 200 and headers["x-tokenyard-route-reason"] == "router"
    score = float(headers["x-tokenyard-router-score"])
    lr = srv.gateway.learned_router
    assert headers["x-tokenyard-engine"] == ("small" if score >= lr.threshold else "large")
    wait_ledger(srv)
    record = srv.gateway.usage.records[-1]
    assert record.router_score == pytest.approx(score, abs=1e-6) and record.policy_version == 0
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert "tokenyard_router_score_count 1.0" in metrics


def test_bad_router_artifact_fails_the_start(tmp_path):
    bad = tmp_path / "router.json"
    body = json.loads((ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json").read_text())
    body["training"]["tampered"] = True                    # the checksum no longer matches
    bad.write_text(json.dumps(body))
    doc = two_engine_deployment("tytest:x:", router={"artifact": str(bad)})
    doc.pop("redis_url")
    with pytest.raises(StartupError, match="router.artifact"):
        create_app(parse_deployment(doc, base_dir=ROOT))


def test_deployment_policy_file_is_imported_once_as_version_1(tmp_path):
    prefix = unique_prefix("polimport")
    path = tmp_path / "policy.yaml"
    path.write_text(BASE_POLICY)
    try:
        with running_gateway(two_engine_deployment(prefix, policy=str(path))) as srv:
            v = srv.gateway.policy.version
            assert v.version == 1 and v.author == "import:policy.yaml" and srv.gateway.policy.source == "redis"
        path.write_text(BASE_POLICY.replace("test policy", "changed file"))
        with running_gateway(two_engine_deployment(prefix, policy=str(path))) as srv:   # Redis wins now
            assert srv.gateway.policy.version.version == 1 and "test policy" in srv.gateway.policy.version.document
    finally:
        delete_prefix(SHARED_REDIS, prefix)
