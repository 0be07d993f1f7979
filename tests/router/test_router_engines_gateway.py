"""The N-engine router and context-fit routing on the request path (mock engines, one tokenizer):
"auto" goes to the cheapest engine whose P(good) reaches the quality target (deployment or
artifact default); a routed prompt too long for its engine's context moves to one that holds it
(reason "context"); a prompt no engine holds, or a pinned one, stays a 400."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix, wait_ledger

from tokenyard.gateway.config.deployment import parse_deployment
from tokenyard.gateway.server.app import create_app
from tokenyard.gateway.state import StartupError
from tokenyard.router_models.runtime.engine_set import EngineModel, EngineSet, save
from tokenyard.router_models.runtime.features import DENSE_NAMES, FeatureSpec

MODEL = str(ROOT / "models" / "demo-small")
# Intercept-only models: P(good) is the same for every prompt, so the choice is known in advance.
P_GOOD = {"small": 0.2, "medium": 0.7, "large": 0.9}


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def engine_set_artifact(path: Path, quality_target: float = 0.6) -> Path:
    spec = FeatureSpec(dense_mean=(0.0,) * len(DENSE_NAMES), dense_scale=(1.0,) * len(DENSE_NAMES))
    engines = [EngineModel(n, c, _logit(P_GOOD[n]), [], []) for n, c in (("small", 1.0), ("medium", 2.0),
                                                                        ("large", 5.0))]
    save(EngineSet(spec, engines, "quality_target", quality_target, None, [[0.0, 5.0], [1.0, 1.0]], 10,
                   [0.0, 0.2, 1.0]), path)
    return path


def deployment(artifact: Path | None, lens: dict[str, int], **router) -> dict:
    doc = mock_deployment()
    doc["engines"] = {n: {"type": "mock", "model": MODEL, "output_len": 4, "max_model_len": lens[n]}
                      for n in ("small", "medium", "large")}
    doc["routing"] = {"small": "small", "large": "large", "long_prompt_tokens": 100000}
    if artifact is not None:
        doc["router"] = {"artifact": str(artifact), **router}
    return doc


def ask(srv, words: int, model: str = "auto", max_tokens: int | None = 4):
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(["word"] * words)}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return srv.chat(body)


def test_auto_goes_to_the_cheapest_engine_reaching_the_target(tmp_path):
    art = engine_set_artifact(tmp_path / "r3.json")
    with running_gateway(deployment(art, {"small": 4096, "medium": 4096, "large": 4096})) as srv:
        status, headers, body = ask(srv, 5)
        assert status == 200, body
        assert headers["x-tokenyard-engine"] == "medium" and headers["x-tokenyard-route-reason"] == "router"
        # the header carries P(the cheapest engine is good)
        assert float(headers["x-tokenyard-router-score"]) == pytest.approx(P_GOOD["small"], abs=1e-6)
        assert ask(srv, 5, model="large")[1]["x-tokenyard-engine"] == "large"      # a named engine is kept


@pytest.mark.parametrize("router, engine", [({"quality_target": 0.1}, "small"), ({"quality_target": 0.8}, "large"),
                                            ({"quality_target": 0.95}, "large")])   # none reaches it: the best
def test_the_deployment_quality_target_overrides_the_artifact(tmp_path, router, engine):
    art = engine_set_artifact(tmp_path / "r3.json")
    with running_gateway(deployment(art, {"small": 4096, "medium": 4096, "large": 4096}, **router)) as srv:
        assert ask(srv, 5)[1]["x-tokenyard-engine"] == engine


@pytest.mark.parametrize("router, message", [({"threshold": 0.5}, "quality_target"),
                                             ({"small": "small"}, "router.engines"),
                                             ({"engines": ["small", "large"]}, "lists 2 engines")])
def test_two_engine_settings_are_refused_for_an_engine_set(tmp_path, router, message):
    art = engine_set_artifact(tmp_path / "r3.json")
    dep = parse_deployment(deployment(art, {"small": 4096, "medium": 4096, "large": 4096}, **router),
                           base_dir=ROOT)
    with pytest.raises(StartupError, match=message):
        create_app(dep)


def test_a_prompt_too_long_for_the_chosen_engine_moves_to_one_that_holds_it(tmp_path):
    art = engine_set_artifact(tmp_path / "r3.json")
    with running_gateway(deployment(art, {"small": 4096, "medium": 64, "large": 4096})) as srv:
        status, headers, body = ask(srv, 5)
        assert status == 200 and headers["x-tokenyard-engine"] == "medium"      # fits: no move
        status, headers, body = ask(srv, 120)
        assert status == 200, body
        # medium cannot hold it; the nearest engine, the pricier neighbour first, can
        assert headers["x-tokenyard-engine"] == "large" and headers["x-tokenyard-route-reason"] == "context"
        # prompt + max_tokens counts too: 5 words fit medium's 64 tokens, 5 words + 60 do not
        status, headers, _ = ask(srv, 5, max_tokens=60)
        assert status == 200 and headers["x-tokenyard-route-reason"] == "context"


def test_the_interim_rule_moves_too_and_a_pinned_request_does_not(tmp_path):
    with running_gateway(deployment(None, {"small": 64, "medium": 4096, "large": 4096})) as srv:
        status, headers, body = ask(srv, 120)        # the interim rule sends it small; large holds it
        assert status == 200, body
        assert headers["x-tokenyard-engine"] == "large" and headers["x-tokenyard-route-reason"] == "context"
        status, _, body = ask(srv, 120, model="small")
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_a_prompt_no_engine_holds_stays_a_400(tmp_path):
    art = engine_set_artifact(tmp_path / "r3.json")
    with running_gateway(deployment(art, {"small": 64, "medium": 64, "large": 64})) as srv:
        status, _, body = ask(srv, 120)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_spend_report_has_a_row_per_engine_and_route_with_three_engines(tmp_path):
    art = engine_set_artifact(tmp_path / "r3.json")
    doc = deployment(art, {"small": 4096, "medium": 64, "large": 4096})
    prices = {"small": 1, "medium": 2, "large": 5}
    for name, engine in doc["engines"].items():
        engine["prices"] = {"input": prices[name] * 10**8, "output": prices[name] * 4 * 10**8}
    prefix = unique_prefix("route3")
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix)
    try:
        with running_gateway(doc) as srv:
            sent = [ask(srv, 5), ask(srv, 120), ask(srv, 5, model="small")]     # router, context, pinned
            assert [h["x-tokenyard-engine"] for _, h, _ in sent] == ["medium", "large", "small"]
            wait_ledger(srv)
            status, _, body = srv.request("GET", "/v1/spend/report?group_by=model,route")
            rows = {(r["model"], r["route"]): r for r in json.loads(body)["data"]}
            assert status == 200 and set(rows) == {("medium", "router"), ("large", "context"), ("small", "pinned")}
            records = {r.engine: r for r in srv.gateway.usage.records}
            for name, r in records.items():       # each engine's own prices; the baseline is the priciest
                assert rows[(name, r.route_reason)]["cost_micros"] == r.cost_micros > 0
            assert records["small"].cost_micros < records["medium"].cost_micros
    finally:
        delete_prefix(SHARED_REDIS, prefix)


POLICY = """\
version: 1
engines: {small: small, large: large, tiers: [small, medium, large]}
prices:
  small: {input: 1, cached_input: 1, output: 1}
  medium: {input: 2, cached_input: 2, output: 2}
  large: {input: 5, cached_input: 5, output: 5}
