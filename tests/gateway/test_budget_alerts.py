"""Budget alerts: records written through the ledger's real Lua script into the shared Redis (unique
prefix) while several watchers check at once -> every (budget, period, threshold) fires exactly
once; a watcher started afresh (a restart) fires nothing again; the webhook sender signs (verified
here with hmac by hand), retries after a failure, delivers an item left by a stopped sender once
from a new one, and never lets two senders POST the same item at once (the lease)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections import Counter

import pytest
from aiohttp import web
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix

from tokenyard.gateway.config.spend_settings import AlertsConfig, SpendConfig
from tokenyard.gateway.spend.alert_webhook import AlertSender, verify_signature
from tokenyard.gateway.spend.alerts import AlertWatcher, alerts_stream, dead_key, due_key, outbox_key, read_alerts
from tokenyard.gateway.spend.ledger import SpendLedger
from tokenyard.gateway.spend.usage import UsageRecord
from tokenyard.policies import load_policy

POLICY = load_policy("""\
version: 1
engines: {small: small, large: large}
prices:
  small: {input: 1, cached_input: 1, output: 1}
  large: {input: 1, cached_input: 1, output: 1}
tenants:
  acme:
    budget: {per_day: "0.001", at_limit: downgrade}
    key_budgets:
      "*": {per_day: "0.0005"}
    tag_budgets:
      team: {search: {per_month: "0.002", at_limit: downgrade}}
