"""What-if replay: exact spend, budgets in time order, overflow counts, compare()."""
import random
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from tokenyard.policies import EngineState, TenantSpend, UsageFeatures, compare, decide, estimate_cost, load_policy, simulate
from tokenyard.policies.schema import RouterSettings

DOC = """\
version: 1
engines: {small: demo-small, large: demo-large}
prices:
  demo-small: {input: 0.05, cached_input: 0.01, output: 0.2}
  demo-large: {input: 0.25, cached_input: 0.05, output: 1.0}
router: {threshold: 0.5}
rules:
  - {name: vip, match: {tenants: vip}, action: {pin: demo-large}}
  - {name: batch, match: {tags: {batch: "1"}}, action: {priority: batch, max_tokens: 50}}
tenants:
  capped: {budget: {per_day: "0.001", at_limit: deny}}
  thrifty: {budget: {per_month: "0.002", at_limit: downgrade}}
"""
T0 = datetime(2025, 1, 30, 20, 0, tzinfo=timezone.utc)


def records(n=400, seed=1):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(1, 4000)
        busy = rng.random() < 0.2
        out.append(UsageFeatures(
            request_id=f"r{i:04d}", time=T0 + timedelta(minutes=13 * i), tenant=rng.choice(
                ["vip", "capped", "thrifty", "plain"]),
            prompt_tokens=prompt, cached_prompt_tokens=rng.randint(0, prompt), completion_tokens=rng.randint(0, 300),
            requested_model=rng.choice(["auto", "auto", "auto", "demo-small"]),
            tags={"batch": "1"} if rng.random() < 0.3 else {}, router_score=rng.random(),
            deadline_ms=1000.0, engine_state={"demo-small": EngineState(3000.0 if busy and rng.random() < 0.5
                                                                        else 50.0),
                                              "demo-large": EngineState(3000.0 if busy else 50.0)}))
    rng.shuffle(out)                       # the replay must order them itself
    return out


def test_predicted_spend_is_the_sum_of_per_record_costs_under_the_same_decisions():
    policy = load_policy(DOC)
    recs = records()
    report = simulate(policy, recs, keep_outcomes=True)
    # an independent replay: same order, own budget bookkeeping, decide + estimate_cost per record
    day, month = Counter(), Counter()
    total, by_engine, by_tenant = 0, Counter(), Counter()
    outcomes = {o.request_id: o for o in report.outcomes}
    for rec in sorted(recs, key=lambda r: (r.time, r.request_id)):
        spend = TenantSpend(day[rec.tenant, rec.time.date()], month[rec.tenant, rec.time.month])
        d = decide(policy, rec.features(), spend, dict(rec.engine_state), rec.router_score)
        o = outcomes[rec.request_id]
        assert (o.engine, o.reason, o.denied, o.shed) == (d.engine, d.reason, d.denied, d.shed)
        if d.engine is None:
            assert o.cost == 0
            continue
        completion = min(rec.completion_tokens, d.max_tokens) if d.max_tokens else rec.completion_tokens
        cost = estimate_cost(policy.prices, d.engine, rec.prompt_tokens, rec.cached_prompt_tokens, completion)
        assert o.cost == cost and type(cost) is int
        total += cost
        by_engine[d.engine] += cost
        by_tenant[rec.tenant] += cost
        day[rec.tenant, rec.time.date()] += cost
        month[rec.tenant, rec.time.month] += cost
    assert report.spend_total == total == sum(o.cost for o in report.outcomes)
    assert report.spend_by_engine == dict(by_engine) and report.spend_by_tenant == dict(by_tenant)
    assert sum(report.spend_by_engine.values()) == sum(report.spend_by_tenant.values()) == report.spend_total
    assert report.requests == 400 == report.served + report.denied + report.shed
    # the scenario exercises every branch it reports
    assert report.denied > 0 and report.downgraded > 0 and report.degraded > 0 and report.shed > 0
    assert report.large_calls == report.requests_by_engine["demo-large"]


def test_budgets_accumulate_per_day_in_time_order():
    policy = load_policy(DOC)
    # each request costs 100 tokens * 0.25/1M + 0 = 25 micro-units on large; budget 1000/day
    day1 = [UsageFeatures(request_id=f"a{i:02d}", time=T0 + timedelta(seconds=i), tenant="capped",
                          prompt_tokens=100, completion_tokens=0, router_score=0.0) for i in range(50)]
    day2 = [replace(r, request_id="b" + r.request_id, time=r.time + timedelta(days=1)) for r in day1[:5]]
    report = simulate(policy, list(reversed(day1 + day2)), keep_outcomes=True)
    served = [o.request_id for o in report.outcomes if not o.denied]
    assert served == [f"a{i:02d}" for i in range(40)] + [f"ba{i:02d}" for i in range(5)]
    assert report.denied == 10 and report.spend_by_tenant == {"capped": 45 * 25}


def test_downgrade_is_counted_and_moves_spend_to_small():
    policy = load_policy(DOC)
    recs = [UsageFeatures(request_id=f"t{i}", time=T0 + timedelta(hours=i), tenant="thrifty",
                          prompt_tokens=1000, completion_tokens=1000, router_score=0.0) for i in range(4)]
    report = simulate(policy, recs)
    # 1250 micro-units per large call; month budget 2000: two large calls, then small
    assert report.requests_by_engine == {"demo-large": 2, "demo-small": 2} and report.downgraded == 2
    assert report.spend_by_engine == {"demo-large": 2500, "demo-small": 500}


