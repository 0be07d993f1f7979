"""Learning from traffic through real requests (mock engines, shared Redis under a unique prefix):
POST /v1/feedback's validation and tenancy, promotion and rollback of a published artifact through
the policy, tampered artifacts refused, and the shadow report against a recomputation."""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest
import redis
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import (
    ARTIFACT,
    BASE_POLICY,
    bearer,
    chat,
    make_keys,
    put_policy,
    two_engine_deployment,
    wait_for,
)

from tokenyard.gateway.routing.artifact_store import artifacts_key
from tokenyard.gateway.routing.shadow_tally import shortfall_micros
from tokenyard.router_models.runtime.artifact import load, save, with_threshold
from tokenyard.router_models.runtime.scorer import Scorer

LEARNING = {"enabled": True, "tenants": ["acme", "beta"]}


@pytest.fixture
def gw():
    prefix = unique_prefix("feedback")
    keys = make_keys(prefix, "acme", "beta", "gamma")
    try:
        with running_gateway(two_engine_deployment(prefix, router_learning=LEARNING)) as srv:
            yield srv, keys, prefix
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def feedback(srv, key: str, body) -> tuple[int, dict]:
    status, _, raw = srv.request("POST", "/v1/feedback", body, bearer(key))
    return status, json.loads(raw)


def publish(srv, admin: str, path) -> str:
    status, _, raw = srv.request("POST", "/admin/router/artifacts", open(path, "rb").read(), bearer(admin))
    assert status == 200, raw
    return json.loads(raw)["ref"]


def test_feedback_validation_tenancy_and_idempotence(gw):
    srv, keys, prefix = gw
    status, headers, body = chat(srv, keys["acme"], "Add 12 and 30.")
    assert status == 200
    rid, engine = body["id"], headers["x-tokenyard-engine"]
    assert engine == "small"            # the demo router sends this prompt small
    # Another tenant's key cannot label it, nor learn that it exists.
    status, err = feedback(srv, keys["beta"], {"response_id": rid, "score": 0})
    assert status == 404 and err["error"]["code"] == "response_not_found"
    bad = [({"response_id": rid}, "missing_feedback"), ({"response_id": rid, "score": 1.5}, "invalid_score"),
           ({"response_id": rid, "score": True}, "invalid_score"), ({"score": 0}, "invalid_response_id"),
           ({"response_id": rid, "preferred_engine": "gpt-9"}, "invalid_preferred_engine"),
           ({"response_id": rid, "score": 0, "note": "x"}, "unrecognized_parameter")]
    for body_, code in bad:
        status, err = feedback(srv, keys["acme"], body_)
        assert status == 400 and err["error"]["code"] == code, (body_, err)
        assert err["error"]["type"] == "invalid_request_error"
    assert srv.request("POST", "/v1/feedback", "[1]", bearer(keys["acme"]))[0] == 400
    assert srv.request("POST", "/v1/feedback", "{", bearer(keys["acme"]))[0] == 400
    assert srv.request("POST", "/v1/feedback", {"response_id": rid, "score": 0}, {"Authorization": "Bearer no"})[0] == 401
    # A low score on the small engine's answer: the large one was needed (label 0); sent twice, one label.
    status, ok = feedback(srv, keys["acme"], {"response_id": rid, "score": 0.2})
    assert status == 200 and ok["label"] == 0 and ok["stored"] == "created" and ok["engine"] == "small"
    status, ok = feedback(srv, keys["acme"], {"response_id": rid, "score": 0.2})
    assert status == 200 and ok["stored"] == "replaced"
    # The x-request-id header names the same response.
    status, ok = feedback(srv, keys["acme"], {"response_id": headers["x-request-id"], "preferred_engine": "small"})
    assert status == 200 and ok["label"] == 1 and ok["stored"] == "replaced"
    counts = json.loads(srv.request("GET", "/admin/router/labels", headers=bearer(keys["admin"]))[2])["tenants"]
    assert counts == {"acme": {"labels": 1, "small_enough": 1, "large_needed": 0, "no_signal": 0}}
    assert srv.request("GET", "/admin/router/labels", headers=bearer(keys["acme"]))[0] == 403
    # A score on the large engine's answer says nothing about the small one: kept, label null.
    status, headers, body = chat(srv, keys["acme"], "Add 12 and 30.", model="large")
    status, ok = feedback(srv, keys["acme"], {"response_id": body["id"], "score": 0.0})
    assert status == 200 and ok["label"] is None and ok["engine"] == "large"
    # Opted out by metadata, or a tenant not enrolled: nothing was kept.
    _, _, body = chat(srv, keys["acme"], "Add 1 and 2.", metadata={"tokenyard_learning": "off"})
    assert feedback(srv, keys["acme"], {"response_id": body["id"], "score": 1})[0] == 404
    _, _, body = chat(srv, keys["gamma"], "Add 1 and 2.")
    assert feedback(srv, keys["gamma"], {"response_id": body["id"], "score": 1})[0] == 404
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert 'tokenyard_router_feedback_total{outcome="not_found"} 3.0' in metrics
    assert 'tokenyard_router_samples_total{outcome="skipped"} 2.0' in metrics
    # The kept prompt expires with the retention; the labels' keys too.
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        ttl = client.ttl(f"{prefix}learn:{{acme}}:labels")
        assert 0 < ttl <= 7 * 86400
    finally:
        client.close()


