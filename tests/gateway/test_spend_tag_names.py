"""The number of tag names a tenant's rollups keep is bounded (issue 46.4): requests with many distinct
metadata keys used to give every key a dimension of its own (a value set and 7 fields per value and
engine, 400 days), 80,000 keys and a 574,000-field hash for 5,000 requests. Now at most
spend.max_tag_names names per tenant and hour get a dimension; a record's other tags count once,
together, under tag:(other) = "(other)", so every grouping still adds up to the total, exactly.
Through the ledger's Lua script on the shared Redis (the same path as the gateway's writer)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix

from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
from tokenyard.gateway.config.spend_settings import SpendConfig
from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.routes.spend_queries import read_report
from tokenyard.gateway.spend import reports
from tokenyard.gateway.spend.ledger import SpendLedger
from tokenyard.gateway.spend.redis_keys import tag_names_key
from tokenyard.gateway.spend.usage import UsageRecord

NAMES = 8
N = 400



def _records(now: float) -> list[UsageRecord]:
    rng = random.Random(5)
    out = []
    for i in range(N):
        tags = {"team": rng.choice(["a", "b"])} if i % 2 else {}
        if i >= 2:     # the first tagged record names "team" alone: it keeps a dimension
            tags.update({f"k{rng.randrange(10**9)}": f"v{rng.randrange(10**9)}" for _ in range(rng.randint(0, 6))})
        if i % 50 == 0:
            tags["(other)"] = "literal"          # a tag really named "(other)" folds too, counted once
        out.append(UsageRecord(request_id=f"r{i}", time=now, engine=rng.choice(["small", "large"]),
                               requested_model="auto", route_reason="pinned", prompt_tokens=10, cached_tokens=0,
                               completion_tokens=rng.randint(1, 9), cost_micros=rng.randint(0, 10**6), status="ok",
                               finish_reason="stop", ttft_s=0.01, e2e_s=0.02, stream=False, tenant="acme",
                               key_id="k1", tags=tags))
    return out


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    prefix = unique_prefix("tagnames")
    now = time.time()
    recs = _records(now)
    cfg = SpendConfig(spool_dir=tmp_path_factory.mktemp("spool"), max_tag_names=NAMES)

    async def write() -> None:
        ledger = SpendLedger(SHARED_REDIS, prefix, cfg, GatewayMetrics(lambda: {}))
        for i in range(0, N, 100):
            await ledger._store([r.to_dict() for r in recs[i:i + 100]], "stored")
        await ledger.redis.aclose()
    _run(write())
    try:
        yield prefix, recs, int(now) // 3600
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def _report(prefix: str, hour: int, group_by: list[str]):
    import redis.asyncio as aioredis

    async def go():
        client = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            return await read_report(client, prefix, ["acme"], hour, hour + 1, group_by)
        finally:
            await client.aclose()
    return _run(go())


def test_tag_names_are_bounded_and_the_rest_fold_once(world):
    prefix, recs, hour = world
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        kept = {m.decode() for m in client.smembers(tag_names_key(prefix, "acme", hour))}
        value_sets = [k for k in client.scan_iter(f"{prefix}spend:*:hv:*")]
        fields = client.hlen(f"{prefix}spend:{{acme}}:hd:{hour}")
    finally:
        client.close()
    assert len(kept) == NAMES and "tag:team" in kept          # "team" comes early: it keeps its dimension
    assert len(value_sets) <= 2 + NAMES                       # key, route (no user here) + the kept tag names
    # Fields: (key + route + kept tags' values + one folded value) x engines x 7 counters, bounded.
    assert fields <= (2 + NAMES * 2 + 1) * 2 * 7
    # tag:(other) counts each record with a folded tag once.
    data, total, _, _ = _report(prefix, hour, ["tag:(other)"])
    by = {r["tag:(other)"]: r for r in data}
    names = {n[4:] for n in kept}
    folded = [r for r in recs if any(t not in names for t in r.tags)]
    assert by["(other)"]["requests"] == len(folded)
    assert by["(other)"]["cost_micros"] == sum(r.cost_micros for r in folded)
    assert sum(r["cost_micros"] for r in data) == total["cost_micros"] == sum(r.cost_micros for r in recs)
    # A kept name is exact per value; every grouping still adds up.
    data, total, _, _ = _report(prefix, hour, ["tag:team", "model"])
    assert sum(r["requests"] for r in data) == N
    team = {}
    for r in recs:
        v = r.tags.get("team", reports.NONE)
        team[v] = team.get(v, 0) + r.cost_micros
    got = {}
    for r in data:
        got[r["tag:team"]] = got.get(r["tag:team"], 0) + r["cost_micros"]
    assert got == team


def test_max_tag_names_is_a_checked_deployment_key():
    base = {"engines": {"mock": {"type": "mock", "model": "models/demo-small"}}}
    from gateway_helpers import ROOT
    dep = parse_deployment({**base, "spend": {"max_tag_names": 5}}, base_dir=ROOT)
    assert dep.web.spend.max_tag_names == 5
    assert SpendConfig().max_tag_names == 64
    with pytest.raises(DeploymentError, match="max_tag_names"):
        parse_deployment({**base, "spend": {"max_tag_names": 0}}, base_dir=ROOT)


def test_request_stream_keeps_only_the_kept_tag_names(world):
    """The per-request log held every tag as sent (+5.7 MB per 10,000 hostile records, past the
    5 MB goal with the rollups bounded). Its entries now keep the tags whose name the rollups keep,
    with their values, and the count of the rest; listing records reads them back the same."""
    import redis.asyncio as aioredis

    from tokenyard.gateway.spend.store import records
    prefix, recs, hour = world
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        kept = {m.decode()[4:] for m in client.smembers(tag_names_key(prefix, "acme", hour))}
        entries = client.xrange(f"{prefix}spend:{{acme}}:stream")
    finally:
        client.close()
    assert len(entries) == N
    for _, fields in entries:
        assert b"tags" not in fields[b"r"]            # no tag travels inside the record itself

    async def go():
        c = aioredis.Redis.from_url(SHARED_REDIS)
        try:
            return await records(c, prefix, ["acme"], limit=N + 1)
        finally:
            await c.aclose()
    got, _ = _run(go())
    by_id = {r["request_id"]: r for r in got}
    assert len(by_id) == N
    for r in recs:
        want = {k: v for k, v in r.tags.items() if k in kept}
        folded = sum(1 for k in r.tags if k not in kept)
        assert (by_id[r.request_id].get("tags") or {}) == want, r.request_id
        assert by_id[r.request_id].get("tags_folded", 0) == folded, r.request_id
    assert any(r.get("tags_folded") for r in got) and any(r.get("tags") for r in got)


def test_stream_entries_leave_out_default_fields_and_read_back_whole(world):
    """Each stream entry leaves out the fields at their default (half its size); reading it back
    restores them, so a record read from the stream equals the record written, tags aside."""
    from tokenyard.gateway.spend.store import stream_record
    from tokenyard.gateway.spend.usage import UsageRecord
    prefix, recs, _ = world
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        entries = client.xrange(f"{prefix}spend:{{acme}}:stream")
    finally:
        client.close()
    by_id = {r.request_id: r for r in recs}
    for _, fields in entries:
        raw = fields[b"r"].decode()
        assert '"batch"' not in raw and '"router_score"' not in raw and '"prices"' not in raw
        got = stream_record(fields)
        want = by_id[got["request_id"]].to_dict()
        assert [k for k in got if k != "tags_folded"] == list(want)   # every field, in the dataclass's order
        assert {k: v for k, v in got.items() if k not in ("tags", "tags_folded")} == \
            {k: v for k, v in want.items() if k != "tags"}
        assert UsageRecord.from_dict(got).request_id == got["request_id"]