def test_target_large_share_resolved_over_replayed_scores():
    policy = replace(load_policy(DOC), rules=(), tenants={},
                     router=RouterSettings(target_large_share=0.3))
    recs = [UsageFeatures(request_id=f"r{i}", time=T0, tenant="t", prompt_tokens=10, completion_tokens=10,
                          router_score=(i * 7919 % 1000) / 1000) for i in range(1000)]
    report = simulate(policy, recs)
    assert report.large_calls == 300 and abs(report.large_share - 0.3) < 1e-9
    assert simulate(policy, recs, router_threshold=0.5).large_calls == 500


def test_compare_side_by_side():
    current = load_policy(DOC)
    proposed = replace(current, router=RouterSettings(threshold=0.2))      # fewer large calls
    recs = records()
    cmp = compare(current, proposed, iter(recs))                           # a one-shot iterator is fine
    assert cmp.current == simulate(current, recs) and cmp.proposed == simulate(proposed, recs)
    delta = cmp.delta()
    assert delta["large_calls"] < 0 and delta["spend_total"] == cmp.proposed.spend_total - cmp.current.spend_total
    assert delta["spend_total"] == sum(delta["spend_by_engine"].values()) == sum(delta["spend_by_tenant"].values())
    text = cmp.to_text()
    header, *rows = text.splitlines()
    assert header.split() == ["current", "proposed", "change"]
    row = {r.split()[0]: r.split()[1:] for r in rows}
    assert row["requests"] == ["400", "400", "+0"]
    assert row["large_calls"][2] == f"{delta['large_calls']:+d}"
    assert "spend[demo-large]" in row and "tenant[vip]" in row
    d = cmp.to_dict()
    assert set(d) == {"current", "proposed", "delta"} and d["current"]["large_share"] == cmp.current.large_share


def test_usage_features_from_a_spend_record():
    rec = UsageFeatures.from_dict({
        "request_id": "x1", "time": "2025-01-02T03:04:05+00:00", "tenant": "acme", "key_id": "k1",
        "key_name": "ci", "requested_model": "auto", "tags": {"batch": 1}, "prompt_tokens": 12,
        "cached_prompt_tokens": 4, "completion_tokens": 7, "router_score": 0.7, "deadline_ms": 500,
        "engine_state": {"demo-small": {"predicted_ttft_ms": 12.5, "healthy": True}},
        "cost_micros": 99, "status": "ok"})
    assert rec.tags == {"batch": "1"} and rec.engine_state["demo-small"] == EngineState(12.5, True)
    assert rec.features().key_name == "ci" and rec.time.tzinfo is not None
    # the gateway's UsageRecord spelling: unix time, cached_tokens, max_tokens 0 = unset
    ledger = UsageFeatures.from_dict({"request_id": 1, "time": 0.5, "tenant": "a", "prompt_tokens": 9,
                                      "cached_tokens": 3, "completion_tokens": 1, "max_tokens": 0})
    assert ledger.time.year == 1970 and ledger.cached_prompt_tokens == 3 and ledger.max_tokens is None


def test_several_choices_are_capped_each_and_batch_lines_get_the_batch_price():
    """A max_tokens cap applies per choice (n > 1, multi-prompt), not to their sum; a Batch API line is
    charged the replayed policy's batch_price_percent; a multi-prompt request routes by the count the
    policy saw (routed_prompt_tokens), not by the sum of its prompts. Exact, in micro-units."""
    policy = load_policy(DOC.replace("rules:\n", "batch_price_percent: 30\nrules:\n"
                                     "  - {name: long, match: {prompt_tokens: {min: 1000}}, action: {pin: demo-large}}\n"))
    base = UsageFeatures(request_id="r1", time=T0, tenant="plain", prompt_tokens=1500, completion_tokens=150,
                         requested_model="demo-small", tags={"batch": "1"},
                         choice_completion_tokens=(50, 60, 40), routed_prompt_tokens=500)
    rec = UsageFeatures.from_dict({"request_id": "r1", "time": T0.timestamp(), "tenant": "plain",
                                   "prompt_tokens": 1500, "completion_tokens": 150, "requested_model": "demo-small",
                                   "tags": {"batch": "1"}, "choice_completion_tokens": [50, 60, 40],
                                   "routed_prompt_tokens": 500, "batch": False})
    assert rec == base
    out = simulate(policy, [base], keep_outcomes=True).outcomes[0]
    assert (out.engine, out.completion_tokens) == ("demo-small", 50 + 50 + 40)     # each choice cut to 50
    assert out.cost == estimate_cost(policy.prices, "demo-small", 1500, 0, 140)
    batch = simulate(policy, [replace(base, batch=True)]).spend_total
    assert batch == estimate_cost(policy.prices, "demo-small", 1500, 0, 140, 30) < out.cost
    # without the routed count the sum (1500) would match the "long" rule
    assert simulate(policy, [replace(base, routed_prompt_tokens=None)], keep_outcomes=True).outcomes[0].engine \
        == "demo-large"
