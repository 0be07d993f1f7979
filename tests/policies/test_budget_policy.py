"""Budgets per key and per tag value in the policy: validation (errors name the field), export round
trip, decide() denying or downgrading on the tenant's, the key's or a tag value's spend, the alert
thresholds, and the simulation counting key budgets."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tokenyard.policies import (
    PolicyError,
    RequestFeatures,
    TenantSpend,
    UsageFeatures,
    decide,
    load_policy,
    policy_hash,
    policy_to_yaml,
    simulate,
)
from tokenyard.policies.budgets import crossed, period_bounds, period_instance, scopes

BASE = """\
version: 1
engines: {small: small, large: large}
prices:
  small: {input: 0.1, cached_input: 0.05, output: 0.4}
  large: {input: 1, cached_input: 0.5, output: 4}
"""
POLICY = BASE + """\
tenants:
  acme:
    budget: {per_month: 100, at_limit: downgrade}
    key_budgets:
      ci-bot: {per_day: 1, at_limit: deny}
      k_0123456789abcdef: {per_day: 2, at_limit: downgrade}
    tag_budgets:
      team:
        search: {per_month: "5.5", at_limit: downgrade}
        "*": {per_day: 3, at_limit: deny}
  "*":
    key_budgets:
      "*": {per_day: "0.5"}
