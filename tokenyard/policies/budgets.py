"""Budgets of one request and alert thresholds, as pure functions.

A tenant's policy entry may hold three kinds of budget (tokenyard/policies/README.md):
  budget                the tenant as a whole
  key_budgets[K]        each API key of the tenant on its own: K is the key id, else the key name,
                        else "*" (every key); the first of those present applies
  tag_budgets[NAME][V]  each value of metadata tag NAME on its own: V is the value, else "*"

Each budget is a Scope: the spend rollup dimension it is counted in ("" for the tenant total,
"key" with the key id, "tag:NAME" with the tag value) and the policy entry it came from. Spend is
compared per UTC day and per UTC calendar month; at or over a limit the budget is reached.

Alerts: a budget's period crosses 50, 80 and 100 % of its limit (`crossed`); the gateway fires
each threshold once per period instance ("2026-12-01", "2026-12") and limit
(tokenyard/gateway/spend/alerts.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from .cost import format_money
from .schema import Budget, Policy, TenantPolicy

THRESHOLDS = (50, 80, 100)        # percent of a limit at which an alert fires (once per period)
PERIODS = ("day", "month")
EVERY = "*"                       # a key_budgets / tag_budgets entry for every key or value


@dataclass(slots=True, frozen=True)
class Scope:
    """One budget that applies: what it counts and which policy entry set it."""

    dim: str            # "" (tenant), "key", "tag:NAME"
    value: str          # "" (tenant), the key id, the tag value
    entry: str          # the policy's name for it: "" (tenant), key id / name / "*", tag value / "*"
    budget: Budget

    @property
    def kind(self) -> str:
        return "tenant" if not self.dim else "key" if self.dim == "key" else "tag"

    def label(self) -> str:
        """How explanations and alerts name it: "tenant", "key ci-bot", "tag team=search"."""
        if not self.dim:
            return "tenant"
        if self.dim == "key":
            shown = self.value if self.entry in (EVERY, self.value) else f"{self.entry} ({self.value})"
            return f"key {shown}"
        return f"tag {self.dim[4:]}={self.value}"


def has_budgets(tp: TenantPolicy) -> bool:
    return tp.budget is not None or bool(tp.key_budgets) or bool(tp.tag_budgets)


def key_entry(tp: TenantPolicy, key_id: str | None, key_name: str | None) -> tuple[str, Budget] | None:
    """The key_budgets entry for a key: by id, else by name, else "*"."""
    for name in (key_id, key_name, EVERY):
        if name and name in tp.key_budgets:
            return name, tp.key_budgets[name]
    return None


def tag_entry(tp: TenantPolicy, tag: str, value: str) -> tuple[str, Budget] | None:
    values = tp.tag_budgets.get(tag)
    if not values or not value:
        return None
    for name in (value, EVERY):
        if name in values:
            return name, values[name]
    return None


def scopes(policy: Policy, tenant: str, key_id: str | None = None, key_name: str | None = None,
           tags: Mapping[str, str] | None = None) -> list[Scope]:
    """Every budget a request (or a usage record) of this tenant, key and tags counts against."""
    tp = policy.tenant(tenant)
    out: list[Scope] = []
    if tp.budget is not None:
        out.append(Scope("", "", "", tp.budget))
    if key_id:
        hit = key_entry(tp, key_id, key_name)
        if hit is not None:
            out.append(Scope("key", key_id, hit[0], hit[1]))
    for tag, value in sorted((tags or {}).items()):
        hit = tag_entry(tp, tag, str(value))
        if hit is not None:
            out.append(Scope(f"tag:{tag}", str(value), hit[0], hit[1]))
    return out


def over_limit(budget: Budget, today: int, month: int) -> list[str]:
    """Why the budget is reached (empty: within): spend so far (micro-units) at or over a limit,
    said in the currency units the policy is written in ("0.000062 >= per_day 0.00005")."""
    over = []
    if budget.per_day is not None and today >= budget.per_day:
        over.append(f"today's spend {format_money(today)} >= per_day {format_money(budget.per_day)}")
    if budget.per_month is not None and month >= budget.per_month:
        over.append(f"this month's spend {format_money(month)} >= per_month {format_money(budget.per_month)}")
    return over


def limits(budget: Budget) -> list[tuple[str, int]]:
    """(period, limit) for each limit the budget sets."""
    return [(p, lim) for p, lim in (("day", budget.per_day), ("month", budget.per_month)) if lim is not None]


def crossed(limit: int, spent: int) -> tuple[int, ...]:
    """The alert thresholds (percent) that `spent` has reached against `limit`, in integers (no
    rounding: 80 % of 1,000,001 is reached at 800,001). A zero limit is reached by any spend >= 0."""
    return tuple(t for t in THRESHOLDS if spent * 100 >= t * limit)


def period_instance(period: str, t: float) -> str:
    """The UTC day ("2026-12-01") or month ("2026-12") containing unix time t."""
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.strftime("%Y-%m-%d") if period == "day" else d.strftime("%Y-%m")


def period_bounds(period: str, instance: str) -> tuple[float, float]:
    """[start, end) in unix seconds of a period instance."""
    if period == "day":
        start = datetime.strptime(instance, "%Y-%m-%d").replace(tzinfo=timezone.utc)
        return start.timestamp(), start.timestamp() + 86400
    start = datetime.strptime(instance, "%Y-%m").replace(tzinfo=timezone.utc)
    end = datetime(start.year + (start.month == 12), start.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start.timestamp(), end.timestamp()
