"""Spend grouped by key, user, route and tag: 20k random usage records written through the ledger's
Lua script into the shared Redis, then every grouping must add up to the ungrouped total to the
micro-unit; the per-hour bound on distinct values sends the rest to "(other)" without losing a unit;
two dimensions at once are answered exactly from the stream. 20k is enough for each property: a whole
tenant-hour holds ~1,700 records from ~300 users (three times the bound of 100) and an hour holds
~3,300 records for the stream (100k, the earlier size, proved nothing more and took five times as long)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix

from tokenyard.gateway.config.spend_settings import SpendConfig
from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.routes.spend_queries import read_report
from tokenyard.gateway.spend import reports
from tokenyard.gateway.spend.ledger import SpendLedger
from tokenyard.gateway.spend.usage import UsageRecord

N = 20_000
HOURS = 6
TENANTS = ("acme", "globex")



def _records(n: int, now: float) -> list[UsageRecord]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        tags = {}
        if rng.random() < 0.7:
            tags["team"] = rng.choice(["search", "ads", "<b>growth</b>", "a|b"])
        if rng.random() < 0.3:
            tags["env"] = rng.choice(["prod", "dev"])
        p, c = rng.randint(1, 4000), rng.randint(0, 800)
        out.append(UsageRecord(
            request_id=f"r{i}", time=now - rng.randint(0, HOURS * 3600 - 1), engine=rng.choice(["small", "large"]),
            requested_model="auto", route_reason=rng.choice(["router", "pinned", "auto:default"]),
            prompt_tokens=p, cached_tokens=rng.randint(0, p), completion_tokens=c,
            cost_micros=rng.randint(0, 10**7), status="ok" if rng.random() < 0.97 else "error",
            finish_reason="stop", ttft_s=0.1, e2e_s=0.5, stream=False, tenant=rng.choice(TENANTS),
            key_id=f"key{rng.randint(0, 40)}", user=rng.choice([None, *[f"user{u}" for u in range(300)]]),
            tags=tags, baseline_cost_micros=rng.randint(0, 10**7)))
    return out


@pytest.fixture(scope="module")
def ledger_world(tmp_path_factory):
    prefix = unique_prefix("dims")
    cfg = SpendConfig(spool_dir=tmp_path_factory.mktemp("spool"), max_values_per_dimension=100)
    now = time.time()
    recs = _records(N, now)

    async def write() -> None:
        ledger = SpendLedger(SHARED_REDIS, prefix, cfg, GatewayMetrics(lambda: {}))
        for i in range(0, N, 1024):
            await asyncio.gather(*(ledger._store([r.to_dict() for r in recs[j:j + 128]], "stored")
                                   for j in range(i, min(i + 1024, N), 128)))
        await ledger.redis.aclose()

    asyncio.run(write())
    try:
        yield prefix, recs, now, _exact(recs)
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def _report(prefix: str, group_by: list[str], now: float, hours: tuple[int, int] | None = None):
    import redis.asyncio as aioredis

    async def run():
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            span = hours or reports.hour_range(now - (HOURS + 1) * 3600, now + 3600)
            return await read_report(client, prefix, list(TENANTS), *span, group_by)
        finally:
            await client.aclose()
    return asyncio.run(run())


def _exact(recs: list[UsageRecord]) -> dict:
    return {"requests": len(recs), "prompt_tokens": sum(r.prompt_tokens for r in recs),
            "cached_tokens": sum(r.cached_tokens for r in recs),
            "completion_tokens": sum(r.completion_tokens for r in recs), "cost_micros": sum(r.cost_micros for r in recs),
            "baseline_cost_micros": sum(r.baseline_cost_micros for r in recs),
            "errors": sum(r.status != "ok" for r in recs)}


@pytest.mark.parametrize("group_by", [["model"], ["key"], ["user"], ["route"], ["tag:team"], ["tag:env", "model"],
                                      ["day", "tenant", "user"], ["hour", "tag:team"]])
def test_every_grouping_adds_up_to_the_total_to_the_micro_unit(ledger_world, group_by):
    prefix, recs, now, exact = ledger_world
    data, total, source, _ = _report(prefix, group_by, now)
    assert source == "rollups"
    for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros",
              "baseline_cost_micros", "errors"):
        assert total[k] == exact[k], k
        assert sum(row[k] for row in data) == exact[k], (group_by, k)


def test_a_dimension_within_its_bound_is_exact_per_value(ledger_world):
    prefix, recs, now, _ = ledger_world
    data, _, _, _ = _report(prefix, ["tag:team"], now)
    got = {row["tag:team"]: row["cost_micros"] for row in data}
    want: dict[str, int] = {}
    for r in recs:
        team = r.tags.get("team", "(none)")
        want[team] = want.get(team, 0) + r.cost_micros
    assert got == want      # four teams, far under the bound: no "(other)"; "(none)" is the untagged rest


def test_values_past_the_bound_count_as_other(ledger_world):
    prefix, recs, now, exact = ledger_world
    data, _, _, _ = _report(prefix, ["user"], now)
    users = {row["user"] for row in data}
    # 300 users a tenant-hour, 100 kept each: "(other)" holds the rest, and the total still matches.
    assert "(other)" in users and "(none)" in users
    assert sum(row["cost_micros"] for row in data) == exact["cost_micros"]


def test_two_dimensions_come_from_the_stream_exactly(ledger_world):
    prefix, recs, now, _ = ledger_world
    hour = int(now) // 3600 - 2                 # one whole hour: ~1/6 of the records, read from the stream
    data, total, source, _ = _report(prefix, ["key", "tag:env"], now, (hour, hour + 1))
    assert source == "stream"
    inside = [r for r in recs if int(r.time) // 3600 == hour]
    want: dict[tuple[str, str], int] = {}
    for r in inside:
        k = (r.key_id, r.tags.get("env", "(none)"))
        want[k] = want.get(k, 0) + r.completion_tokens
    assert len(inside) > 1000 and {(row["key"], row["tag:env"]): row["completion_tokens"] for row in data} == want
    assert total["cost_micros"] == sum(r.cost_micros for r in inside)


@pytest.mark.parametrize("value", ["tag:", "tag:" + "x" * 65, "model,model", "team"])
def test_bad_group_by_names_the_choices(value):
    with pytest.raises(ValueError, match="tag:NAME"):
        reports.parse_group_by(value)


def test_spend_per_lora_adapter_is_exact(tmp_path):
    """model,adapter: each engine's adapters (model ENGINE:ADAPTER) and the base in "(none)", from the
    adapter rollup; each row equals its records' sum and the rows add up to the total, to the micro-unit."""
    prefix = unique_prefix("lora")
    cfg = SpendConfig(spool_dir=tmp_path, max_values_per_dimension=100)
    now = time.time()
    rng = random.Random(11)
    recs = [UsageRecord(request_id=f"a{i}", time=now - rng.randint(0, 3 * 3600), engine=rng.choice(["small", "large"]),
                        requested_model="x", route_reason="pinned", prompt_tokens=rng.randint(1, 900), cached_tokens=0,
                        completion_tokens=rng.randint(0, 300), cost_micros=rng.randint(0, 10**6), status="ok",
                        finish_reason="stop", ttft_s=0.1, e2e_s=0.2, stream=False, tenant=rng.choice(TENANTS),
                        lora=rng.choice(["", "sql", "chat"])) for i in range(600)]

    async def write() -> None:
        ledger = SpendLedger(SHARED_REDIS, prefix, cfg, GatewayMetrics(lambda: {}))
        await ledger._store([r.to_dict() for r in recs], "stored")
        await ledger.redis.aclose()

    asyncio.run(write())
    try:
        data, total, source, _ = _report(prefix, ["model", "adapter"], now)
        assert source == "rollups"
        want: dict[tuple[str, str], int] = {}
        for r in recs:
            k = (r.engine, r.lora or reports.NONE)
            want[k] = want.get(k, 0) + r.cost_micros
        assert {(row["model"], row["adapter"]): row["cost_micros"] for row in data} == want
        assert sum(row["cost_micros"] for row in data) == total["cost_micros"] == sum(r.cost_micros for r in recs)
        assert {row["requests"] for row in data if row["adapter"] == "sql"} and \
            sum(row["requests"] for row in data if row["adapter"] == "sql") == sum(r.lora == "sql" for r in recs)
    finally:
        delete_prefix(SHARED_REDIS, prefix)