""")
SECRET = b"test-secret-\x00\xff"


class Metrics:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def __getattr__(self, name):
        metrics = self

        class _C:
            def labels(self, *labels):
                self.key = (name, ",".join(labels))
                return self

            def inc(self, n=1):
                metrics.counts[getattr(self, "key", (name, ""))] += n
        return _C()


def record(i: int, key: str = "k1", tags: dict | None = None, cost: int = 50) -> UsageRecord:
    return UsageRecord(request_id=f"r{i}-{key}", time=time.time(), engine="large", requested_model="large",
                       route_reason="pinned", prompt_tokens=10, cached_tokens=0, completion_tokens=5,
                       cost_micros=cost, status="ok", finish_reason="stop", ttft_s=0.1, e2e_s=0.2, stream=False,
                       tenant="acme", key_id=key, key_name="bot", tags=tags or {})


@pytest.fixture()
def world(tmp_path):
    prefix = unique_prefix("alerts")
    ledger = SpendLedger(SHARED_REDIS, prefix, SpendConfig(spool_dir=tmp_path / "spool"), Metrics())
    yield prefix, ledger
    delete_prefix(SHARED_REDIS, prefix)


def watcher(prefix: str, metrics: Metrics, **cfg) -> AlertWatcher:
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(SHARED_REDIS)
    return AlertWatcher(client, prefix, AlertsConfig(**cfg), metrics, lambda: (POLICY, 3))


def test_each_threshold_fires_exactly_once_with_concurrent_writes_and_watchers(world):
    prefix, ledger = world

    async def go():
        metrics = Metrics()
        watchers = [watcher(prefix, metrics) for _ in range(3)]
        records = [record(i, tags={"team": "search"}) for i in range(40)]     # 40 x 50 = 2000 micro-units

        async def write():
            for i in range(0, 40, 4):
                await asyncio.gather(*(ledger._store([r.to_dict()], "stored") for r in records[i:i + 4]))
                await asyncio.sleep(0)

        async def check_loop(w):
            for _ in range(12):
                await w.check()
                await asyncio.sleep(0.005)

        await asyncio.gather(write(), *(check_loop(w) for w in watchers))
        await asyncio.gather(*(w.check() for w in watchers))              # everything written is seen
        alerts = await read_alerts(watchers[0].redis, prefix, time.time() - 3600)
        # A restarted gateway: a new watcher, the cursor and markers from Redis -> nothing new.
        again = watcher(prefix, metrics)
        assert await again.check() == 0
        # A record replayed twice (the ledger's idempotency) or one more record: still nothing new.
        await ledger._store([records[0].to_dict(), record(99, key="k2", cost=1).to_dict()], "stored")
        assert await again.check() == 0
        outbox = await again.redis.hlen(outbox_key(prefix))
        for w in (*watchers, again):
            await w.redis.aclose()
        await ledger.redis.aclose()
        return alerts, metrics, outbox

    alerts, metrics, outbox = asyncio.run(go())
    fired = Counter((a["budget"], a["period"], a["threshold_pct"]) for a in alerts)
    expected = {(b, p, t) for b, p in (("tenant", "day"), ("key k1", "day"), ("tag team=search", "month"))
                for t in (50, 80, 100)}
    assert set(fired) == expected and all(n == 1 for n in fired.values()), fired
    assert len({a["id"] for a in alerts}) == 9
    for a in alerts:
        assert a["spent_micros"] * 100 >= a["threshold_pct"] * a["limit_micros"]
        assert a["tenant"] == "acme" and a["policy_version"] == 3
    key_alert = next(a for a in alerts if a["scope"] == "key")
    assert (key_alert["value"], key_alert["entry"], key_alert["limit_micros"]) == ("k1", "*", 500)
    assert sum(n for (name, _), n in metrics.counts.items() if name == "budget_alerts") == 9
    assert outbox == 0                                   # no webhook configured: the stream only


async def _receiver(mode: dict):
    """An aiohttp webhook receiver that checks the signature itself; mode["status"] says what to answer."""
    got: list[dict] = []

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        ts, sig = request.headers["X-Tokenyard-Timestamp"], request.headers["X-Tokenyard-Signature"]
        expected = "sha256=" + hmac.new(SECRET, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
        ok = hmac.compare_digest(expected, sig) and abs(time.time() - int(ts)) < 60
        assert ok == verify_signature(SECRET, body, ts, sig)
        assert not verify_signature(SECRET, body + b" ", ts, sig)           # a changed body fails
        assert not verify_signature(b"other", body, ts, sig)
        await asyncio.sleep(mode.get("delay", 0))
        alert = json.loads(body)
        got.append({"id": alert["id"], "header_id": request.headers["X-Tokenyard-Alert-Id"], "signed": ok,
                    "status": mode["status"]})
        return web.Response(status=mode["status"] if ok else 401)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/hook", got


def test_webhook_signed_retried_and_delivered_once_after_a_restart(world):
    prefix, ledger = world

    async def go():
        mode = {"status": 500}
        runner, url, got = await _receiver(mode)
        metrics = Metrics()
        cfg = {"webhook_url": url, "backoff_s": 0.05, "max_backoff_s": 0.1, "timeout_s": 2, "lease_s": 5}
        w = watcher(prefix, metrics, **cfg)
        await ledger._store([record(i).to_dict() for i in range(8)], "stored")     # 400 micro-units
        assert await w.check() == 2                       # key k1: 400 of 500 is 50 % and 80 %; the tenant's 40 %: none
        ids = {a["id"] for a in await read_alerts(w.redis, prefix, time.time() - 60)}
        first = AlertSender(w.redis, prefix, AlertsConfig(**cfg), SECRET, metrics)
        await first.start()
        await asyncio.sleep(0.6)                          # tries, fails (500), backs off, tries again ...
        await first.stop()                                # the "gateway" stops with both still in the outbox
        failed = len(got)
        assert failed >= 2 and all(g["signed"] and g["status"] == 500 for g in got)
        assert await w.redis.hlen(outbox_key(prefix)) == 2
        mode["status"] = 204
        second = AlertSender(w.redis, prefix, AlertsConfig(**cfg), SECRET, metrics)    # after the restart
        deadline = time.monotonic() + 5
        while await w.redis.hlen(outbox_key(prefix)) and time.monotonic() < deadline:
            await second.send_due()
            await asyncio.sleep(0.05)
        delivered = [g for g in got if g["status"] == 204]
        assert sorted(g["id"] for g in delivered) == sorted(ids) and all(g["header_id"] == g["id"] for g in delivered)
        assert await w.redis.zcard(due_key(prefix)) == 0
        for _ in range(3):                                # nothing left to send twice
            assert await second.send_due() == 0
        # Two senders at once on one due item (two gateways): the lease gives it to one of them.
        mode.update(delay=0.3)
        await ledger._store([record(i, key="k9", cost=100).to_dict() for i in range(3)], "stored")
        assert await w.check() >= 2
        before = len(got)
        third = AlertSender(w.redis, prefix, AlertsConfig(**cfg), SECRET, metrics)
        await asyncio.gather(second.send_due(), third.send_due())
        new = [g["id"] for g in got[before:]]
        assert len(new) == len(set(new)) >= 2
        await second.close()
        await third.close()
        await w.redis.aclose()
        await ledger.redis.aclose()
        await runner.cleanup()
        return metrics

    metrics = asyncio.run(go())
    assert metrics.counts["alert_webhooks", "sent"] >= 4 and metrics.counts["alert_webhooks", "failed"] >= 2


def test_webhook_gives_up_after_max_attempts_into_the_dead_letters(world):
    prefix, ledger = world

    async def go():
        runner, url, got = await _receiver({"status": 400})
        metrics = Metrics()
        cfg = AlertsConfig(webhook_url=url, backoff_s=0.01, max_backoff_s=0.01, max_attempts=3, timeout_s=2, lease_s=5)
        w = watcher(prefix, metrics, **{k: getattr(cfg, k) for k in ("webhook_url",)})
        await ledger._store([record(i, cost=250).to_dict() for i in range(1)], "stored")
        assert await w.check() == 1                       # the key's 50 %
        sender = AlertSender(w.redis, prefix, cfg, SECRET, metrics)
        for _ in range(20):
            await sender.send_due()
            await asyncio.sleep(0.02)
        dead = await w.redis.lrange(dead_key(prefix), 0, -1)
        pending = await w.redis.hlen(outbox_key(prefix))
        stream = await w.redis.xlen(alerts_stream(prefix))
        await sender.close()
        await w.redis.aclose()
        await ledger.redis.aclose()
        await runner.cleanup()
        return got, dead, pending, stream, metrics

    got, dead, pending, stream, metrics = asyncio.run(go())
    assert len(got) == 3 and pending == 0 and len(dead) == 1 and stream == 1
    assert json.loads(dead[0])["threshold_pct"] == 50
    assert metrics.counts["alert_webhooks", "gave_up"] == 1 and metrics.counts["alert_webhooks", "failed"] == 2


def test_a_webhook_without_a_secret_is_refused():
    with pytest.raises(ValueError, match="TOKENYARD_ALERT_SECRET"):
        AlertSender(object(), "p:", AlertsConfig(webhook_url="http://127.0.0.1:9/hook"), b"", Metrics())


def test_webhook_never_follows_a_redirect(world):
    """A 307 from the webhook URL must not re-post the signed body to its Location (another server):
    the attempt counts as failed and the alert stays in the outbox for the retry policy."""
    prefix, ledger = world

    async def go():
        elsewhere: list[bytes] = []

        async def catch_all(request: web.Request) -> web.Response:
            elsewhere.append(await request.read())
            return web.Response(status=204)

        async def redirect(request: web.Request) -> web.Response:
            hits.append(await request.read())
            return web.Response(status=307, headers={"Location": other_url})

        hits: list[bytes] = []
        servers = []
        urls = []
        for handler in (catch_all, redirect):
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            servers.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook")
        other_url, hook_url = urls
        metrics = Metrics()
        cfg = AlertsConfig(webhook_url=hook_url, backoff_s=0.01, max_backoff_s=0.01, max_attempts=5, timeout_s=2,
                           lease_s=5)
        w = watcher(prefix, metrics, webhook_url=hook_url)
        await ledger._store([record(0, cost=250).to_dict()], "stored")
        assert await w.check() == 1
        sender = AlertSender(w.redis, prefix, cfg, SECRET, metrics)
        for _ in range(3):
            await sender.send_due()
            await asyncio.sleep(0.03)
        pending = await w.redis.hlen(outbox_key(prefix))
        await sender.close()
        await w.redis.aclose()
        await ledger.redis.aclose()
        for runner in servers:
            await runner.cleanup()
        return hits, elsewhere, pending, metrics

    hits, elsewhere, pending, metrics = asyncio.run(go())
    assert elsewhere == []                                  # the redirect target received nothing
    assert len(hits) >= 2 and pending == 1                  # failed, retried, still in the outbox
    assert metrics.counts["alert_webhooks", "failed"] == len(hits) and metrics.counts["alert_webhooks", "sent"] == 0