router: {ROUTER}
rules:
  - name: cheap-tag
    match: {tags: {tier: cheap}}
    action: {quality_target: 0.1}
"""


@pytest.mark.parametrize("router, auto, tagged", [("{quality_target: 0.8}", "large", "small"),
                                                  ("{cost_cap: 1.0}", "small", "small"),
                                                  ("{}", "medium", "small")])       # the artifact's default
def test_a_policy_sets_the_quality_target_or_cost_cap_and_a_rule_its_own(tmp_path, router, auto, tagged):
    art = engine_set_artifact(tmp_path / "r3.json")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.replace("{ROUTER}", router))
    prefix = unique_prefix("route3pol")
    doc = deployment(art, {"small": 4096, "medium": 4096, "large": 4096})
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix, policy=str(policy))
    try:
        with running_gateway(doc) as srv:
            status, headers, body = ask(srv, 5)
            assert status == 200, body
            assert (headers["x-tokenyard-engine"], headers["x-tokenyard-route-reason"]) == (auto, "router")
            status, headers, _ = srv.chat({"model": "auto", "metadata": {"tier": "cheap"},
                                           "messages": [{"role": "user", "content": "word word"}], "max_tokens": 4})
            assert status == 200 and headers["x-tokenyard-engine"] == tagged
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_under_a_policy_the_context_move_is_priced_as_the_engine_it_lands_on(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nengines: {small: small, large: large}\nprices:\n"
                      "  small: {input: 1, cached_input: 1, output: 1}\n"
                      "  large: {input: 500, cached_input: 500, output: 500}\n"
                      "router: {without_score: small}\n")          # no router artifact: auto -> small
    prefix = unique_prefix("route3ctx")
    doc = deployment(None, {"small": 64, "medium": 4096, "large": 4096})
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix, policy=str(policy))
    try:
        with running_gateway(doc) as srv:
            status, headers, _ = ask(srv, 5)
            assert status == 200 and (headers["x-tokenyard-engine"], headers["x-tokenyard-route-reason"]) == \
                ("small", "router_fallback")
            status, headers, body = ask(srv, 120)
            assert status == 200, body
            assert (headers["x-tokenyard-engine"], headers["x-tokenyard-route-reason"]) == ("large", "context")
            wait_ledger(srv)
            record = srv.gateway.usage.records[-1]
            # the policy's price of the engine it landed on (500 units = 5e8 micro-units per 1M tokens), not small's
            assert record.engine == "large" and record.prices[0] == 500 * 10**6
            status, _, body = ask(srv, 120, model="small")      # pinned by the client: no move
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_a_two_engine_policy_setting_does_not_stop_an_n_engine_gateway(tmp_path):
    # router.target_large_share becomes a threshold on P(cheapest good) for the what-if replay; live
    # N-engine decisions go by the router's per-engine scores
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.replace("{ROUTER}", "{target_large_share: 0.3}"))
    prefix = unique_prefix("route3tls")
    doc = deployment(engine_set_artifact(tmp_path / "r3.json"), {"small": 4096, "medium": 4096, "large": 4096})
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix, policy=str(policy))
    try:
        with running_gateway(doc) as srv:
            assert srv.gateway.policy.number == 1
            assert ask(srv, 5)[1]["x-tokenyard-engine"] == "medium"
    finally:
        delete_prefix(SHARED_REDIS, prefix)
