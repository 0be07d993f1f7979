"""What the admin API, the operator page and `tokenyard policy` do with policies, in one place.

    version, applied = await apply(gw_store, text, author, engines)
    result = await simulate_text(redis, prefix, current, proposed_text, learned, engines, start, end, limit)

Simulation replays recorded traffic: the spend ledger's usage records (they carry the
features the policy looks at and the token counts, never prompt text), newest `limit` records in
[start, end) across every tenant (or one), under the proposed policy and under the current one
(tokenyard.policies.simulate / Comparison). Only requests that reached an engine are recorded, so requests
the current policy denied or shed are not in the replay.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from tokenyard.gateway.edge.errors import Unavailable
from tokenyard.gateway.policy.store import deployment_problems
from tokenyard.gateway.policy.work import off_loop
from tokenyard.gateway.spend.reports import iso
from tokenyard.gateway.spend.store import all_tenants, records
from tokenyard.policies import Comparison, Policy, PolicyError, UsageFeatures, load_policy, simulate
from tokenyard.router_models.runtime.calibration import threshold_from_quantiles

if TYPE_CHECKING:
    from tokenyard.gateway.auth.api_keys import KeyRecord
    from tokenyard.gateway.state import Gateway

DEFAULT_LIMIT = 10_000
MAX_LIMIT = 100_000


def check_document(text: str, engines: list[str]) -> Policy:
    """The policy, or PolicyError listing every problem (schema and this deployment's engines)."""
    policy = load_policy(text)
    problems = deployment_problems(policy, engines)
    if problems:
        raise PolicyError(problems)
    return policy


def threshold_for(policy: Policy, learned: Any) -> float | None:
    """The router threshold this policy routes with in the gateway (None: decide()'s own rule)."""
    if policy.router.threshold is not None:
        return None
    if learned is None:
        return None
    if policy.router.target_large_share is not None:
        return threshold_from_quantiles(learned.scorer.artifact.quantiles, policy.router.target_large_share)
    return learned.threshold


async def recorded_traffic(redis: Any, prefix: str, start: float | None, end: float | None, limit: int,
                           tenant: str | None = None) -> list[UsageFeatures]:
    tenants = [tenant] if tenant else await all_tenants(redis, prefix)
    out: list[UsageFeatures] = []
    cursor = None
    while len(out) < limit:
        page, cursor = await records(redis, prefix, tenants, limit=min(1000, limit - len(out)), cursor=cursor,
                                     start=start, end=end)
        out += [UsageFeatures.from_dict(r) for r in page]
        if cursor is None:
            break
    return out


def compare_policies(current: Policy | None, proposed: Policy, traffic: list[UsageFeatures],
                     learned: Any) -> dict[str, Any]:
    prop = simulate(proposed, traffic, threshold_for(proposed, learned))
    if current is None:
        return {"records": len(traffic), "current": None, "proposed": prop.to_dict(), "delta": None,
                "text": None}
    cur = simulate(current, traffic, threshold_for(current, learned))
    cmp = Comparison(cur, prop)
    return {"records": len(traffic), **cmp.to_dict(), "text": cmp.to_text()}


def comparison_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The table the operator page shows: (label, current, proposed, change); money as currency."""
    from tokenyard.policies import format_money
    cur, prop = result.get("current"), result["proposed"]
    rows: list[tuple[str, str, str, str]] = []

    def add(label: str, a: Any, b: Any, money: bool = False, share: bool = False) -> None:
        def fmt(v: Any) -> str:
            if v is None:
                return "–"
            if money:
                return format_money(v)
            return f"{v:.1%}" if share else str(v)
        change = "–"
        if a is not None and b is not None:
            change = (f"{(b - a) * 100:+.1f} pts" if share else
                      ("+" if b >= a else "") + format_money(b - a) if money else f"{b - a:+d}")
        rows.append((label, fmt(a), fmt(b), change))

    get = (lambda k: cur[k]) if cur is not None else (lambda k: None)
    for k in ("requests", "served", "denied", "shed", "downgraded", "degraded", "large_calls"):
        add(k, get(k), prop[k])
    add("large_share", get("large_share"), prop["large_share"], share=True)
    add("spend_total", get("spend_total"), prop["spend_total"], money=True)
    engines = sorted(set(prop["spend_by_engine"]) | set(cur["spend_by_engine"] if cur else ()))
    for e in engines:
        add(f"spend[{e}]", cur["spend_by_engine"].get(e, 0) if cur else None, prop["spend_by_engine"].get(e, 0),
            money=True)
    # Per tenant, as the CLI's table (Comparison.to_text) shows them.
    tenants = sorted(set(prop["spend_by_tenant"]) | set(cur["spend_by_tenant"] if cur else ()))
    for t in tenants:
        add(f"tenant[{t}]", cur["spend_by_tenant"].get(t, 0) if cur else None, prop["spend_by_tenant"].get(t, 0),
            money=True)
    return rows


def author_of(key: "KeyRecord") -> str:
    return key.name or key.key_id


async def run_simulation(gw: "Gateway", proposed: Any, start: float, end: float, limit: int,
                         tenant: str | None) -> dict[str, Any]:
    if gw.ledger is None:
        raise Unavailable("Simulation replays the spend ledger, which this gateway does not have",
                          code="spend_unavailable", headers={"retry-after": "60"})
    try:
        traffic = await recorded_traffic(gw.ledger.redis, gw.deployment.redis_prefix, start, end, limit, tenant)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    result = await off_loop(compare_policies, gw.policy.policy, proposed, traffic, gw.learned_router)
    return {"object": "policy.simulation", "current_version": gw.policy.number, "start": iso(start),
            "end": iso(end), "limit": limit, **result}
