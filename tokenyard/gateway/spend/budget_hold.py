"""Budgets reserved at admission, settled at the end: a request holds its worst-case cost against
every budget period it counts in, and gives back what it did not spend when its usage record is
made, as the token limits hold prompt + max_tokens and refund the rest.

    charge = BudgetCharge(holds, tenant, meters, prices)          # tokenyard/gateway/http/route_plan.py
    hold = await charge.reserve(prompt_tokens, max_tokens)        # 429 insufficient_quota when reached
    ...                                                           # the request runs
    hold.settle(record.cost_micros)      # or hold.settle(0): it never ran

Why: the policy's budget check reads the spend rollups, which only see a request once its usage
record is written (and are cached 2 s). Alone, that lets every request in flight pass a budget
that is nearly spent: 50 at once against a budget of 100 micro-units spent 3,927. With holds,
a budget's meter counts settled costs plus the worst cases in flight, checked and charged in one
Lua script (tokenyard/gateway/spend/lua/budget_hold.lua), so the spend passes a limit by at most the one
request admitted just under it.

Worst case: prompt tokens x input price + max_tokens (all choices) x output price, at the prices
the request is billed at (the policy's for the engine, else the engine's); no cache discount.

Meters, one per budget period that has a limit (hash tag: the tenant, so one script sees them all):
    {prefix}bm:{T}:{scope}:{day|month instance}        settled + held micro-units
    {prefix}bm:{T}:{scope}:{instance}:held             sorted set of holds "id:amount" by expiry
where scope is "tenant", "key:<key id>" or "tag:<name>:<value>". A meter starts from, and is never
below, the spend the rollups show (what was spent before it existed, or by a gateway whose settle
was lost). A meter key expires two days after its period.

Crashes and aborts: a request that ends in any way (finished, cut, client gone, engine failed,
refused later in admission) settles or releases its hold. A gateway that dies with holds open
cannot; each hold expires after HOLD_TTL_S and is then given back, and a request settling after its
hold expired charges its whole cost. Only `deny` budgets refuse here; a `downgrade` budget's meter
is charged the same (so its spend is counted), and the policy decides the downgrade from the rollups.

Redis unreachable: fail open, like the budget check: the request is served unheld (the Redis
guard counts the failure; tokenyard_budget_checks_total counts the policy's check, once a request).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tokenyard.gateway.store.redis_guard import RedisBusy, RedisGuard, RedisUnavailable
from tokenyard.policies.budgets import Scope, period_bounds, period_instance
from tokenyard.policies.cost import format_money

log = logging.getLogger("tokenyard.budget")
_LUA = Path(__file__).resolve().parent / "lua"
HOLD_TTL_S = 900.0               # a hold outliving this (its gateway died) is given back
_KEEP_AFTER_PERIOD_S = 2 * 86400


@dataclass(slots=True, frozen=True)
class Meter:
    """One budget period a request counts against."""

    scope: Scope
    period: str          # "day" | "month"
    limit: int           # micro-units
    seed: int            # spend so far as the rollups show it
    check: bool          # refuse at the limit (at_limit deny); else only count


def meters_for(found: list[Scope], spend_of: Any) -> list[Meter]:
    """The meters of the budgets a request counts in. spend_of(dim, value) -> (today, month)."""
    out = []
    for s in found:
        today, month = spend_of(s.dim, s.value)
        deny = s.budget.at_limit == "deny"
        if s.budget.per_day is not None:
            out.append(Meter(s, "day", s.budget.per_day, today, deny))
        if s.budget.per_month is not None:
            out.append(Meter(s, "month", s.budget.per_month, month, deny))
    return out


@dataclass(slots=True)
class Hold:
    """What one request holds; settle() exactly once (later calls do nothing)."""

    holds: "BudgetHolds | None"
    keys: list[str] = field(default_factory=list)
    member: str = ""
    amount: int = 0
    done: bool = False

    def settle(self, actual_micros: int) -> None:
        """Charge the actual cost and give back the rest of the hold (in the background)."""
        if self.done:
            return
        self.done = True
        if self.holds is not None and self.keys:
            self.holds.settle_later(self, max(0, int(actual_micros)))

    def release(self) -> None:
        """The request never ran: give the whole hold back."""
        self.settle(0)


class BudgetReached(Exception):
    """A deny budget's meter is at or over its limit (settled spend + holds in flight)."""

    def __init__(self, meter: Meter, value: int) -> None:
        super().__init__(meter.scope.label())
        self.meter = meter
        self.value = value


