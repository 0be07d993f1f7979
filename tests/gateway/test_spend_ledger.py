"""The spend ledger under concurrency with aborts: every request has exactly one record, the records
equal the usage the clients saw, and the hourly rollups equal the sum of the records exactly.

Shared Redis (127.0.0.1:6379) under a unique prefix, mock engine, three tenants."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import aiohttp
import redis
from gateway_helpers import SHARED_REDIS, mock_deployment, running_gateway, wait_ledger

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.config.deployment import Prices
from tokenyard.gateway.spend.redis_keys import ROLLUP_FIELDS, hours_key, rollup_key, stream_key, tenants_key
from tokenyard.gateway.spend.store import stream_record

PRICES = {"input": 123_457, "cached_input": 61_729, "output": 987_653}   # odd numbers: rounding matters
OUTPUT_LEN = 30
TENANTS = ("acme", "globex", "initech")
N = 48


def read_records(client: redis.Redis, prefix: str, tenants) -> list[dict]:
    out = []
    for t in tenants:
        out += [stream_record(f) for _, f in client.xrange(stream_key(prefix, t))]
    return out


def read_rollups(client: redis.Redis, prefix: str, tenants) -> dict[tuple[str, str], dict[str, int]]:
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(ROLLUP_FIELDS, 0))
    for t in tenants:
        for hour in client.zrange(hours_key(prefix, t), 0, -1):
            for k, v in client.hgetall(rollup_key(prefix, t, int(hour))).items():
                engine, _, field = k.decode().rpartition("|")
                sums[(t, engine)][field] += int(v)
    return dict(sums)


def sum_records(records: list[dict]) -> dict[tuple[str, str], dict[str, int]]:
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(ROLLUP_FIELDS, 0))
    for r in records:
        s = sums[(r["tenant"], r["engine"])]
        s["requests"] += 1
        for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros", "baseline_cost_micros"):
            s[k] += r[k]
        s["errors"] += r["status"] != "ok"
    return dict(sums)


async def one_request(session: aiohttp.ClientSession, url: str, key: str, i: int) -> dict:
    """Kind i % 4: 0 plain, 1 streamed with usage, 2 streamed then cut after two deltas, 3 plain then cut."""
    kind = i % 4
    rid = f"req-{i}"
    body = {"model": "mock", "messages": [{"role": "user", "content": f"request number {i} " * (1 + i % 5)}],
            "max_tokens": 64, "stream": kind in (1, 2), "metadata": {"team": f"t{i % 3}"}}
    if kind == 1:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}", "x-request-id": rid}
    seen = {"rid": rid, "kind": kind, "usage": None, "deltas": 0}
    if kind == 3:
        try:
            await asyncio.wait_for(session.post(url, json=body, headers=headers), 0.08)
        except asyncio.TimeoutError:
            pass
        return seen
    async with session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        if kind == 0:
            seen["usage"] = (await resp.json())["usage"]
            return seen
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                seen["usage"] = event["usage"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                seen["deltas"] += 1
                if kind == 2 and seen["deltas"] == 2:
                    resp.close()          # the client leaves mid-stream
                    return seen
    return seen


async def fire(base_url: str, keys: list[str]) -> list[dict]:
    url = base_url + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        return await asyncio.gather(*(one_request(session, url, keys[i % len(keys)], i) for i in range(N)))


def test_concurrent_requests_with_aborts_records_and_rollups_add_up(prefix):
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    keys = [store.create(t)[0] for t in TENANTS]
    doc = {**mock_deployment(ttft_ms=5, token_ms=8, output_len=OUTPUT_LEN, max_sleep_ms=5, prices=PRICES),
           "redis_url": SHARED_REDIS, "redis_prefix": prefix}
    with running_gateway(doc) as srv:
        seen = asyncio.run(fire(srv.base_url, keys))
        wait_ledger(srv)
        records = read_records(client, prefix, TENANTS)
        by_client_id = defaultdict(list)
        for r in records:
            by_client_id[r["client_request_id"]].append(r)
        # Exactly one record per request, in its key's tenant, with the request's features.
        assert sorted(by_client_id) == sorted(s["rid"] for s in seen)
        assert all(len(v) == 1 for v in by_client_id.values())
        prices = Prices(**PRICES)
        for s in seen:
            rec = by_client_id[s["rid"]][0]
            i = int(s["rid"].split("-")[1])
            assert rec["tenant"] == TENANTS[i % 3] and rec["key_id"] and rec["requested_model"] == "mock"
            assert rec["tags"] == {"team": f"t{i % 3}"} and rec["deadline_ms"] > 0 and rec["route_reason"] == "pinned"
            assert "messages" not in rec and "request number" not in json.dumps(rec)   # never prompt text
            assert rec["cost_micros"] == prices.cost(rec["prompt_tokens"], rec["cached_tokens"],
                                                     rec["completion_tokens"])
            assert isinstance(rec["cost_micros"], int) and rec["prices"] == list(PRICES.values())
            if s["kind"] in (0, 1):
                u = s["usage"]
                assert rec["status"] == "ok"
                assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == \
                    (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])
            else:   # aborted: the partial usage, at least what the client received, short of the full reply
                assert rec["status"] == "client_disconnected", rec
                assert s["deltas"] <= rec["completion_tokens"] < OUTPUT_LEN
        # Rollups equal the sum of the records, to the micro-unit.
        rollups = read_rollups(client, prefix, TENANTS)
        assert rollups == sum_records(records)
        assert sum(v["errors"] for v in rollups.values()) == sum(1 for s in seen if s["kind"] in (2, 3))
        assert {t.decode() for t in client.smembers(tenants_key(prefix))} == set(TENANTS)
        # The report endpoint (admin) says the same.
        status, _, body = srv.request("GET", "/v1/spend/report?group_by=tenant")
        report = json.loads(body)
        assert status == 200 and report["total"]["cost_micros"] == sum(r["cost_micros"] for r in records)
        assert report["total"]["requests"] == N
        assert {row["tenant"]: row["completion_tokens"] for row in report["data"]} == {
            t: sum(r["completion_tokens"] for r in records if r["tenant"] == t) for t in TENANTS}
        # Recording the same records again changes nothing (idempotent on the request id).
        ledger = srv.gateway.ledger
        script = client.register_script(ledger._script.script)
        for r in records:
            keys_, args = ledger._script_args(r)
            assert script(keys=keys_, args=args) == 0
        assert read_rollups(client, prefix, TENANTS) == rollups
        assert len(read_records(client, prefix, TENANTS)) == N
        metrics = srv.request("GET", "/metrics")[2].decode()
        assert f'tokenyard_spend_records_total{{outcome="stored"}} {float(N)}' in metrics
    client.close()


def test_dev_key_records_use_the_dev_tenant_and_savings_baseline(prefix):
    """Two engines with different prices: the baseline (routing.large) prices the same tokens."""
    model = mock_deployment()["engines"]["mock"]["model"]
    doc = {"server": {"access_log": False}, "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "routing": {"small": "small", "large": "large", "long_prompt_tokens": 10_000},
           "engines": {"small": {"type": "mock", "model": model, "prices": {"input": 100_000, "output": 300_000}},
                       "large": {"type": "mock", "model": model,
                                 "prices": {"input": 900_000, "cached_input": 90_000, "output": 2_700_000}}}}
    with running_gateway(doc) as srv:
        for _ in range(3):
            assert srv.chat({"model": "auto", "messages": [{"role": "user", "content": "hi"}]})[0] == 200
        assert srv.chat({"model": "large", "messages": [{"role": "user", "content": "hi"}]})[0] == 200
        wait_ledger(srv)
        client = redis.Redis.from_url(SHARED_REDIS)
        records = read_records(client, prefix, ["dev"])
        client.close()
        assert len(records) == 4 and all(r["tenant"] == "dev" and r["baseline_engine"] == "large" for r in records)
        large = Prices(900_000, 90_000, 2_700_000)
        for r in records:
            assert r["baseline_cost_micros"] == large.cost(r["prompt_tokens"], r["cached_tokens"],
                                                           r["completion_tokens"])
        report = json.loads(srv.request("GET", "/v1/spend/report?group_by=model")[2])
        rows = {row["model"]: row for row in report["data"]}
        assert rows["small"]["requests"] == 3 and rows["large"]["requests"] == 1
        assert rows["large"]["savings_micros"] == 0 and rows["small"]["savings_micros"] > 0
        assert report["total"]["savings_micros"] == sum(r["baseline_cost_micros"] - r["cost_micros"] for r in records)
        tokens = rows["small"]["total_tokens"]
        assert rows["small"]["cost_per_million_tokens_micros"] == \
            (rows["small"]["cost_micros"] * 1_000_000 + tokens // 2) // tokens


def test_entries_of_two_tenants_recorded_in_one_round_trip_list_as_recorded(prefix, tmp_path):
    """The ledger writes a batch in one pipeline: entries of different tenants then share a millisecond,
    and Redis's own ids (numbered per stream) could not order them against each other; the listing
    interleaved them (a flaky 'newest first across tenants'). The ids' shared sequence orders them."""
    from dataclasses import asdict
    from unittest.mock import MagicMock

    from tokenyard.gateway.config.spend_settings import SpendConfig
    from tokenyard.gateway.spend.ledger import SpendLedger
    from tokenyard.gateway.spend.store import records as list_records
    from tokenyard.gateway.spend.usage import UsageRecord

    ledger = SpendLedger(SHARED_REDIS, prefix, SpendConfig(spool_dir=tmp_path), MagicMock())
    tenants = ["a-tenant", "b-tenant"]   # at a tie of per-stream numbers the old merge put "a-tenant" first
    recs = [asdict(UsageRecord(request_id=f"r{i}", time=1_800_000_000.0 + i, engine="mock", requested_model="mock",
                               route_reason="named", prompt_tokens=1, cached_tokens=0, completion_tokens=1,
                               cost_micros=1, status="ok", finish_reason="stop", ttft_s=0.01, e2e_s=0.02,
                               stream=False, tenant=tenants[i % 2] if i < 6 else tenants[0]))
            for i in range(12)]
    client = redis.Redis.from_url(SHARED_REDIS)
    script = client.register_script(ledger._script.script)
    pipe = client.pipeline(transaction=False)
    for r in recs:                                   # one round trip, as the ledger's writer does
        keys_, args = ledger._script_args(r)
        script(keys=keys_, args=args, client=pipe)
    assert pipe.execute() == [1] * len(recs)
    client.close()

    async def listed(limit: int) -> list[str]:
        import redis.asyncio as aioredis
        aio = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            cursor, ids = None, []
            while True:
                page, cursor = await list_records(aio, prefix, sorted(tenants), limit=limit, cursor=cursor)
                ids += [r["request_id"] for r in page]
                if cursor is None:
                    return ids
        finally:
            await aio.aclose()
    newest_first = [f"r{i}" for i in reversed(range(12))]
    assert asyncio.run(listed(100)) == newest_first
    assert asyncio.run(listed(5)) == newest_first      # the same across pages (cursors)
