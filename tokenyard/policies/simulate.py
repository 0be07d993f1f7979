"""What-if replay: recorded traffic under a policy, and two policies side by side.

    simulate(policy, records, router_threshold=None, keep_outcomes=False) -> SimulationReport
    compare(current, proposed, records, router_threshold=None) -> Comparison

A record is a UsageFeatures: the features and usage of one served request, never its text.
The spend ledger's usage records must carry these fields (same names) for the replay to work:
request_id, time, tenant, key_id, key_name, requested_model, tags, prompt_tokens,
cached_prompt_tokens, completion_tokens, max_tokens, router_score, deadline_ms and, when the
gateway had them, engine_state (per engine: predicted_ttft_ms, healthy) at admission,
routed_prompt_tokens (the count the policy decided with: a multi-prompt completion routes by its
longest prompt, while prompt_tokens is what all its prompts cost), choice_completion_tokens (per
choice of an n > 1 or multi-prompt request, so a max_tokens cap cuts each choice, not their sum)
and batch (a Batch API line, charged the replayed policy's batch_price_percent).

Under the policy in force (and no budgets), the replay charges every record exactly what the
ledger charged it, whatever the traffic mix: tests/gateway/test_policy_simulate_ledger.py.

Assumptions, stated because they bound the prediction's accuracy:
  - token counts are taken as recorded whatever engine the replay picks (the demo engines share
    a tokenizer; completion length is the recorded one, cut to a rule's max_tokens cap);
  - cached prompt tokens are as recorded (prefix-cache hits on another engine may differ);
  - budgets start at zero spend at the start of the replay and accumulate, in time order
    (ties by request id), per tenant (and per key and tag value with a key or tag budget) per
    UTC day and UTC calendar month, from the replay's own
    predicted costs; denied and shed requests cost nothing;
  - the router threshold: the policy's router.threshold, else router_threshold given here, else
    when the policy sets router.target_large_share, the empirical quantile of the replayed
    scores of "auto" requests giving that share (the gateway resolves it from the router
    artifact's calibration quantiles instead), else 0.5.
Costs use estimate_cost (one rounding per request), so the report's totals are exact sums.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .budgets import scopes
from .cost import estimate_cost, format_money
from .evaluate import Decision, EngineState, TenantSpend, decide
from .matching import RequestFeatures
from .schema import AUTO, Policy


@dataclass(slots=True, frozen=True, kw_only=True)
class UsageFeatures:
    """One recorded request, as the what-if replay needs it (no prompt text)."""

    request_id: str
    time: datetime
    tenant: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    key_id: str | None = None
    key_name: str | None = None
    requested_model: str = AUTO
    tags: Mapping[str, str] = field(default_factory=dict)
    max_tokens: int | None = None
    router_score: float | None = None
    deadline_ms: float | None = None
    engine_state: Mapping[str, EngineState] | None = None
    engine: str | None = None            # the engine that actually served it (reference only)
    routed_prompt_tokens: int | None = None   # what the policy saw (None: prompt_tokens)
    choice_completion_tokens: tuple[int, ...] = ()   # per choice when there were several (sum: completion_tokens)
    batch: bool = False                  # a Batch API line: priced at the policy's batch_price_percent

    def features(self) -> RequestFeatures:
        routed = self.prompt_tokens if self.routed_prompt_tokens is None else self.routed_prompt_tokens
        return RequestFeatures(tenant=self.tenant, time=self.time, requested_model=self.requested_model,
                               prompt_tokens=routed, max_tokens=self.max_tokens,
                               key_name=self.key_name, key_id=self.key_id, tags=self.tags,
                               deadline_ms=self.deadline_ms)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UsageFeatures:
        """From a spend record's JSON: time as ISO 8601 or epoch seconds; engine_state as
        {engine: {"predicted_ttft_ms": ..., "healthy": ...}}. Unknown fields are ignored (the
        ledger record carries more: cost, status, latencies). Accepts the gateway's UsageRecord
        spelling too: cached_tokens for cached_prompt_tokens, max_tokens 0 for "not set", and
        requested_max_tokens (what the client asked, None: not set) over max_tokens (what was
        granted) when the record has it, and routed_prompt_tokens 0 for "not recorded"."""
        t = d["time"]
        time = datetime.fromtimestamp(t, timezone.utc) if isinstance(t, (int, float)) else datetime.fromisoformat(t)
        states = d.get("engine_state")
        return cls(request_id=str(d["request_id"]), time=time, tenant=str(d["tenant"]),
                   prompt_tokens=int(d["prompt_tokens"]), completion_tokens=int(d["completion_tokens"]),
                   cached_prompt_tokens=int(d.get("cached_prompt_tokens", d.get("cached_tokens")) or 0), key_id=d.get("key_id"),
                   key_name=d.get("key_name"), requested_model=d.get("requested_model") or AUTO,
                   tags={str(k): str(v) for k, v in (d.get("tags") or {}).items()},
                   max_tokens=(d["requested_max_tokens"] if "requested_max_tokens" in d else d.get("max_tokens"))
                   or None, router_score=d.get("router_score"),
                   deadline_ms=d.get("deadline_ms"), engine=d.get("engine"),
                   routed_prompt_tokens=int(d.get("routed_prompt_tokens") or 0) or None,
                   choice_completion_tokens=tuple(int(c) for c in d.get("choice_completion_tokens") or ()),
                   batch=bool(d.get("batch", False)),
                   engine_state=None if states is None else {
                       k: EngineState(float(v.get("predicted_ttft_ms", 0.0)), bool(v.get("healthy", True)))
                       for k, v in states.items()})


@dataclass(slots=True, frozen=True)
class Outcome:
    """One replayed request: where it went and what it would cost."""

    request_id: str
    tenant: str
    engine: str | None
    reason: str
    completion_tokens: int          # billed: the recorded count, cut to the decision's max_tokens
    cost: int                       # micro-units; 0 when denied or shed
    denied: bool
    shed: bool


@dataclass(slots=True)
class SimulationReport:
    requests: int = 0
    served: int = 0
    denied: int = 0
    shed: int = 0
    downgraded: int = 0             # by a budget
    degraded: int = 0               # by overflow
    large_calls: int = 0            # served on engines.large
    spend_total: int = 0            # micro-units, = sum of spend_by_engine = sum of spend_by_tenant
    spend_by_engine: dict[str, int] = field(default_factory=dict)
    requests_by_engine: dict[str, int] = field(default_factory=dict)
    spend_by_tenant: dict[str, int] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)
    threshold: float | None = None  # router threshold the replay used
    outcomes: list[Outcome] | None = None

    @property
    def large_share(self) -> float:
        """Share of served requests on the large engine (a ratio, not money: a float is fine)."""
        return self.large_calls / self.served if self.served else 0.0

    def to_dict(self, include_outcomes: bool = False) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "outcomes"}
        out["large_share"] = self.large_share
        if include_outcomes and self.outcomes is not None:
            out["outcomes"] = [{k: getattr(o, k) for k in o.__slots__} for o in self.outcomes]
        return out


def _threshold(policy: Policy, records: list[UsageFeatures]) -> float | None:
    """router.target_large_share resolved over the replayed scores (None: nothing to resolve)."""
    if policy.router.threshold is not None:
        return None          # decide() uses the policy's own
    share = policy.router.target_large_share
    scores = sorted(r.router_score for r in records if r.requested_model == AUTO and r.router_score is not None)
    if share is None or not scores:
        return None
    k = round(share * len(scores))          # this many go large: those with score < threshold
    return scores[k] if k < len(scores) else math.nextafter(scores[-1], math.inf)


def _order(r: UsageFeatures) -> tuple[datetime, str]:
    t = r.time if r.time.tzinfo is not None else r.time.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc), r.request_id


def simulate(policy: Policy, records: Iterable[UsageFeatures], router_threshold: float | None = None,
             keep_outcomes: bool = False) -> SimulationReport:
    ordered = sorted(records, key=_order)
    threshold = router_threshold if router_threshold is not None else _threshold(policy, ordered)
    report = SimulationReport(threshold=policy.router.threshold if policy.router.threshold is not None
                              else threshold, outcomes=[] if keep_outcomes else None)
    by_engine: Counter[str] = Counter()
    count_engine: Counter[str] = Counter()
    by_tenant: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    day: dict[tuple[str, Any], int] = defaultdict(int)
    month: dict[tuple[str, Any], int] = defaultdict(int)
    sday: dict[tuple[str, str, str, Any], int] = defaultdict(int)       # key and tag budgets' spend
    smonth: dict[tuple[str, str, str, Any], int] = defaultdict(int)
    for rec in ordered:
        utc, _ = _order(rec)
        dkey, mkey = (rec.tenant, utc.date()), (rec.tenant, (utc.year, utc.month))
        found = [sc for sc in scopes(policy, rec.tenant, rec.key_id, rec.key_name, rec.tags) if sc.dim]
        skeys = [((rec.tenant, sc.dim, sc.value, dkey[1]), (rec.tenant, sc.dim, sc.value, mkey[1])) for sc in found]
        spend = TenantSpend(today=day[dkey], month=month[mkey],
                            scoped=tuple((sc.dim, sc.value, sday[a], smonth[b]) for sc, (a, b) in zip(found, skeys)))
        d = decide(policy, rec.features(), spend, dict(rec.engine_state or {}), rec.router_score, threshold)
        report.requests += 1
        reasons[d.reason] += 1
        report.downgraded += d.downgraded
        report.degraded += d.degraded
        cost, completion = 0, 0
        if d.denied:
            report.denied += 1
        elif d.shed:
            report.shed += 1
        else:
            assert d.engine is not None      # Decision: engine is None exactly when denied or shed
            completion = _billed_completion(rec, d)
            cost = estimate_cost(policy.prices, d.engine, rec.prompt_tokens, rec.cached_prompt_tokens, completion,
                                 policy.batch_price_percent if rec.batch else 100)
            report.served += 1
            report.large_calls += d.engine == policy.engines.large
            by_engine[d.engine] += cost
            count_engine[d.engine] += 1
            by_tenant[rec.tenant] += cost
            day[dkey] += cost
            month[mkey] += cost
            for a, b in skeys:
                sday[a] += cost
                smonth[b] += cost
        if report.outcomes is not None:
            report.outcomes.append(Outcome(rec.request_id, rec.tenant, d.engine, d.reason, completion, cost,
                                           d.denied, d.shed))
    report.spend_by_engine = dict(sorted(by_engine.items()))
    report.requests_by_engine = dict(sorted(count_engine.items()))
    report.spend_by_tenant = dict(sorted(by_tenant.items()))
    report.by_reason = dict(sorted(reasons.items()))
    report.spend_total = sum(by_engine.values())
    return report


def _billed_completion(rec: UsageFeatures, d: Decision) -> int:
    """The recorded completion, each choice cut to the decision's max_tokens (a per-choice cap)."""
    if d.max_tokens is None:
        return rec.completion_tokens
    if rec.choice_completion_tokens:
        return sum(min(c, d.max_tokens) for c in rec.choice_completion_tokens)
    return min(rec.completion_tokens, d.max_tokens)