class BudgetHolds:
    def __init__(self, redis: Any, prefix: str, guard: RedisGuard | None, metrics: Any,
                 ttl_s: float = HOLD_TTL_S) -> None:
        self.redis = redis
        self.prefix = prefix
        self.guard = guard
        self.metrics = metrics
        self.ttl_s = ttl_s
        if redis is not None:
            self._hold = redis.register_script((_LUA / "budget_hold.lua").read_text())
            self._settle = redis.register_script((_LUA / "budget_settle.lua").read_text())
        self._pending: set[asyncio.Task] = set()

    def _meter_key(self, tenant: str, m: Meter, now: float) -> str:
        s = m.scope
        scope = "tenant" if not s.dim else f"{s.dim}:{s.value}"
        return f"{self.prefix}bm:{{{tenant}}}:{scope}:{period_instance(m.period, now)}"

    async def reserve(self, tenant: str, meters: list[Meter], amount: int, now: float) -> Hold:
        """Hold `amount` micro-units in every meter, or raise BudgetReached (nothing held)."""
        if self.redis is None or not meters:
            return Hold(None)
        keys: list[str] = []
        args: list[Any] = [secrets.token_hex(8), amount, int(self.ttl_s * 1_000_000)]
        for m in meters:
            key = self._meter_key(tenant, m, now)
            keys += [key, key + ":held"]
            end = period_bounds(m.period, period_instance(m.period, now))[1]
            args += [m.limit, m.seed, 1 if m.check else 0, int(end) + _KEEP_AFTER_PERIOD_S]
        try:
            r = await self.guard.call("budget_hold", lambda: self._hold(keys=keys, args=args))
        except RedisUnavailable:     # fail open, as the budget check does (the guard counts it)
            return Hold(None)
        admitted, reached = int(r[0]), int(r[1])
        if not admitted:
            raise BudgetReached(meters[reached - 1], int(r[1 + reached]))
        return Hold(self, keys, f"{args[0]}:{amount}", amount)

    def settle_later(self, hold: Hold, actual: int) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:      # no loop (a sink called at shutdown): the hold expires instead
            return
        task = loop.create_task(self._do_settle(hold, actual))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _do_settle(self, hold: Hold, actual: int) -> None:
        try:
            await self.guard.call("budget_settle",
                                  lambda: self._settle(keys=hold.keys, args=[hold.member, hold.amount, actual]))
        except (RedisUnavailable, RedisBusy) as e:
            # Counted by the guard. The hold expires (HOLD_TTL_S) and the rollups, which the meter
            # never falls below, carry the actual cost: stricter for a while, never looser.
            log.debug("budget hold %s not settled: %s", hold.member, e)

    async def drain(self) -> None:
        """Wait for settles in flight (tests and shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


@dataclass(slots=True)
class BudgetCharge:
    """The budgets one routed request counts in, and the prices its worst case is reckoned at."""

    holds: BudgetHolds
    tenant: str
    meters: list[Meter]
    prices: Any                 # tokenyard.policies.schema.Prices

    def worst_cost(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.prices.cost(prompt_tokens, 0, max_tokens)

    async def reserve(self, prompt_tokens: int, max_tokens: int) -> Hold:
        now = datetime.now(timezone.utc).timestamp()
        return await self.holds.reserve(self.tenant, self.meters, self.worst_cost(prompt_tokens, max_tokens), now)


def refusal_message(tenant: str, e: BudgetReached) -> str:
    """The 429 insufficient_quota message, as the policy's own (currency units, not micro-units)."""
    m, s = e.meter, e.meter.scope
    who = f"Tenant {tenant}" if not s.dim else f"The {s.label()} of tenant {tenant}"
    what = "today's spend" if m.period == "day" else "this month's spend"
    return (f"{who} has reached its spend budget ({what} {format_money(e.value)} >= per_{m.period} "
            f"{format_money(m.limit)}, counting requests in flight).")