def test_promotion_and_rollback_through_the_policy(gw, tmp_path):
    srv, keys, _ = gw
    admin = keys["admin"]
    everything_large = tmp_path / "large.json"
    save(with_threshold(load(ARTIFACT), threshold=0.999999), everything_large)
    ref = publish(srv, admin, everything_large)
    assert ref.startswith("sha256:") and ref in json.loads(
        srv.request("GET", "/admin/router/artifacts", headers=bearer(admin))[2])["refs"]
    assert put_policy(srv, admin, BASE_POLICY)[0] == 200                               # version 1
    assert chat(srv, keys["acme"], "Add 12 and 30.")[1]["x-tokenyard-engine"] == "small"
    promoted = BASE_POLICY.replace("router:\n", f"router:\n  artifact: {ref}\n")
    status, v2 = put_policy(srv, admin, promoted)
    assert status == 200 and v2["version"] == 2 and f"+  artifact: {ref}" in v2["diff"]
    _, headers, _ = chat(srv, keys["acme"], "Add 12 and 30.")
    assert headers["x-tokenyard-engine"] == "large" and headers["x-tokenyard-route-reason"] == "router"
    assert headers["x-tokenyard-policy-version"] == "2"
    status, _, raw = srv.request("POST", "/admin/policy/rollback/1", headers=bearer(admin))
    assert status == 200 and json.loads(raw)["version"] == 3
    assert chat(srv, keys["acme"], "Add 12 and 30.")[1]["x-tokenyard-engine"] == "small"
    hist = json.loads(srv.request("GET", "/admin/policy/history", headers=bearer(admin))[2])["data"]
    assert [(v["version"], v["author"]) for v in hist] == [(3, "ops-admin"), (2, "ops-admin"), (1, "ops-admin")]


def test_tampered_or_unpublished_artifacts_are_refused(gw, tmp_path):
    srv, keys, prefix = gw
    admin = keys["admin"]
    body = json.loads(open(ARTIFACT).read())
    body["model"]["values"][0] += 1.0           # an edited weight under the old checksum
    status, _, raw = srv.request("POST", "/admin/router/artifacts", json.dumps(body), bearer(admin))
    err = json.loads(raw)["error"]
    assert status == 422 and err["code"] == "invalid_router_artifact" and "checksum mismatch" in err["message"]
    ref = publish(srv, admin, ARTIFACT)
    missing = "sha256:" + "0" * 64
    status, err = put_policy(srv, admin, BASE_POLICY.replace("router:\n", f"router:\n  shadow: {missing}\n"))
    assert status == 422 and err["error"]["problems"][0]["path"] == "router.shadow"
    assert "not published" in err["error"]["problems"][0]["message"]
    # Tampered in Redis after publishing: the content no longer hashes to its checksum ...
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        client.hset(artifacts_key(prefix), ref, json.dumps(body))
        status, err = put_policy(srv, admin, BASE_POLICY.replace("router:\n", f"router:\n  artifact: {ref}\n"))
        assert status == 422 and err["error"]["problems"][0]["path"] == "router.artifact"
        assert "checksum mismatch" in err["error"]["problems"][0]["message"]
        # ... or another valid artifact was put under this ref: its checksum is not the ref.
        other = tmp_path / "other.json"
        save(with_threshold(load(ARTIFACT), threshold=0.5), other)
        client.hset(artifacts_key(prefix), ref, other.read_text())
        status, err = put_policy(srv, admin, BASE_POLICY.replace("router:\n", f"router:\n  artifact: {ref}\n"))
        assert status == 422 and "not the checksum the policy names" in err["error"]["problems"][0]["message"]
        assert srv.gateway.policy.number == 0              # nothing was applied
        # A version that names it anyway (written past the checks, e.g. tampered after it was applied) is
        # not installed by a gateway: the previous version stays in force.
        client.hset(artifacts_key(prefix), ref, open(ARTIFACT).read())
        named = BASE_POLICY.replace("router:\n", f"router:\n  artifact: {ref}\n")
        assert put_policy(srv, admin, named)[0] == 200 and srv.gateway.policy.number == 1
        client.hset(artifacts_key(prefix), ref, json.dumps(body))
        asyncio.run(_install_unchecked(prefix, named.replace("test policy", "written past the checks")))
        wait_for(lambda: "tokenyard_router_artifact_refusals_total 1.0" in srv.request("GET", "/metrics")[2].decode())
        assert srv.gateway.policy.number == 1
    finally:
        client.close()


async def _install_unchecked(prefix: str, document: str) -> None:
    import redis.asyncio as aioredis

    from tokenyard.gateway.policy.store import PolicyStore
    from tokenyard.policies import next_version
    client = aioredis.Redis.from_url(SHARED_REDIS)
    try:
        store = PolicyStore(client, prefix)
        previous = await store.current()
        assert await store._install(previous, next_version(previous, document, "test", datetime.now(timezone.utc)))
    finally:
        await client.aclose()


