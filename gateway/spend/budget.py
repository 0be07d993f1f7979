"""Tenant spend so far, for policy budgets: today's and this month's cost from the spend rollups.

    spend = await budgets.spend("acme")        # policies.TenantSpend(today, month), micro-units

Read from the spend ledger's hourly rollups ({prefix}spend:{T}:h:{hour}), which equal the sum of the
usage records exactly: today = the hours since 00:00 UTC, month = the hours since the 1st, 00:00
UTC. Cached per tenant for CACHE_S seconds (a busy tenant costs one rollup read per CACHE_S, not
one per request), so a budget may be overrun by what a tenant spends in that time plus the
requests in flight; the ledger writes records asynchronously too. Only tenants whose policy
entry has a budget are read at all.

Redis unreachable: fail open. The last value read (however old) or zero is used, the request is
served, and tokenyard_budget_checks_total{outcome="unavailable"} counts it. A budget is a cost
control, not an access control; refusing every request of every budgeted tenant during a Redis
outage would turn an outage of the ledger into an outage of the service.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from gateway.spend.store import rollups
from gateway.store.redis_guard import RedisGuard, RedisUnavailable
from policies import TenantSpend

CACHE_S = 2.0


def period_hours(now: float) -> tuple[int, int, int]:
    """(month start hour, day start hour, end hour exclusive) in unix hours, UTC."""
    t = datetime.fromtimestamp(now, timezone.utc)
    day = datetime(t.year, t.month, t.day, tzinfo=timezone.utc)
    month = datetime(t.year, t.month, 1, tzinfo=timezone.utc)
    return int(month.timestamp()) // 3600, int(day.timestamp()) // 3600, int(now) // 3600 + 1


class BudgetReader:
    def __init__(self, redis: Any, prefix: str, guard: RedisGuard, metrics: Any, cache_s: float = CACHE_S) -> None:
        self.redis = redis
        self.prefix = prefix
        self.guard = guard
        self.metrics = metrics
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, TenantSpend]] = {}

    def forget(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant, None)

    async def spend(self, tenant: str, now: float | None = None) -> tuple[TenantSpend, bool]:
        """(spend so far, known); known is False when Redis could not be read (fail-open)."""
        now = time.time() if now is None else now
        hit = self._cache.get(tenant)
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            return hit[1], True
        if self.redis is None:
            return TenantSpend(), False
        month_h, day_h, end_h = period_hours(now)
        try:
            rows = await self.guard.call("budget", lambda: rollups(self.redis, self.prefix, [tenant], month_h, end_h))
        except RedisUnavailable:
            return (hit[1] if hit is not None else TenantSpend()), False
        spend = TenantSpend(today=sum(r.cost_micros for r in rows if r.hour >= day_h),
                            month=sum(r.cost_micros for r in rows))
        self._cache[tenant] = (time.monotonic(), spend)
        if len(self._cache) > 10_000:
            self._cache.pop(next(iter(self._cache)))
        return spend, True
