"""Shadow mode's counters: how a candidate router would have routed the requests the router in
force scored, counted exactly (integers only) per tenant.

    tally = ShadowTally()
    tally.add(candidate_ref, current_ref, tenant, prompt_tokens, current_large, candidate_large, p_candidate)
    await tally.flush(redis, prefix)                # HINCRBY in one MULTI; kept for the next try on failure
    report = await read_report(redis, prefix, candidate_ref, tenant=None)

Per request (`add`), with c = the router in force sends it large, k = the candidate would, and
p = the candidate's P(small is enough):
    requests += 1; agree += (c == k); current_large += c; candidate_large += k
    to_large += (k and not c); to_small += (c and not k); prompt_tokens += n
    current_large_prompt_tokens += n if c; candidate_large_prompt_tokens += n if k
    current_shortfall_micros += round(1e6 * (1 - p)) if not c      (the candidate's estimate of how
    candidate_shortfall_micros += round(1e6 * (1 - p)) if not k      many small answers fall short)
Counts are integers, so the report equals a recomputation over the same requests exactly
(tests/router/test_router_feedback.py); predicted cost is derived from the token counts and
prices when the report is read.

Redis: `{prefix}router:shadow:{candidate ref}`, a hash with fields "{current ref}|{tenant}|{counter}";
the current ref is the policy's `router.artifact`, or "deployment" for the deployment's own router.
Each gateway keeps its counts in memory and adds them to Redis every FLUSH_S seconds (and before it
answers GET /admin/router/shadow), so a report read elsewhere may lag by that much.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

FLUSH_S = 1.0
COUNTERS = ("requests", "agree", "current_large", "candidate_large", "to_large", "to_small", "prompt_tokens",
            "current_large_prompt_tokens", "candidate_large_prompt_tokens", "current_shortfall_micros",
            "candidate_shortfall_micros")


def shadow_key(prefix: str, candidate: str) -> str:
    return f"{prefix}router:shadow:{candidate}"


def shortfall_micros(p_small_enough: float) -> int:
    return round(1_000_000 * (1.0 - p_small_enough))


class ShadowTally:
    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], dict[str, int]] = {}

    def add(self, candidate: str, current: str, tenant: str, prompt_tokens: int, current_large: bool,
            candidate_large: bool, p_candidate: float) -> None:
        c = self._counts.setdefault((candidate, current, tenant), defaultdict(int))
        n = int(prompt_tokens)
        short = shortfall_micros(p_candidate)
        c["requests"] += 1
        c["agree"] += int(current_large == candidate_large)
        c["current_large"] += int(current_large)
        c["candidate_large"] += int(candidate_large)
        c["to_large"] += int(candidate_large and not current_large)
        c["to_small"] += int(current_large and not candidate_large)
        c["prompt_tokens"] += n
        c["current_large_prompt_tokens"] += n if current_large else 0
        c["candidate_large_prompt_tokens"] += n if candidate_large else 0
        c["current_shortfall_micros"] += 0 if current_large else short
        c["candidate_shortfall_micros"] += 0 if candidate_large else short

    def pending(self) -> bool:
        return bool(self._counts)

    async def flush(self, redis: Any, prefix: str) -> None:
        """Add the counts to Redis; on failure they are merged back for the next flush (nothing lost
        or counted twice: a MULTI either applies every HINCRBY or none)."""
        if not self._counts:
            return
        taken, self._counts = self._counts, {}
        try:
            pipe = redis.pipeline(transaction=True)
            for (candidate, current, tenant), c in taken.items():
                for name, value in c.items():
                    if value:
                        pipe.hincrby(shadow_key(prefix, candidate), f"{current}|{tenant}|{name}", value)
            await pipe.execute()
        except BaseException:
            for k, c in taken.items():
                mine = self._counts.setdefault(k, defaultdict(int))
                for name, value in c.items():
                    mine[name] += value
            raise


def summarise(c: dict[str, int]) -> dict[str, Any]:
    """One row of a report: the counters and the rates derived from them."""
    n = c.get("requests", 0)
    out: dict[str, Any] = {name: c.get(name, 0) for name in COUNTERS}
    out["agreement"] = c.get("agree", 0) / n if n else None
    out["current_large_share"] = c.get("current_large", 0) / n if n else None
    out["candidate_large_share"] = c.get("candidate_large", 0) / n if n else None
    out["current_predicted_shortfall"] = c.get("current_shortfall_micros", 0) / 1e6
    out["candidate_predicted_shortfall"] = c.get("candidate_shortfall_micros", 0) / 1e6
    return out


def with_costs(row: dict[str, Any], small_input_micros: int, large_input_micros: int) -> dict[str, Any]:
    """Predicted prompt cost (micro-units) of each router's choices at these input prices per 1M
    tokens: the token counts are exact, the cost is their product with the prices."""
    for who in ("current", "candidate"):
        large = row[f"{who}_large_prompt_tokens"]
        small = row["prompt_tokens"] - large
        row[f"{who}_predicted_prompt_cost_micros"] = (large * large_input_micros + small * small_input_micros) / 1e6
    row["predicted_prompt_cost_delta_micros"] = (row["candidate_predicted_prompt_cost_micros"]
                                                 - row["current_predicted_prompt_cost_micros"])
    return row


def _text(raw: Any) -> str:
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


async def read_report(redis: Any, prefix: str, candidate: str, tenant: str | None = None) -> dict[str, Any]:
    """{candidate, rows: [{current, tenant, ...counters and rates}], total: {...}} (tenant: that tenant only)."""
    raw = await redis.hgetall(shadow_key(prefix, candidate))
    groups: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total: dict[str, int] = defaultdict(int)
    for field, value in raw.items():
        current, rest = _text(field).split("|", 1)      # refs have no "|"; a tenant name may
        who, name = rest.rsplit("|", 1)
        if tenant is not None and who != tenant:
            continue
        groups[(current, who)][name] += int(value)
        total[name] += int(value)
    rows = [{"current": cur, "tenant": who, **summarise(c)} for (cur, who), c in sorted(groups.items())]
    return {"candidate": candidate, "tenant": tenant, "rows": rows, "total": summarise(total)}
