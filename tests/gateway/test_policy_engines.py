"""Policies over N engines: engines.tiers, router.quality_target / cost_cap, a rule's quality_target,
the N-engine router's pick in decide(), overflow one tier at a time; two-engine policies unchanged
(same hash, same decisions)."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest

from tokenyard.policies import EngineState, PolicyError, RequestFeatures, TenantSpend, decide, load_policy
from tokenyard.policies.export import policy_hash, policy_to_yaml
from tokenyard.policies.schema import Budget, TenantPolicy

TWO = """\
version: 1
engines: {small: demo-small, large: demo-large}
prices:
  demo-small: {input: 0.05, cached_input: 0.01, output: 0.2}
  demo-medium: {input: 0.1, cached_input: 0.02, output: 0.4}
  demo-large: {input: 0.25, cached_input: 0.05, output: 1.0}
"""
THREE = TWO.replace("{small: demo-small, large: demo-large}",
                    "{small: demo-small, large: demo-large, tiers: [demo-small, demo-medium, demo-large]}")
NOON = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
FREE = TenantSpend()
IDLE = {n: EngineState(10.0) for n in ("demo-small", "demo-medium", "demo-large")}
SCORES = {"demo-small": 0.2, "demo-medium": 0.7, "demo-large": 0.9}     # cheapest first, as the router gives them


def req(**kw):
    return RequestFeatures(**{"tenant": "t1", "time": NOON, "prompt_tokens": 10, "max_tokens": 256, **kw})


def test_two_engine_policy_keeps_its_hash_and_decisions():
    policy = load_policy(TWO)
    assert policy.engines.tiers == () and policy.engines.ordered == ("demo-small", "demo-large")
    assert "tiers" not in policy_to_yaml(policy) and "quality_target" not in policy_to_yaml(policy)
    assert policy_hash(policy) == policy_hash(load_policy(TWO + "router: {without_score: large}\n"))
    assert decide(policy, req(), FREE, IDLE, 0.9, 0.5).engine == "demo-small"
    assert decide(policy, req(), FREE, IDLE, 0.1, 0.5).engine == "demo-large"


def test_tiers_and_targets_round_trip_and_change_the_hash():
    doc = THREE + "router: {quality_target: 0.6}\nrules:\n  - name: vip\n    match: {tenants: vip}\n" \
                  "    action: {quality_target: 0.85}\n"
    policy = load_policy(doc)
    assert policy.engines.tiers == ("demo-small", "demo-medium", "demo-large")
    assert policy.router.quality_target == 0.6 and policy.rules[0].action.quality_target == 0.85
    again = load_policy(policy_to_yaml(policy))
    assert again == policy and policy_hash(again) == policy_hash(policy) != policy_hash(load_policy(THREE))


@pytest.mark.parametrize("doc, path", [
    (TWO.replace("large: demo-large}", "large: demo-large, tiers: [demo-medium, demo-large]}"), "engines.tiers"),
    (TWO.replace("large: demo-large}", "large: demo-large, tiers: [demo-small, demo-x, demo-large]}"),
     "engines.tiers[1]"),
    (TWO + "router: {quality_target: 1.5}\n", "router.quality_target"),
    (TWO + "router: {quality_target: 0.5, cost_cap: 2}\n", "router.cost_cap"),
    (TWO + "router: {cost_cap: -1}\n", "router.cost_cap"),
    (TWO + "rules:\n  - name: r\n    action: {pin: demo-small, quality_target: 0.5}\n", "rules[0].action.quality_target"),
])
def test_bad_n_engine_settings_name_the_key(doc, path):
    with pytest.raises(PolicyError) as e:
        load_policy(doc)
    assert path in [p.path for p in e.value.problems]


def test_the_n_engine_router_picks_and_a_quality_target_overrides_it():
    policy = load_policy(THREE)
    d = decide(policy, req(), FREE, IDLE, 0.2, None, router_scores=SCORES, router_pick="demo-medium")
    assert (d.engine, d.reason) == ("demo-medium", "router") and "the router's selection" in d.explanation[-1]
    policy = load_policy(THREE + "router: {quality_target: 0.8}\nrules:\n  - name: cheap\n    match: {tenants: "
                                 "cheap}\n    action: {quality_target: 0.1}\n  - name: best\n    match: {tenants: best}\n"
                                 "    action: {quality_target: 0.95}\n")
    assert decide(policy, req(), FREE, IDLE, 0.2, None, SCORES, "demo-medium").engine == "demo-large"
    assert decide(policy, req(tenant="cheap"), FREE, IDLE, 0.2, None, SCORES, "demo-medium").engine == "demo-small"
    # no engine reaches 0.95: the best guess, not the priciest by default
    best = decide(policy, req(tenant="best"), FREE, IDLE, 0.2, None,
                  {"demo-small": 0.2, "demo-medium": 0.93, "demo-large": 0.9}, "demo-small")
    assert best.engine == "demo-medium" and "the rule's 0.95" in best.explanation[-1]
    # a named engine stays named; pins stay pins
    assert decide(policy, req(requested_model="demo-large"), FREE, IDLE, 0.2, None, SCORES, "x").engine == "demo-large"


def test_budget_downgrade_goes_to_the_cheapest_engine_from_any_tier():
    policy = load_policy(THREE)
    over = TenantSpend(today=10**9)
    policy = replace(policy, tenants={"t1": TenantPolicy(budget=Budget(per_day=1, at_limit="downgrade"))})
    d = decide(policy, req(), over, IDLE, 0.2, None, SCORES, "demo-medium")
    assert (d.engine, d.reason) == ("demo-small", "budget_downgrade")


def test_overflow_moves_one_tier_and_upgrades_only_when_allowed():
    policy = load_policy(THREE)
    slow = dict(IDLE, **{"demo-medium": EngineState(10_000.0)})
    d = decide(policy, req(deadline_ms=500), FREE, slow, 0.2, None, SCORES, "demo-medium")
    assert (d.engine, d.reason) == ("demo-small", "overflow_degrade")
    slow_small = dict(IDLE, **{"demo-small": EngineState(10_000.0)})
    d = decide(policy, req(deadline_ms=500), FREE, slow_small, 0.2, None, SCORES, "demo-small")
    assert d.shed and "demo-small -> demo-medium (pricier) needs overflow.upgrade" in " ".join(d.explanation)
    up = load_policy(THREE + "overflow: {upgrade: true}\n")
    d = decide(up, req(deadline_ms=500), FREE, slow_small, 0.2, None, SCORES, "demo-small")
    assert (d.engine, d.reason) == ("demo-medium", "overflow_degrade")
    # two engines: the old message and behaviour
    two = load_policy(TWO)
    d = decide(two, req(deadline_ms=500), FREE, slow_small, 0.9, 0.5)
    assert d.shed and "moving small -> large needs overflow.upgrade" in " ".join(d.explanation)


def test_overflow_never_moves_to_a_tier_the_deployment_lacks():
    policy = load_policy(THREE)
    running = {"demo-small": EngineState(10.0), "demo-large": EngineState(10_000.0)}     # no demo-medium here
    d = decide(policy, req(deadline_ms=500), FREE, running, 0.1, 0.5)
    assert d.shed and "demo-medium is not an engine of this deployment" in " ".join(d.explanation)


def test_a_tier_the_deployment_does_not_run_is_a_deployment_problem():
    from tokenyard.gateway.policy.store import deployment_problems
    policy = load_policy(THREE)
    assert deployment_problems(policy, ["demo-small", "demo-medium", "demo-large"]) == []
    problems = deployment_problems(policy, ["demo-small", "demo-large"])
    assert [p.path for p in problems] == ["engines.tiers[1]"]
    assert "demo-medium" in problems[0].message and problems[0].allowed == ("demo-large", "demo-small")
