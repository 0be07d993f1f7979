"""The parts of learning from traffic below the HTTP edge: feedback -> label rules, the traffic
training set, the label store's bounds (Lua), the shadow counters' flush, the policy keys, the
deployment section and the `tokenyard router` commands that read Redis."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio as aioredis
import yaml
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix
from policy_gateway_helpers import ARTIFACT, BASE_POLICY, two_engine_deployment

from tokenyard.cli.main import main
from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.http.feedback_endpoint import label_for, parse_feedback, request_id_of
from tokenyard.gateway.routing.feedback_store import FeedbackStore
from tokenyard.gateway.routing.shadow_tally import ShadowTally, read_report, with_costs
from tokenyard.policies import PolicyError, load_policy, policy_hash, policy_to_dict
from tokenyard.router_models.training.traffic_labels import agreement, label_rows, traffic_training_set
from tokenyard.router_models.training.train import from_rows

SAMPLE = {"prompt": "Add 1 and 2.", "prompt_tokens": 9, "engine": "small", "small": "small", "large": "large"}
REF = "sha256:" + "ab" * 32


def test_feedback_becomes_a_label_by_the_stated_rules():
    assert label_for(SAMPLE, 0.49, None) == 0 and label_for(SAMPLE, 0.5, None) == 1
    assert label_for(SAMPLE, 1.0, "large") == 0 and label_for(SAMPLE, 0.0, "small") == 1   # preferred decides
    assert label_for({**SAMPLE, "engine": "large"}, 0.0, None) is None                     # no signal
    assert label_for({**SAMPLE, "engine": "large"}, None, "small") == 1
    with pytest.raises(BadRequest) as e:
        label_for(SAMPLE, None, "medium")
    assert e.value.code == "invalid_preferred_engine"
    assert parse_feedback({"response_id": "chatcmpl-x", "score": 1}) == ("chatcmpl-x", 1.0, None)
    for body, code in (({"response_id": "x", "score": float("nan")}, "invalid_score"),
                       ({"response_id": "x\n", "score": 1}, "invalid_response_id"),
                       ({"response_id": "x" * 129, "score": 1}, "invalid_response_id"),
                       ({"response_id": "x", "preferred_engine": 3}, "invalid_preferred_engine")):
        with pytest.raises(BadRequest) as e:
            parse_feedback(body)
        assert e.value.code == code
    assert [request_id_of(i) for i in ("chatcmpl-ab", "cmpl-ab", "msg_ab", "ab")] == ["ab"] * 4


def test_traffic_training_set_combines_weighted_or_stands_alone():
    labels = [{"prompt": "a", "prompt_tokens": 3, "label": 0}, {"prompt": "b", "prompt_tokens": 2, "label": None},
              {"prompt": "c", "prompt_tokens": 4, "label": 1}]
    rows = label_rows(labels)
    assert [r["prompt"] for r in rows] == ["a", "c"]
    demo = from_rows([{"prompt": f"p{i}", "prompt_tokens": 5, "label": i % 2} for i in range(10)])
    train, cal, info = traffic_training_set(rows, demo, demo, weight=3)
    assert len(train) == 10 + 2 * 3 and cal is demo and info == {"traffic_labels": 2, "traffic_label_1": 1,
                                                                  "base": "demo", "traffic_weight": 3}
    many = [{"prompt": f"q{i}", "prompt_tokens": 5, "label": i % 2} for i in range(200)]
    train, cal, info = traffic_training_set(many, None, None)
    assert len(train) + len(cal) == 200 and len(cal) > 20 and info["base"] == "none"
    for bad in ((rows, demo, demo, 0), ([], demo, demo, 8)):
        with pytest.raises(ValueError):
            traffic_training_set(*bad)
    assert agreement(lambda t, n: t == "a", rows) == 1.0 and agreement(lambda t, n: True, rows) == 0.5


def test_label_store_is_bounded_idempotent_and_per_tenant():
    prefix = unique_prefix("labels")

    async def run() -> None:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            store = FeedbackStore(client, prefix, retention_s=100, max_labels=3)
            assert await store.put_label("t", "r1", {"label": 1, "time": 1000.0}, now=1000.0) is True
            assert await store.put_label("t", "r1", {"label": 0, "time": 1000.0}, now=1000.0) is False
            for i in range(2, 6):
                await store.put_label("t", f"r{i}", {"label": 1, "time": 1000.0 + i}, now=1000.0 + i)
            assert sorted(await store.labels("t", now=1005.0)) == ["r3", "r4", "r5"]     # the oldest dropped
            await store.put_label("t", "r9", {"label": 1, "time": 1200.0}, now=1200.0)    # r3..r5 expired
            assert sorted(await store.labels("t", now=1200.0)) == ["r9"]
            assert await store.labels("other", now=1200.0) == {} and await store.tenants() == ["t"]
            await store.put_samples([("t", "abc", SAMPLE)])
            assert await store.sample("t", "abc") == SAMPLE and await store.sample("u", "abc") is None
        finally:
            await client.aclose()
    try:
        asyncio.run(run())
    finally:
        delete_prefix(SHARED_REDIS, prefix)


class _Failing:
    def pipeline(self, transaction: bool = True):
        raise redis.ConnectionError("down")


def test_shadow_counts_survive_a_failed_flush_and_add_up_exactly():
    prefix = unique_prefix("shadow")
    tally = ShadowTally()
    tally.add(REF, "deployment", "acme", 10, False, True, 0.25)
    tally.add(REF, "deployment", "acme", 5, True, True, 0.9)

    async def run() -> dict:
        with pytest.raises(redis.ConnectionError):
            await tally.flush(_Failing(), prefix)
        assert tally.pending()
        tally.add(REF, "deployment", "a|b", 7, False, False, 0.6)
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            await tally.flush(client, prefix)
            return await read_report(client, prefix, REF)
        finally:
            await client.aclose()
    try:
        report = asyncio.run(run())
    finally:
        delete_prefix(SHARED_REDIS, prefix)
    rows = {r["tenant"]: r for r in report["rows"]}
    acme = rows["acme"]
    assert (acme["requests"], acme["agree"], acme["to_large"], acme["candidate_large"], acme["current_large"]) == \
        (2, 1, 1, 2, 1)
    assert acme["current_shortfall_micros"] == 750_000 and acme["candidate_shortfall_micros"] == 0
    assert acme["candidate_large_prompt_tokens"] == 15 and acme["current_large_prompt_tokens"] == 5
    assert rows["a|b"]["candidate_shortfall_micros"] == 400_000 and report["total"]["requests"] == 3
    cost = with_costs(dict(acme), small_input_micros=100_000, large_input_micros=1_000_000)
    assert cost["candidate_predicted_prompt_cost_micros"] == pytest.approx(15.0)
    assert cost["current_predicted_prompt_cost_micros"] == pytest.approx(5.0 + 1.0)


def test_policy_names_artifacts_by_checksum_and_they_change_its_hash():
    base = load_policy(BASE_POLICY)
    promoted = load_policy(BASE_POLICY.replace("router:\n", f"router:\n  artifact: {REF}\n  shadow: {REF}\n"))
    assert promoted.router.artifact == REF and promoted.router.shadow == REF
    assert policy_hash(promoted) != policy_hash(base) and policy_to_dict(promoted)["router"]["artifact"] == REF
    assert "artifact" not in policy_to_dict(base)["router"]             # older policies keep their hash
    with pytest.raises(PolicyError) as e:
        load_policy(BASE_POLICY.replace("router:\n", "router:\n  artifact: demo_router.json\n"))
    assert e.value.problems[0].path == "router.artifact" and "sha256:<64 hex digits>" in e.value.problems[0].message


def test_router_learning_section_is_parsed_with_clear_errors():
    doc = two_engine_deployment("tytest:x:")
    dep = parse_deployment({**doc, "router_learning": {"enabled": True, "sample_rate": 0.25, "tenants": ["a"]}})
    s = dep.router_learning
    assert s.enabled and s.sample_rate == 0.25 and s.enrolled("a") and not s.enrolled("b")
    assert not parse_deployment(doc).router_learning.enrolled("a")       # off unless enabled
    for bad, word in (({"sample_rate": 2}, "sample_rate"), ({"tenants": "a"}, "tenants"), ({"enabled": "yes"}, "enabled"),
                      ({"max_prompt_chars": 0}, "max_prompt_chars"), ({"retention": 1}, "unknown")):
        with pytest.raises(DeploymentError, match=word):
            parse_deployment({**doc, "router_learning": bad})


def test_router_commands_publish_import_and_report(tmp_path, capsys):
    prefix = unique_prefix("routercli")
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(two_engine_deployment(prefix)))

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["router", *args, "--config", str(config)])
        out = capsys.readouterr()
        return code, out.out, out.err
    try:
        code, out, _ = run("publish", ARTIFACT)
        ref = out.strip()
        assert code == 0 and ref.startswith("sha256:")
        tampered = tmp_path / "t.json"
        body = json.loads(open(ARTIFACT).read())
        body["threshold"]["value"] = 0.1
        tampered.write_text(json.dumps(body))
        code, _, err = run("publish", str(tampered))
        assert code == 1 and "checksum mismatch" in err
        judged = tmp_path / "judge.jsonl"
        judged.write_text("\n".join(json.dumps(r) for r in (
            {"prompt": "Add 1 and 2.", "label": 0, "prompt_tokens": 9},
            {"prompt": "Add 1 and 2.", "label": 0, "prompt_tokens": 9},          # the same prompt: one label
            {"prompt": "Reverse: a b", "label": 1, "prompt_tokens": 8},
            {"response_id": "chatcmpl-nothere", "score": 0.0},                  # no kept response
            {"prompt": "x", "label": 2, "prompt_tokens": 1})) + "\n")
        code, out, err = run("import-labels", str(judged), "--tenant", "acme")
        assert code == 1 and "stored 3 labels" in out and "2 lines refused" in out and "nothere" in err
        code, out, _ = run("labels")
        assert code == 0 and "acme: 2 labels (1 small enough, 1 large needed, 0 without signal)" in out
        code, _, err = run("shadow-report")
        assert code == 1 and "sets no router.shadow" in err
        code, out, _ = run("shadow-report", "--candidate", ref, "--json")
        assert code == 0 and json.loads(out)["total"]["requests"] == 0
        code, _, err = run("train", "--tenant", "acme")
        assert code == 2 and "--from-traffic" in err
    finally:
        delete_prefix(SHARED_REDIS, prefix)



def test_a_gateway_refuses_to_start_on_a_policy_naming_a_tampered_artifact():
    from tokenyard.gateway.observability.metrics import GatewayMetrics
    from tokenyard.gateway.policy.state import PolicyStartError, PolicyState
    from tokenyard.gateway.policy.store import PolicyStore
    from tokenyard.gateway.routing.artifact_store import ArtifactStore, artifacts_key
    prefix = unique_prefix("tamperstart")

    async def run() -> None:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            ref = await ArtifactStore(client, prefix).publish(open(ARTIFACT).read())
            named = BASE_POLICY.replace("router:\n", f"router:\n  artifact: {ref}\n")
            await PolicyStore(client, prefix).apply(named, "test", ["small", "large"])
            state = PolicyState(parse_deployment(two_engine_deployment(prefix)), GatewayMetrics(lambda: {}), None)
            await state.start_redis(client, client)
            assert state.router.scorer.artifact.threshold == pytest.approx(json.loads(open(ARTIFACT).read())
                                                                           ["threshold"]["value"])
            await state.stop()
            body = json.loads(open(ARTIFACT).read())
            body["model"]["values"][0] += 1.0
            await client.hset(artifacts_key(prefix), ref, json.dumps(body))
            state = PolicyState(parse_deployment(two_engine_deployment(prefix)), GatewayMetrics(lambda: {}), None)
            with pytest.raises(PolicyStartError, match="checksum mismatch"):
                await state.start_redis(client, client)
        finally:
            await client.aclose()
    try:
        asyncio.run(run())
    finally:
        delete_prefix(SHARED_REDIS, prefix)
