"""Budget alerts: at 50, 80 and 100 % of a budget's daily or monthly limit, one alert per budget,
period and threshold, on the alerts stream and (with a webhook) in the webhook outbox.

    watcher = AlertWatcher(redis, prefix, cfg, metrics, policy=lambda: (policy, version))
    await watcher.check()          # one pass; the gateway runs it every spend.alerts.interval_s

Where thresholds are checked: off the request path, from the spend ledger itself. Each pass reads
the new entries of every budgeted tenant's spend stream ({prefix}spend:{T}:stream) after a cursor
kept in Redis (the hash CURSOR, tenant -> last stream id checked; first time: the start of this
month). Every record names its tenant, key and tags, hence the budgets it counts against
(tokenyard.policies.budgets.scopes) and the day and month it belongs to (its arrival time). Each touched
(budget, period) is then summed exactly from the hourly rollups (tokenyard/gateway/spend/budget.py) and every
threshold reached fires. The stream entry and the rollups are written by one Lua script, so a
record seen on the stream is always in the rollups. The cursor moves only after the pass fired
what it found; a crash repeats part of a pass, which fires nothing twice (below).

Once: firing is one Lua script (lua/alert_fire.lua): SET NX of the marker FIRED(id) (TTL: the
period's end + MARKER_GRACE_S), then XADD to STREAM and, with a webhook, the outbox item; all or
nothing. The id hashes (tenant, dimension, value, period, period instance, threshold, limit), so
gateways running the same pass at once, a pass repeated after a crash, and records replayed from
the spool after a Redis outage (they reach the stream when they reach Redis, and the cursor picks
them up then) all fire each alert exactly once. A new limit is a new budget: raising a limit
mid-period re-arms its thresholds (the ones already passed under the new limit fire again).
Periods that ended more than PAST_PERIODS_S ago are not checked (late replays of old records).

Not covered: an alert for a budget added to the policy mid-period fires with the tenant's next
record, not at once; values the dimension rollups count under "(other)" (past
spend.max_values_per_dimension per tenant-hour) are not seen by their key or tag budget.

Redis keys ({A} = {prefix}spend:{alerts}, one hash slot):
    {A}:fired:{id}  marker with TTL       {A}:stream   XADD field "a" = the alert JSON
    {A}:outbox      hash id -> JSON       {A}:due      zset id -> next attempt (ms)
    {A}:tries       hash id -> attempts   {A}:dead     list of alerts the webhook gave up on
    {A}:cursor      hash tenant -> stream id checked up to
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tokenyard.gateway.config.spend_settings import AlertsConfig
from tokenyard.gateway.spend.budget import hourly_costs
from tokenyard.gateway.spend.redis_keys import stream_key, tenants_key
from tokenyard.gateway.spend.store import stream_record
from tokenyard.policies.budgets import Scope, crossed, has_budgets, limits, period_bounds, period_instance, scopes
from tokenyard.policies.schema import Policy

log = logging.getLogger("tokenyard.alerts")
_LUA = Path(__file__).resolve().parent / "lua" / "alert_fire.lua"
PAGE = 1000                      # stream entries read per call
MAX_PAGES = 50                   # per tenant and pass (the rest: next pass)
PAST_PERIODS_S = 35 * 86400
MARKER_GRACE_S = 40 * 86400


def _a(prefix: str) -> str:
    return f"{prefix}spend:{{alerts}}"


def fired_key(prefix: str, alert_id: str) -> str:
    return f"{_a(prefix)}:fired:{alert_id}"


def alerts_stream(prefix: str) -> str:
    return f"{_a(prefix)}:stream"


def outbox_key(prefix: str) -> str:
    return f"{_a(prefix)}:outbox"


def due_key(prefix: str) -> str:
    return f"{_a(prefix)}:due"


def tries_key(prefix: str) -> str:
    return f"{_a(prefix)}:tries"


def dead_key(prefix: str) -> str:
    return f"{_a(prefix)}:dead"


def cursor_key(prefix: str) -> str:
    return f"{_a(prefix)}:cursor"


def alert_id(tenant: str, scope: Scope, period: str, instance: str, threshold: int, limit: int) -> str:
    raw = json.dumps([tenant, scope.dim, scope.value, period, instance, threshold, limit], ensure_ascii=False)
    return "al_" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:24]


@dataclass(slots=True, frozen=True)
class Touched:
    tenant: str
    scope: Scope
    period: str
    instance: str
    limit: int


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class AlertWatcher:
    def __init__(self, redis: Any, prefix: str, cfg: AlertsConfig, metrics: Any,
                 policy: Callable[[], tuple[Policy | None, int]]) -> None:
        self.redis = redis
        self.prefix = prefix
        self.cfg = cfg
        self.metrics = metrics
        self.policy = policy
        self._fire = redis.register_script(_LUA.read_text())
        self._failing = False

    async def run(self) -> None:
        while True:
            try:
                await self.check()
                if self._failing:
                    log.info("budget alerts: redis reachable again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis down or anything else: retry next pass
                if not self._failing:
                    log.warning("budget alerts: check failed (%s: %s); retrying every %g s", type(e).__name__, e,
                                self.cfg.interval_s)
                self._failing = True
            await asyncio.sleep(self.cfg.interval_s)

    async def check(self, now: float | None = None) -> int:
        """One pass over the new usage records; returns the alerts fired now."""
        policy, version = self.policy()
        if policy is None or not any(has_budgets(tp) for tp in policy.tenants.values()):
            return 0
        now = time.time() if now is None else now
        tenants = sorted(_s(t) for t in await self.redis.smembers(tenants_key(self.prefix)))
        tenants = [t for t in tenants if has_budgets(policy.tenant(t))]
        if not tenants:
            return 0
        cursors = {_s(k): _s(v) for k, v in (await self.redis.hgetall(cursor_key(self.prefix))).items()}
        month_start = period_bounds("month", period_instance("month", now))[0]
        starts = {t: cursors.get(t) or f"{int(month_start * 1000)}-0" for t in tenants}
        pipe = self.redis.pipeline(transaction=False)       # one round trip for every tenant's first page
        for t in tenants:
            pipe.xrange(stream_key(self.prefix, t), min="(" + starts[t], max="+", count=PAGE)
        fired = 0
        for tenant, first in zip(tenants, await pipe.execute()):
            if not first:
                continue
            touched, last = await self._read(policy, tenant, starts[tenant], first, now)
            if touched:
                fired += await self._evaluate(tenant, touched, version, now)
            await self.redis.hset(cursor_key(self.prefix), tenant, last)
        return fired

    async def _read(self, policy: Policy, tenant: str, start: str, entries: list,
                    now: float) -> tuple[set[Touched], str]:
        """The (budget, period) pairs the tenant's records after `start` count against (the first page
        given); the last id read."""
        touched: set[Touched] = set()
        last = start
        for page in range(MAX_PAGES):
            if page:
                entries = await self.redis.xrange(stream_key(self.prefix, tenant), min="(" + last, max="+",
                                                  count=PAGE)
            for sid, fields in entries:
                last = _s(sid)
                try:
                    rec = stream_record(fields)
                    t = float(rec["time"])
                except (TypeError, ValueError, KeyError):
                    continue
                tags = {str(k): str(v) for k, v in (rec.get("tags") or {}).items()}
                for scope in scopes(policy, tenant, rec.get("key_id") or None, rec.get("key_name") or None, tags):
                    for period, limit in limits(scope.budget):
                        instance = period_instance(period, t)
                        if period_bounds(period, instance)[1] + PAST_PERIODS_S > now:
                            touched.add(Touched(tenant, scope, period, instance, limit))
            if len(entries) < PAGE:
                break
        return touched, last

    async def _evaluate(self, tenant: str, touched: set[Touched], version: int, now: float) -> int:
        bounds = {(x.period, x.instance): period_bounds(x.period, x.instance) for x in touched}
        start_h = int(min(b[0] for b in bounds.values())) // 3600
        end_h = int(max(b[1] for b in bounds.values())) // 3600
        dims = sorted({(x.scope.dim, x.scope.value) for x in touched if x.scope.dim})
        total, by_dim = await hourly_costs(self.redis, self.prefix, tenant, dims, start_h, end_h)
        webhook = "1" if self.cfg.webhook_url else "0"
        calls: list[tuple[dict[str, Any], int]] = []
        for x in sorted(touched, key=lambda x: (x.scope.dim, x.scope.value, x.period, x.instance)):
            lo, hi = (int(b) // 3600 for b in bounds[x.period, x.instance])
            hourly = total if not x.scope.dim else by_dim[x.scope.dim, x.scope.value]
            spent = sum(c for h, c in hourly.items() if lo <= h < hi)
            for threshold in crossed(x.limit, spent):
                calls.append((self._alert(x, threshold, spent, version, now), int(bounds[x.period, x.instance][1])))
        if not calls:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for alert, period_end in calls:
            ttl = max(60, int(period_end - now) + MARKER_GRACE_S)
            await self._fire(keys=[fired_key(self.prefix, alert["id"]), alerts_stream(self.prefix),
                                   outbox_key(self.prefix), due_key(self.prefix)],
                             args=[json.dumps(alert, ensure_ascii=False, separators=(",", ":")), alert["id"], ttl,
                                   self.cfg.stream_max_len, int(now * 1000), webhook], client=pipe)
        results = await pipe.execute()
        fired = 0
        for (alert, _), result in zip(calls, results):
            if int(result) == 1:
                fired += 1
                self.metrics.budget_alerts.labels(str(alert["threshold_pct"])).inc()
                log.info("budget alert %s: tenant %s %s %s %s at %d%% (%d of %d micro-units)", alert["id"],
                         tenant, alert["budget"], alert["period"], alert["period_start"], alert["threshold_pct"],
                         alert["spent_micros"], alert["limit_micros"])
        return fired

    @staticmethod
    def _alert(x: Touched, threshold: int, spent: int, version: int, now: float) -> dict[str, Any]:
        return {"id": alert_id(x.tenant, x.scope, x.period, x.instance, threshold, x.limit),
                "type": "budget.threshold", "time": round(now, 3), "tenant": x.tenant, "scope": x.scope.kind,
                "dimension": x.scope.dim, "value": x.scope.value, "entry": x.scope.entry,
                "budget": x.scope.label(), "period": x.period, "period_start": x.instance,
                "threshold_pct": threshold, "limit_micros": x.limit, "spent_micros": spent,
                "at_limit": x.scope.budget.at_limit, "policy_version": version}


async def read_alerts(redis: Any, prefix: str, since: float, until: float | None = None,
                      limit: int = 10_000) -> list[dict[str, Any]]:
    """Alerts on the stream fired in [since, until), oldest first."""
    hi = "+" if until is None else str(int(until * 1000) - 1)
    entries = await redis.xrange(alerts_stream(prefix), min=str(int(since * 1000)), max=hi, count=limit)
    out = []
    for sid, fields in entries:
        raw = fields.get(b"a", fields.get("a"))
        try:
            alert = json.loads(raw)
        except (TypeError, ValueError):
            continue
        alert["stream_id"] = _s(sid)
        out.append(alert)
    return out


async def outbox_state(redis: Any, prefix: str) -> dict[str, int]:
    """Webhook outbox: items waiting (or being sent) and alerts given up on."""
    pipe = redis.pipeline(transaction=False)
    pipe.hlen(outbox_key(prefix))
    pipe.llen(dead_key(prefix))
    pending, dead = await pipe.execute()
    return {"pending": int(pending), "dead": int(dead)}

