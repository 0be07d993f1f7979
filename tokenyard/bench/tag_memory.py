"""Redis memory of the spend rollups under hostile tags (issue 46.4): N usage records, each with 16
random metadata keys and values, written by the spend ledger's own Lua script (SpendLedger._store,
the gateway's writer path minus HTTP: driven directly so that 10,000 records take seconds) into
Redis under a unique prefix, one tenant, one hour.

Measured per run: MEMORY USAGE of every key written, split into the rollups (hourly, dimension
rollups, value and tag-name sets, indexes) and the per-request log (the request stream and the
idempotency keys, which hold each record once whatever its tags and are bounded by
spend.stream_max_len / stream_retention_days), the number of keys and of dimension-rollup fields,
the INFO used_memory delta, and the time of one report grouped by user (which reads the dimension
rollup hash). Two runs: spend.max_tag_names as configured (default 64) and unbounded (what the
ledger did before the bound). Goal: everything the ledger writes for 10,000 hostile records (rollups,
request stream, idempotency keys) <= 5 MB.

    .venv/bin/python -m tokenyard.bench.tag_memory [--records 10000] [--max-tag-names 64]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import tempfile
import time
from typing import Any

TAGS_PER_RECORD = 16
GOAL_BYTES = 5 * 1024 * 1024


def _records(n: int, now: float, seed: int, tags: int = TAGS_PER_RECORD) -> list[dict[str, Any]]:
    from tokenyard.gateway.spend.usage import UsageRecord
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    return [UsageRecord(request_id=f"r{i}", time=now, engine=rng.choice(["small", "large"]), requested_model="auto",
                        route_reason="router", prompt_tokens=rng.randint(10, 500), cached_tokens=0,
                        completion_tokens=rng.randint(1, 200), cost_micros=rng.randint(0, 10**5), status="ok",
                        finish_reason="stop", ttft_s=0.01, e2e_s=0.1, stream=False, tenant="hostile",
                        key_id="k" + str(i % 4), user=f"user{rng.randint(0, 50)}",
                        tags={word(): word() for _ in range(tags)}).to_dict() for i in range(n)]


async def run_once(redis_url: str, n: int, max_tag_names: int, seed: int, tags: int = TAGS_PER_RECORD) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from tokenyard.gateway.config.spend_settings import SpendConfig
    from tokenyard.gateway.observability.metrics import GatewayMetrics
    from tokenyard.gateway.routes.spend_queries import read_report
    from tokenyard.gateway.spend.ledger import SpendLedger
    prefix = f"tybench:tagmem:{secrets.token_hex(4)}:"
    client = aioredis.Redis.from_url(redis_url)
    now = time.time()
    recs = _records(n, now, seed, tags)
    cfg = SpendConfig(spool_dir=tempfile.mkdtemp(prefix="tagmem-spool-"), max_tag_names=max_tag_names)
    ledger = SpendLedger(redis_url, prefix, cfg, GatewayMetrics(lambda: {}))
    try:
        before = int((await client.info("memory"))["used_memory"])
        t0 = time.perf_counter()
        for i in range(0, n, 128):
            await ledger._store(recs[i:i + 128], "stored")
        write_s = time.perf_counter() - t0
        after = int((await client.info("memory"))["used_memory"])
        rollup_bytes = log_bytes = keys = log_keys = 0
        fields = 0
        async for k in client.scan_iter(match=prefix + "*", count=1000):
            name = k.decode()
            size = int(await client.memory_usage(k, samples=0) or 0)
            if name.endswith(":stream") or ":seen:" in name:
                log_bytes += size
                log_keys += 1
            else:
                rollup_bytes += size
                keys += 1
                if ":hd:" in name:
                    fields += int(await client.hlen(k))
        hour = int(now) // 3600
        t0 = time.perf_counter()
        data, _, _, _ = await read_report(client, prefix, ["hostile"], hour, hour + 1, ["user"])
        report_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tagged, _, _, _ = await read_report(client, prefix, ["hostile"], hour, hour + 1, ["tag:(other)"])
        other_s = time.perf_counter() - t0
        assert sum(r["requests"] for r in data) == n
        folded = {r["tag:(other)"]: r["requests"] for r in tagged}.get("(other)", 0)
        return {"records": n, "tags_per_record": tags, "max_tag_names": max_tag_names,
                "rollup_bytes": rollup_bytes, "rollup_keys": keys, "dimension_rollup_fields": fields,
                "request_log_bytes": log_bytes, "request_log_keys": log_keys,
                "used_memory_delta_bytes": after - before, "write_s": round(write_s, 3),
                "report_by_user_s": round(report_s, 4), "report_by_tag_other_s": round(other_s, 4),
                "records_with_folded_tags": folded, "rollup_goal_met": rollup_bytes <= GOAL_BYTES,
                "group_count": len(data)}
    finally:
        await ledger.redis.aclose()
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i:i + 500])
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--max-tag-names", type=int, default=None, help="default: spend.max_tag_names's default")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    from tokenyard.gateway.config.spend_settings import SpendConfig
    rec = RunRecorder("tag_memory")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    bound = args.max_tag_names or SpendConfig().max_tag_names
    runs = [asyncio.run(run_once(redis_url, args.records, bound, seed=1)),
            asyncio.run(run_once(redis_url, args.records, 10**9, seed=1)),
            # The same requests without tags: what the request log and rollups take anyway, so that the
            # growth the hostile tags cause can be read apart from the per-request log every request writes.
            asyncio.run(run_once(redis_url, args.records, bound, seed=1, tags=0))]
    for r in runs:
        print(r)
    capped, unbounded, untagged = runs
    total = lambda r: r["rollup_bytes"] + r["request_log_bytes"]  # noqa: E731
    figures = {"records": args.records, "tags_per_record": TAGS_PER_RECORD, "max_tag_names": bound,
               "rollup_mb": round(capped["rollup_bytes"] / 2**20, 3),
               "rollup_mb_unbounded": round(unbounded["rollup_bytes"] / 2**20, 3),
               "request_log_mb": round(capped["request_log_bytes"] / 2**20, 3),
               "used_memory_delta_mb": round(capped["used_memory_delta_bytes"] / 2**20, 3),
               "used_memory_delta_mb_unbounded": round(unbounded["used_memory_delta_bytes"] / 2**20, 3),
               "rollup_keys": capped["rollup_keys"], "rollup_keys_unbounded": unbounded["rollup_keys"],
               "report_by_user_s": capped["report_by_user_s"],
               "report_by_user_s_unbounded": unbounded["report_by_user_s"],
               "untagged_total_mb": round(total(untagged) / 2**20, 3),
               "hostile_tag_growth_mb": round((total(capped) - total(untagged)) / 2**20, 3),
               "total_mb": round(total(capped) / 2**20, 3),
               # Issue 46's goal: Redis memory per 10,000 hostile-tag requests <= 5 MB, everything the
               # ledger writes for them (rollups, request stream, idempotency keys), not only the rollups.
               "goal_mb": GOAL_BYTES / 2**20,
               "goal_met": total(capped) * 10_000 / args.records <= GOAL_BYTES}
    rec.write(figures, runs, driver="SpendLedger._store (the ledger's Lua script), not HTTP")


if __name__ == "__main__":
    main()