@dataclass(slots=True)
class Comparison:
    current: SimulationReport
    proposed: SimulationReport

    def delta(self) -> dict[str, Any]:
        """proposed - current, for every count and sum (money in micro-units)."""
        c, p = self.current, self.proposed
        keys = ("requests", "served", "denied", "shed", "downgraded", "degraded", "large_calls", "spend_total")
        out: dict[str, Any] = {k: getattr(p, k) - getattr(c, k) for k in keys}
        out["large_share"] = p.large_share - c.large_share
        engines = sorted(set(c.spend_by_engine) | set(p.spend_by_engine))
        out["spend_by_engine"] = {e: p.spend_by_engine.get(e, 0) - c.spend_by_engine.get(e, 0) for e in engines}
        tenants = sorted(set(c.spend_by_tenant) | set(p.spend_by_tenant))
        out["spend_by_tenant"] = {t: p.spend_by_tenant.get(t, 0) - c.spend_by_tenant.get(t, 0) for t in tenants}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"current": self.current.to_dict(), "proposed": self.proposed.to_dict(), "delta": self.delta()}

    def to_text(self) -> str:
        """A plain table, current next to proposed (money in currency units, exact)."""
        c, p = self.current, self.proposed
        rows: list[tuple[str, str, str, str]] = []

        def count(label: str, a: int, b: int) -> None:
            rows.append((label, str(a), str(b), f"{b - a:+d}"))

        def money(label: str, a: int, b: int) -> None:
            diff = b - a
            rows.append((label, format_money(a), format_money(b), ("+" if diff >= 0 else "") + format_money(diff)))

        for k in ("requests", "served", "denied", "shed", "downgraded", "degraded", "large_calls"):
            count(k, getattr(c, k), getattr(p, k))
        rows.append(("large_share", f"{c.large_share:.1%}", f"{p.large_share:.1%}",
                     f"{(p.large_share - c.large_share) * 100:+.1f} pts"))
        money("spend_total", c.spend_total, p.spend_total)
        for e in sorted(set(c.spend_by_engine) | set(p.spend_by_engine)):
            money(f"spend[{e}]", c.spend_by_engine.get(e, 0), p.spend_by_engine.get(e, 0))
        for t in sorted(set(c.spend_by_tenant) | set(p.spend_by_tenant)):
            money(f"tenant[{t}]", c.spend_by_tenant.get(t, 0), p.spend_by_tenant.get(t, 0))
        head = ("", "current", "proposed", "change")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
        lines = ["  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(r))
                 for r in [head, *rows]]
        return "\n".join(line.rstrip() for line in lines) + "\n"


def compare(current: Policy, proposed: Policy, records: Iterable[UsageFeatures],
            router_threshold: float | None = None) -> Comparison:
    """Both policies over the same records (read once, so any iterable works)."""
    recs = list(records)
    return Comparison(simulate(current, recs, router_threshold), simulate(proposed, recs, router_threshold))