"""
NOW = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)


def req(**kw) -> RequestFeatures:
    return RequestFeatures(**{"tenant": "acme", "time": NOW, "requested_model": "large", "prompt_tokens": 10,
                              **kw})


def spend(today: int = 0, month: int = 0, **scoped: tuple[str, str, int, int]) -> TenantSpend:
    return TenantSpend(today=today, month=month, scoped=tuple(scoped.values()))


def test_key_and_tag_budgets_parse_and_round_trip():
    p = load_policy(POLICY)
    acme = p.tenants["acme"]
    assert acme.key_budgets["ci-bot"].per_day == 1_000_000 and acme.key_budgets["ci-bot"].at_limit == "deny"
    assert acme.tag_budgets["team"]["search"].per_month == 5_500_000
    assert acme.tag_budgets["team"]["*"].per_day == 3_000_000
    assert p.tenants["*"].key_budgets["*"].at_limit == "deny"
    again = load_policy(policy_to_yaml(p))
    assert again == p and policy_hash(again) == policy_hash(p)
    # A policy without them keeps its canonical form: no new keys in the export.
    assert "key_budgets" not in policy_to_yaml(load_policy(BASE + "tenants:\n  x: {budget: {per_day: 2}}\n"))


@pytest.mark.parametrize("tenant_entry, path, words", [
    ("key_budgets: {ci-bot: {per_day: lots}}", "tenants.acme.key_budgets.ci-bot.per_day", "decimal amount"),
    ("key_budgets: {ci-bot: {at_limit: deny}}", "tenants.acme.key_budgets.ci-bot", "per_day, per_month"),
    ("key_budgets: {ci-bot: {per_day: 1, at_limit: explode}}", "tenants.acme.key_budgets.ci-bot.at_limit",
     "deny"),
    ("key_budgets: {ci-bot: {per_day: 1, per_week: 3}}", "tenants.acme.key_budgets.ci-bot.per_week", "unknown"),
    ("key_budgets: [ci-bot]", "tenants.acme.key_budgets", "mapping"),
    ("tag_budgets: {team: {}}", "tenants.acme.tag_budgets.team", "at least one value"),
    ("tag_budgets: {team: search}", "tenants.acme.tag_budgets.team", "mapping"),
    ("tag_budgets: {team: {search: {per_month: -1}}}", "tenants.acme.tag_budgets.team.search.per_month", ""),
    ("tag_budgets: {'a|b': {x: {per_day: 1}}}", "tenants.acme.tag_budgets.a|b", "'|'"),
    ("key_budget: {x: {per_day: 1}}", "tenants.acme.key_budget", "unknown key"),
])
def test_budget_errors_name_the_field(tenant_entry, path, words):
    with pytest.raises(PolicyError) as e:
        load_policy(BASE + f"tenants:\n  acme:\n    {tenant_entry}\n")
    paths = [p.path for p in e.value.problems]
    assert path in paths, paths
    problem = e.value.problems[paths.index(path)]
    assert problem.line == 8 and words.lower() in str(problem).lower()


def test_scopes_pick_key_by_id_then_name_then_star_and_tag_value_then_star():
    p = load_policy(POLICY)
    s = scopes(p, "acme", "k_0123456789abcdef", "ci-bot", {"team": "search", "env": "prod"})
    assert [(x.dim, x.value, x.entry) for x in s] == [("", "", ""), ("key", "k_0123456789abcdef",
                                                      "k_0123456789abcdef"), ("tag:team", "search", "search")]
    s = scopes(p, "acme", "k_other", "ci-bot", {"team": "ads"})
    assert [(x.dim, x.value, x.entry) for x in s] == [("", "", ""), ("key", "k_other", "ci-bot"),
                                                      ("tag:team", "ads", "*")]
    assert [x.label() for x in s] == ["tenant", "key ci-bot (k_other)", "tag team=ads"]
    s = scopes(p, "globex", "k_9", "", {"team": "search"})      # the "*" tenant entry: every key, no tags
    assert [(x.dim, x.value, x.entry) for x in s] == [("key", "k_9", "*")]


def test_key_budget_denies_while_the_tenant_is_within():
    p = load_policy(POLICY)
    r = req(key_id="k_1", key_name="ci-bot")
    ok = decide(p, r, spend(key=("key", "k_1", 999_999, 999_999)), {}, None)
    assert not ok.denied and ok.engine == "large"
    d = decide(p, r, spend(key=("key", "k_1", 1_000_000, 1_000_000)), {}, None)
    assert d.denied and d.reason == "budget_exceeded" and d.error.status == 429
    assert "key ci-bot (k_1)" in d.error.message and "today's spend 1 >= per_day 1)" in d.error.message   # currency units
    # Another key of the same tenant has its own spend.
    other = decide(p, req(key_id="k_2", key_name="ci-bot"), spend(key=("key", "k_1", 5_000_000, 0)), {}, None)
    assert not other.denied


def test_tag_budget_downgrades_and_deny_wins_over_downgrade():
    p = load_policy(POLICY)
    r = req(key_id="k_0123456789abcdef", tags={"team": "search"})
    d = decide(p, r, spend(tag=("tag:team", "search", 0, 5_500_000)), {}, None)
    assert d.engine == "small" and d.reason == "budget_downgrade" and d.downgraded
    assert any("tag team=search" in line for line in d.explanation)
    # The key's budget says downgrade, the "*" team value's says deny: deny.
    r = req(key_id="k_0123456789abcdef", tags={"team": "ads"})
    d = decide(p, r, spend(key=("key", "k_0123456789abcdef", 2_000_000, 0), tag=("tag:team", "ads", 3_000_000, 0)),
               {}, None)
    assert d.denied and "tag team=ads" in d.error.message
    # The tenant's own budget still works as before.
    d = decide(p, req(), TenantSpend(today=0, month=100_000_000), {}, None)
    assert d.reason == "budget_downgrade"


def test_thresholds_and_periods():
    assert crossed(1_000_000, 499_999) == ()
    assert crossed(1_000_000, 500_000) == (50,)
    assert crossed(1_000_001, 800_000) == (50,)             # no rounding: 80 % of 1,000,001 is 800,000.8
    assert crossed(1_000_001, 800_001) == (50, 80)
    assert crossed(10, 10) == (50, 80, 100) and crossed(10, 99) == (50, 80, 100)
    t = NOW.timestamp()
    assert period_instance("day", t) == "2026-12-01" and period_instance("month", t) == "2026-12"
    assert period_bounds("month", "2026-12") == (datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp(),
                                                 datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp())
    assert period_bounds("day", "2026-12-31")[1] == datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp()


def test_simulation_counts_key_budgets():
    p = load_policy(BASE + "tenants:\n  acme:\n    key_budgets: {ci-bot: {per_day: '0.00005', at_limit: deny}}\n")
    recs = [UsageFeatures(request_id=f"r{i}", time=NOW, tenant="acme", prompt_tokens=10, completion_tokens=5,
                          key_id=f"k_{i % 2}", key_name="ci-bot" if i % 2 == 0 else "other", requested_model="large")
            for i in range(6)]
    # Each large request costs 10 x 1 + 5 x 4 = 30 micro-units; ci-bot (k_0) is at 50 after two.
    report = simulate(p, recs, keep_outcomes=True)
    denied = [o.request_id for o in report.outcomes if o.denied]
    assert denied == ["r4"]