def test_shadow_report_equals_a_recomputation(gw, tmp_path):
    srv, keys, _ = gw
    admin = keys["admin"]
    candidate_path = tmp_path / "candidate.json"
    save(with_threshold(load(ARTIFACT), target_large_share=0.6), candidate_path)
    ref = publish(srv, admin, candidate_path)
    assert put_policy(srv, admin, BASE_POLICY.replace("router:\n", f"router:\n  shadow: {ref}\n"))[0] == 200
    rows = [json.loads(line) for line in (ROOT / "tokenyard" / "router_models" / "data" / "test.jsonl")
            .read_text().splitlines()[:400:10]]
    sent = []
    for i, r in enumerate(rows):
        tenant = "acme" if i % 3 else "beta"
        status, headers, body = chat(srv, keys[tenant], r["prompt"])
        assert status == 200
        sent.append((tenant, r["prompt"], body["id"][len("chatcmpl-"):]))
    chat(srv, keys["acme"], r["prompt"], model="large")          # pinned requests are scored too
    sent.append(("acme", r["prompt"], None))
    report = json.loads(srv.request("GET", "/admin/router/shadow", headers=bearer(admin))[2])
    # Recompute from the usage records (the score and prompt count the gateway used) and the artifacts.
    current, cand = Scorer(load(ARTIFACT)), Scorer(load(candidate_path))
    records = list(srv.gateway.usage.records)
    expected: dict[str, dict[str, int]] = {}
    for (tenant, text, _), rec in zip(sent, records[-len(sent):]):
        c = not rec.router_score >= current.threshold
        p = cand.score(text, rec.routed_prompt_tokens)
        k = not p >= cand.threshold
        n = rec.routed_prompt_tokens
        e = expected.setdefault(tenant, {})
        for name, value in (("requests", 1), ("agree", int(c == k)), ("current_large", int(c)),
                            ("candidate_large", int(k)), ("to_large", int(k and not c)), ("to_small", int(c and not k)),
                            ("prompt_tokens", n), ("current_large_prompt_tokens", n if c else 0),
                            ("candidate_large_prompt_tokens", n if k else 0),
                            ("current_shortfall_micros", 0 if c else shortfall_micros(p)),
                            ("candidate_shortfall_micros", 0 if k else shortfall_micros(p))):
            e[name] = e.get(name, 0) + value
    got = {row["tenant"]: {name: row[name] for name in expected["acme"]} for row in report["rows"]}
    assert {row["current"] for row in report["rows"]} == {"deployment"}
    assert got == expected
    total = report["total"]
    assert total["requests"] == len(sent) and 0 < total["agreement"] < 1
    assert total["candidate_large"] > total["current_large"]       # a 60% large-share target
    assert total["candidate_predicted_prompt_cost_micros"] > total["current_predicted_prompt_cost_micros"]
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert f'tokenyard_router_shadow_decisions_total{{outcome="agree"}} {float(total["agree"])}' in metrics
    one = json.loads(srv.request("GET", "/admin/router/shadow?tenant=beta", headers=bearer(admin))[2])
    assert one["total"]["requests"] == expected["beta"]["requests"]


def test_the_large_engine_judges_kept_small_answers(tmp_path, capsys):
    import yaml

    from tokenyard.cli.main import main
    from tokenyard.cli.router_judge import verdict
    assert [verdict(t) for t in ("Yes.", " no, because", "maybe", "", "NO")] == [1, 0, None, None, 0]
    prefix = unique_prefix("judge")
    keys = make_keys(prefix, "acme")
    doc = two_engine_deployment(prefix, small={"reply": "four", "output_len": 0},
                                large={"reply": "no", "output_len": 0}, router_learning={"enabled": True})
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(doc))
    try:
        with running_gateway(doc) as srv:
            ids = [chat(srv, keys["acme"], f"Add {i} and 2.")[2]["id"] for i in range(3)]
            chat(srv, keys["acme"], "Add 9 and 2.", model="large")              # a large answer: not judged
            assert feedback(srv, keys["acme"], {"response_id": ids[0], "score": 1})[1]["label"] == 1
            code = main(["router", "judge", "--tenant", "acme", "--sample", "5", "--gateway", srv.base_url,
                         "--key", keys["admin"], "--config", str(config)])
            out = capsys.readouterr().out
            assert code == 0 and "judged 2 of 2 unlabelled small-engine prompts" in out and "2 labelled" in out
            counts = json.loads(srv.request("GET", "/admin/router/labels", headers=bearer(keys["admin"]))[2])
            assert counts["tenants"]["acme"] == {"labels": 3, "small_enough": 1, "large_needed": 2, "no_signal": 0}
            # The judge's own 6 calls (3 per prompt, the admin key's tenant enrolled too) were never kept.
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_router_samples_total{outcome="skipped"} 6.0' in metrics
    finally:
        delete_prefix(SHARED_REDIS, prefix)
