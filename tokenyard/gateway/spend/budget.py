"""Spend so far, for policy budgets: today's and this month's cost of a tenant, and of its keys and
tag values that have budgets, from the spend rollups.

    spend, known = await budgets.spend("acme", [("key", "3f2a..."), ("tag:team", "search")])
    # tokenyard.policies.TenantSpend(today, month, scoped=((dim, value, today, month), ...)), micro-units

Read from the spend ledger's hourly rollups, which equal the sum of the usage records exactly: the
tenant's from {prefix}spend:{T}:h:{hour}, a key's or tag value's from the dimension rollup
{prefix}spend:{T}:hd:{hour} (only the cost fields of the wanted values, HMGET, not the whole
hash); today = the hours since 00:00 UTC, month = the hours since the 1st, 00:00 UTC. A value the
dimension rollup counted under "(other)" (more than spend.max_values_per_dimension distinct values
of that dimension in the tenant's hour) is not seen by its budget: keep that bound above the
number of keys / tag values a tenant uses in an hour. Cached per tenant for CACHE_S seconds (a busy
tenant costs one rollup read per CACHE_S, not one per request), so a budget may be overrun by what
is spent in that time plus the requests in flight; the ledger writes records asynchronously too.
That is why a request also holds its worst-case cost at admission (tokenyard/gateway/spend/budget_hold.py,
`holds` here), which bounds the overshoot to one request. Only tenants whose policy entry has a
budget are read at all.

Redis unreachable: fail open. The last value read (however old) or zero is used, the request is
served, and tokenyard_budget_checks_total{outcome="unavailable"} counts it. A budget is a cost
control, not an access control; refusing every request of every budgeted tenant during a Redis
outage would turn an outage of the ledger into an outage of the service.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from tokenyard.gateway.spend.budget_hold import BudgetHolds
from tokenyard.gateway.spend.redis_keys import dim_field_prefix, dims_key, hours_key, rollup_key
from tokenyard.gateway.store.redis_guard import RedisGuard, RedisUnavailable
from tokenyard.policies import TenantSpend

CACHE_S = 2.0
MAX_CACHED_DIMS = 32       # scopes kept per tenant in the cache (a tenant with more keys reads per request)
Dim = tuple[str, str]      # (dimension, value): ("key", key id), ("tag:team", "search")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def hourly_costs(redis: Any, prefix: str, tenant: str, dims: list[Dim], start_hour: int,
                       end_hour: int) -> tuple[dict[int, int], dict[Dim, dict[int, int]]]:
    """cost_micros per hour (start_hour <= hour < end_hour) of the tenant, and of each (dim, value):
    three round trips (the hours index, the tenant rollups, the wanted dimension fields)."""
    pipe = redis.pipeline(transaction=False)
    pipe.zrangebyscore(hours_key(prefix, tenant), start_hour, end_hour - 1)
    hours = [int(_s(h)) for h in (await pipe.execute())[0]]
    total: dict[int, int] = {}
    by_dim: dict[Dim, dict[int, int]] = {d: {} for d in dims}
    if not hours:
        return total, by_dim
    pipe = redis.pipeline(transaction=False)
    for h in hours:
        pipe.hgetall(rollup_key(prefix, tenant, h))
    engines: dict[int, list[str]] = {}
    for h, raw in zip(hours, await pipe.execute()):
        for k, v in raw.items():
            engine, _, name = _s(k).rpartition("|")
            if name == "cost_micros":
                total[h] = total.get(h, 0) + int(_s(v))
                engines.setdefault(h, []).append(engine)
    if not dims:
        return total, by_dim
    wanted = [(h, [(d, dim_field_prefix(d[0], d[1], e) + "cost_micros") for d in dims for e in engines[h]])
              for h in hours if h in engines]
    pipe = redis.pipeline(transaction=False)
    for h, fields in wanted:
        pipe.hmget(dims_key(prefix, tenant, h), [f for _, f in fields])
    for (h, fields), values in zip(wanted, await pipe.execute()):
        for (d, _), v in zip(fields, values):
            if v is not None:
                by_dim[d][h] = by_dim[d].get(h, 0) + int(_s(v))
    return total, by_dim


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
        self._cache: dict[str, tuple[float, TenantSpend, frozenset[Dim]]] = {}
        # Worst-case costs held at admission, settled at the end (tokenyard/gateway/spend/budget_hold.py).
        self.holds = BudgetHolds(redis, prefix, guard, metrics)

    def forget(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant, None)

    async def spend(self, tenant: str, dims: list[Dim] | tuple[Dim, ...] = (),
                    now: float | None = None) -> tuple[TenantSpend, bool]:
        """(spend so far of the tenant and of each (dim, value), known); known is False when Redis
        could not be read (fail-open)."""
        now = time.time() if now is None else now
        want = frozenset(dims)
        hit = self._cache.get(tenant)
        if hit is not None and want <= hit[2] and time.monotonic() - hit[0] < self.cache_s:
            return hit[1], True
        if self.redis is None:
            return TenantSpend(), False
        if hit is not None and len(want | hit[2]) <= MAX_CACHED_DIMS:
            want = want | hit[2]      # one read serves the tenant's other budgeted keys / tags too
        read = sorted(want)
        month_h, day_h, end_h = period_hours(now)
        try:
            total, by_dim = await self.guard.call(
                "budget", lambda: hourly_costs(self.redis, self.prefix, tenant, read, month_h, end_h))
        except RedisUnavailable:
            return (hit[1] if hit is not None else TenantSpend()), False
        spend = TenantSpend(today=sum(c for h, c in total.items() if h >= day_h), month=sum(total.values()),
                            scoped=tuple((d, v, sum(c for h, c in by_dim[d, v].items() if h >= day_h),
                                          sum(by_dim[d, v].values())) for d, v in read))
        self._cache[tenant] = (time.monotonic(), spend, want)
        if len(self._cache) > 10_000:
            self._cache.pop(next(iter(self._cache)))
        return spend, True
