"""Redis unreachable mid-run and back: records wait in the local spool and are replayed, idempotently,
so the ledger still equals the sum of the usage the clients saw.

Uses a PRIVATE redis-server (its own port, append-only file in a tmp folder) that the test stops
and restarts; the shared Redis on 6379 is never touched."""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import aiohttp
import redis
from gateway_helpers import PrivateRedis, mock_deployment, running_gateway, wait_ledger

from tests.gateway.test_spend_ledger import read_records, read_rollups, sum_records
from tokenyard.gateway.auth.api_keys import KeyStore

PREFIX = "outage:"


async def _stream(session: aiohttp.ClientSession, url: str, key: str, rid: str) -> dict:
    body = {"model": "mock", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 40,
            "messages": [{"role": "user", "content": f"outage test {rid}"}]}
    usage = None
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}", "x-request-id": rid}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage": {' in line:
                usage = json.loads(line[6:])["usage"]
    return {"rid": rid, "usage": usage}


async def _batch(base: str, keys: list[str], tag: str, n: int, during=None) -> list[dict]:
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        tasks = [asyncio.create_task(_stream(session, url, keys[i % len(keys)], f"{tag}-{i}")) for i in range(n)]
        if during is not None:
            await asyncio.sleep(0.1)           # requests are mid-stream now
            await asyncio.to_thread(during)
        return await asyncio.gather(*tasks)


def _run_in_gateway(srv, coro_fn):
    loop = srv.gateway.ledger._tasks[0].get_loop()
    return asyncio.run_coroutine_threadsafe(coro_fn(), loop).result(30)


def test_redis_outage_spools_and_replays_exactly_once(tmp_path):
    private = PrivateRedis(tmp_path / "redis")
    spool_dir = tmp_path / "spool"
    try:
        client = redis.Redis(port=private.port)
        store = KeyStore(client, PREFIX)
        keys = [store.create("acme")[0], store.create("globex")[0]]
        doc = {**mock_deployment(ttft_ms=5, token_ms=10, output_len=25, max_sleep_ms=5),
               "redis_url": private.url, "redis_prefix": PREFIX, "redis_timeout_ms": 200,
               "rate_limits": {"redis_retry_s": 0.2}, "auth": {"key_cache_ttl_s": 60},
               "spend": {"spool_dir": str(spool_dir), "replay_interval_s": 0.2, "spool_fsync": "always"}}
        with running_gateway(doc) as srv:
            ledger = srv.gateway.ledger
            seen = asyncio.run(_batch(srv.base_url, keys, "before", 8))
            wait_ledger(srv)
            # Redis goes away while 12 streams are running; they end during the outage.
            seen += asyncio.run(_batch(srv.base_url, keys, "during", 12, during=private.stop))
            seen += asyncio.run(_batch(srv.base_url, keys, "down", 6))
            wait_ledger(srv, spool_empty=False)
            assert ledger.redis_down and ledger.spool.pending()
            spooled = [p for p in ledger.spool.dir.glob("*.jsonl")]
            lines = sum(len(p.read_text().splitlines()) for p in spooled)
            assert lines >= 18, f"only {lines} records spooled"
            backup = tmp_path / "spool-copy"
            shutil.copytree(ledger.spool.dir, backup)
            # Redis returns (same data, from its append-only file); the spool is replayed.
            private = private.restart()
            client.close()
            client = redis.Redis(port=private.port)
            wait_ledger(srv, timeout=20)
            assert not list(ledger.spool.dir.glob("*.jsonl"))
            seen += asyncio.run(_batch(srv.base_url, keys, "after", 4))
            wait_ledger(srv)

            def check() -> dict:
                records = read_records(client, PREFIX, ["acme", "globex"])
                by_rid = {r["client_request_id"]: r for r in records}
                assert len(records) == len(by_rid) == len(seen) == 30
                for s in seen:
                    rec, u = by_rid[s["rid"]], s["usage"]
                    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (u["prompt_tokens"],
                                                                                u["completion_tokens"])
                rollups = read_rollups(client, PREFIX, ["acme", "globex"])
                assert rollups == sum_records(records)
                assert sum(v["completion_tokens"] for v in rollups.values()) == \
                    sum(s["usage"]["completion_tokens"] for s in seen)
                return rollups

            rollups = check()
            # Replaying the same spool again (a crash after replay, before the delete) counts nothing twice.
            for p in backup.glob("*.jsonl"):
                shutil.copy(p, ledger.spool.dir / ("replay-0-" + p.name.split("-", 1)[-1]))
            assert ledger.spool.pending()
            sent = _run_in_gateway(srv, ledger.replay)
            assert sent == lines
            assert check() == rollups
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_spend_records_total{outcome="spooled"}' in metrics
            assert 'tokenyard_spend_records_total{outcome="duplicate"}' in metrics
            assert "tokenyard_spend_write_errors_total" in metrics
        client.close()
    finally:
        private.stop()


def test_spool_left_by_a_previous_run_is_replayed_on_start(tmp_path):
    """A gateway that died with records in its spool: the next one replays them when it starts."""
    from tokenyard.gateway.spend.spool import SpendSpool
    from tokenyard.gateway.spend.usage import UsageRecord
    private = PrivateRedis()
    try:
        rec = UsageRecord(request_id="old-1", time=time.time() - 60, engine="mock", requested_model="mock",
                          route_reason="pinned", prompt_tokens=10, cached_tokens=0, completion_tokens=5,
                          cost_micros=7, status="ok", finish_reason="stop", ttft_s=0.01, e2e_s=0.1, stream=False,
                          tenant="acme")
        spool = SpendSpool(tmp_path / "spool", private.url, PREFIX)
        spool.append([rec.to_dict(), rec.to_dict()])    # twice: still one record
        doc = {**mock_deployment(), "redis_url": private.url, "redis_prefix": PREFIX,
               "spend": {"spool_dir": str(tmp_path / "spool"), "replay_interval_s": 0.1}}
        with running_gateway(doc) as srv:
            wait_ledger(srv)
            client = redis.Redis(port=private.port)
            records = read_records(client, PREFIX, ["acme"])
            assert [r["request_id"] for r in records] == ["old-1"]
            assert read_rollups(client, PREFIX, ["acme"])[("acme", "mock")]["cost_micros"] == 7
            client.close()
    finally:
        private.stop()
