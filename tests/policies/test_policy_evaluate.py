"""decide(): rule order, pins, router threshold, budgets, overflow (degrade before shed)."""
from dataclasses import replace
from datetime import datetime, timezone

from tokenyard.policies import EngineState, RequestFeatures, TenantSpend, decide, load_policy
from tokenyard.policies.schema import Budget, Overflow, RouterSettings, TenantPolicy

HEAD = """\
version: 1
engines: {small: demo-small, large: demo-large}
prices:
  demo-small: {input: 0.05, cached_input: 0.01, output: 0.2}
  demo-large: {input: 0.25, cached_input: 0.05, output: 1.0}
"""
RULES = """\
rules:
  - name: acme-large
    match: {tenants: acme}
    action: {pin: demo-large, priority: batch}
  - name: long-small
    match: {prompt_tokens: {min: 1000}}
    action: {pin: demo-small, max_tokens: 64}
  - name: night-deny
    match: {tags: {kind: [scrape, crawl]}, time_utc: 22:00-06:00}
    action: {deny: No scraping at night.}
"""
NOON = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
FREE = TenantSpend()
IDLE = {"demo-small": EngineState(10.0), "demo-large": EngineState(10.0)}


def req(**kw):
    base = dict(tenant="t1", time=NOON, prompt_tokens=10, max_tokens=256)
    base.update(kw)
    return RequestFeatures(**base)


def test_first_match_wins_and_reordering_changes_the_decision():
    policy = load_policy(HEAD + RULES)
    r = req(tenant="acme", prompt_tokens=5000)
    d = decide(policy, r, FREE, IDLE, 0.9)
    assert (d.engine, d.reason, d.rule_index, d.priority, d.max_tokens) == \
        ("demo-large", "rule:acme-large", 0, "batch", 256)
    swapped = replace(policy, rules=(policy.rules[1], policy.rules[0], policy.rules[2]))
    d2 = decide(swapped, r, FREE, IDLE, 0.9)
    assert (d2.engine, d2.reason, d2.rule_index, d2.priority, d2.max_tokens) == \
        ("demo-small", "rule:long-small", 0, "interactive", 64)
    assert "first match wins" in d2.explanation[0]


def test_deny_rule_with_or_lists_and_time_of_day():
    policy = load_policy(HEAD + RULES)
    night = datetime(2025, 3, 1, 23, 30, tzinfo=timezone.utc)
    d = decide(policy, req(tags={"kind": "crawl"}, time=night), FREE, IDLE, 0.9)
    assert d.denied and d.engine is None and d.error.code == "policy_denied" and d.error.status == 403
    assert d.error.message == "No scraping at night." and d.reason == "rule:night-deny"
    assert not decide(policy, req(tags={"kind": "crawl"}, time=NOON), FREE, IDLE, 0.9).denied
    assert not decide(policy, req(tags={"kind": "chat"}, time=night), FREE, IDLE, 0.9).denied


def test_explicit_model_honoured_unless_a_rule_overrides():
    policy = load_policy(HEAD + RULES)
    d = decide(policy, req(requested_model="demo-large"), FREE, IDLE, 0.99)
    assert (d.engine, d.reason, d.action) == ("demo-large", "pinned", "requested")
    d = decide(policy, req(requested_model="demo-large", prompt_tokens=2000), FREE, IDLE, 0.0)
    assert (d.engine, d.reason) == ("demo-small", "rule:long-small")
    forced = load_policy(HEAD + "rules:\n  - {name: all-router, action: {router: true}}\n")
    d = decide(forced, req(requested_model="demo-large"), FREE, IDLE, 0.99)
    assert (d.engine, d.reason, d.rule_name) == ("demo-small", "router", "all-router")


def test_router_threshold_small_when_score_at_or_above():
    policy = load_policy(HEAD + "router: {threshold: 0.6}\n")
    assert decide(policy, req(), FREE, IDLE, 0.6).engine == "demo-small"
    assert decide(policy, req(), FREE, IDLE, 0.5999).engine == "demo-large"
    # the policy's override wins over the router's own threshold; without one the router's is used
    assert decide(policy, req(), FREE, IDLE, 0.5, router_threshold=0.4).engine == "demo-large"
    plain = load_policy(HEAD)
    assert decide(plain, req(), FREE, IDLE, 0.5, router_threshold=0.4).engine == "demo-small"
    d = decide(plain, req(), FREE, IDLE, None)
    assert (d.engine, d.reason) == ("demo-large", "router_fallback")
    small_default = replace(plain, router=RouterSettings(without_score="small"))
    assert decide(small_default, req(), FREE, IDLE, None).engine == "demo-small"


def test_budget_downgrade_and_deny():
    doc = HEAD + RULES + """\
tenants:
  acme: {budget: {per_day: 1, per_month: 10, at_limit: downgrade}}
  "*": {budget: {per_month: "0.5"}}
"""
    policy = load_policy(doc)
    # acme is pinned large by its rule; at its daily limit the budget moves it to small
    under = decide(policy, req(tenant="acme"), TenantSpend(today=999_999, month=0), IDLE, 0.0)
    assert (under.engine, under.downgraded) == ("demo-large", False)
    at = decide(policy, req(tenant="acme"), TenantSpend(today=1_000_000, month=0), IDLE, 0.0)
    assert (at.engine, at.reason, at.downgraded, at.action) == ("demo-small", "budget_downgrade", True, "downgrade")
    month = decide(policy, req(tenant="acme"), TenantSpend(today=0, month=10_000_000), IDLE, 0.0)
    assert month.engine == "demo-small" and "per_month" in " ".join(month.explanation)
    # every other tenant: deny at 0.5 per month
    ok = decide(policy, req(tenant="other"), TenantSpend(month=499_999), IDLE, 0.0)
    assert ok.engine == "demo-large" and not ok.denied
    no = decide(policy, req(tenant="other"), TenantSpend(month=500_000), IDLE, 0.0)
    assert no.denied and no.engine is None and no.error.code == "insufficient_quota" and no.error.status == 429
    assert no.reason == "budget_exceeded"


def test_overflow_degrades_before_it_sheds():
    policy = load_policy(HEAD)
    busy_large = {"demo-small": EngineState(100.0), "demo-large": EngineState(9000.0)}
    d = decide(policy, req(deadline_ms=1000), FREE, busy_large, 0.1)           # router says large
    assert (d.engine, d.reason, d.degraded, d.shed) == ("demo-small", "overflow_degrade", True, False)
    both_busy = {"demo-small": EngineState(5000.0), "demo-large": EngineState(9000.0)}
    d = decide(policy, req(deadline_ms=1000), FREE, both_busy, 0.1)
    assert d.shed and d.engine is None and d.error.status == 503 and d.error.code == "deadline_exceeded"
    assert d.explanation[-2].startswith("cannot degrade") and d.explanation[-1] == "shed"
    # no deadline: never overflows; within deadline: stays
    assert decide(policy, req(), FREE, both_busy, 0.1).engine == "demo-large"
    assert decide(policy, req(deadline_ms=10_000), FREE, both_busy, 0.1).engine == "demo-large"


def test_overflow_respects_rule_pins_upgrade_and_shed_settings():
    policy = load_policy(HEAD + "rules:\n  - {name: keep, match: {tenants: q}, action: {pin: demo-large, degrade: false}}\n")
    busy_large = {"demo-small": EngineState(100.0), "demo-large": EngineState(9000.0)}
    assert decide(policy, req(tenant="q", deadline_ms=1000), FREE, busy_large, 0.9).shed
    # a client-named engine is not moved unless degrade_pinned
    d = decide(policy, req(requested_model="demo-large", deadline_ms=1000), FREE, busy_large, None)
    assert d.shed and "degrade_pinned" in " ".join(d.explanation)
    loose = replace(policy, overflow=Overflow(degrade_pinned=True))
    assert decide(loose, req(requested_model="demo-large", deadline_ms=1000), FREE, busy_large, None).engine \
        == "demo-small"
    # small -> large only with upgrade, and never after a budget downgrade
    busy_small = {"demo-small": EngineState(9000.0), "demo-large": EngineState(100.0)}
    assert decide(policy, req(deadline_ms=1000), FREE, busy_small, 0.9).shed
    up = replace(policy, overflow=Overflow(upgrade=True))
    assert decide(up, req(deadline_ms=1000), FREE, busy_small, 0.9).engine == "demo-large"
    capped = replace(up, tenants={"t1": TenantPolicy(budget=Budget(per_day=1, at_limit="downgrade"))})
    d = decide(capped, req(deadline_ms=1000), TenantSpend(today=5), busy_small, 0.1)
    assert d.downgraded and d.shed
    # shed off: keep the engine and let admission decide
    keep = replace(policy, overflow=Overflow(shed=False))
    d = decide(keep, req(deadline_ms=1000), FREE, busy_small, 0.9)
    assert (d.engine, d.shed) == ("demo-small", False)


def test_unhealthy_engine_degrades_or_sheds_as_unavailable():
    policy = load_policy(HEAD)
    down = {"demo-small": EngineState(0.0, healthy=True), "demo-large": EngineState(0.0, healthy=False)}
    assert decide(policy, req(), FREE, down, 0.1).reason == "overflow_degrade"
    all_down = {"demo-small": EngineState(0.0, healthy=False), "demo-large": EngineState(0.0, healthy=False)}
    d = decide(policy, req(), FREE, all_down, 0.1)
    assert d.shed and d.error.code == "engine_unavailable"


def test_max_tokens_cap_when_client_sets_none_and_rate_class():
    policy = load_policy(HEAD + RULES + "rate_classes: {gold: {requests_per_min: 10, tokens_per_min: 99}}\n"
                         "tenants: {t1: {rate_class: gold}}\n")
    d = decide(policy, req(prompt_tokens=1500, max_tokens=None), FREE, IDLE, 0.5)
    assert d.max_tokens == 64 and d.rate_class == "gold"
    assert policy.rate_class_for("t1").burst == 10 and policy.rate_class_for("nobody") is None
    assert d.to_dict()["error"] is None
