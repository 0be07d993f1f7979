"""The webhook sender: budget alerts from the Redis outbox to spend.alerts.webhook_url.

    sender = AlertSender(redis, prefix, cfg, secret, metrics)
    await sender.start(); ...; await sender.stop()

The request: POST, body = the alert's JSON exactly as stored (UTF-8), headers
    Content-Type: application/json
    X-Tokenyard-Alert-Id: al_...                       (also the body's "id": dedupe on it)
    X-Tokenyard-Timestamp: 1764633600                  (unix seconds when this attempt was signed)
    X-Tokenyard-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>
Verify with `verify_signature` (or the same three lines anywhere): recompute the HMAC over the
timestamp, a dot and the raw body, compare in constant time, and refuse old timestamps (replays).

Delivery is at least once, through the outbox that the alert script fills (tokenyard/gateway/spend/alerts.py):
each pass claims the due items with a lease (lua/alert_claim.lua: their due time moves to now +
lease_s, so another gateway, or this one restarted, does not take them meanwhile), POSTs them, and
removes an item only after a 2xx. Redirects are never followed (the signed body must not travel to
wherever a Location header points): a 3xx is a failed attempt, logged with its Location, and
retried like any error status. Anything else (an error status, a timeout, no connection) puts
it back due after backoff_s x 2^(attempt-1) with jitter, at most max_backoff_s; after
max_attempts it moves to the dead-letter list ({A}:dead) and tokenyard_alert_webhooks_total
{outcome="gave_up"} counts it. A gateway stopping waits for the POSTs in flight (up to
timeout_s) and settles them. So a restart loses no alert, and an alert is sent twice only when a
2xx was received but its removal never reached Redis (the process died, or Redis failed, in that
instant): then the item is sent again after its lease, with the same id for the receiver to drop.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
from pathlib import Path
from typing import Any

from tokenyard.gateway.config.spend_settings import AlertsConfig
from tokenyard.gateway.spend.alerts import dead_key, due_key, outbox_key, tries_key

log = logging.getLogger("tokenyard.alerts")
_CLAIM = Path(__file__).resolve().parent / "lua" / "alert_claim.lua"
BATCH = 32               # items claimed per pass
POLL_S = 0.5             # how often the outbox is looked at when nothing was due
DEAD_KEPT = 1000
SIGNATURE = "X-Tokenyard-Signature"
TIMESTAMP = "X-Tokenyard-Timestamp"
ALERT_ID = "X-Tokenyard-Alert-Id"


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def verify_signature(secret: bytes, body: bytes, timestamp: str, signature: str, tolerance_s: float = 300,
                     now: float | None = None) -> bool:
    """For receivers: the signature matches and the timestamp is within tolerance_s of now."""
    try:
        ts = int(timestamp)
    except (TypeError, ValueError):
        return False
    now = time.time() if now is None else now
    if abs(now - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature or "")


class AlertSender:
    def __init__(self, redis: Any, prefix: str, cfg: AlertsConfig, secret: bytes, metrics: Any) -> None:
        if not cfg.webhook_url:
            raise ValueError("no spend.alerts.webhook_url")
        if not secret:
            raise ValueError(f"spend.alerts.webhook_url is set but the environment variable {cfg.secret_env} "
                             f"holding its signing secret is empty")
        self.redis = redis
        self.prefix = prefix
        self.cfg = cfg
        self.secret = secret
        self.metrics = metrics
        self._claim = redis.register_script(_CLAIM.read_text())
        self._session: Any = None
        self._task: asyncio.Task | None = None
        self._stopping: asyncio.Event | None = None
        self._unsettled: list[tuple[str, str, int]] = []   # (id, body, attempt) whose outcome Redis has not got
        self._failing = False

    def _open(self) -> Any:
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def start(self) -> None:
        self._open()
        self._stopping = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Let the POSTs in flight finish (and be settled), then stop."""
        if self._task is None:
            return
        assert self._stopping is not None
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.cfg.timeout_s + 2)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        except Exception:  # noqa: BLE001 - the loop's own failure was logged there
            pass
        self._task = None
        await self.close()

    async def _run(self) -> None:
        assert self._stopping is not None
        while not self._stopping.is_set():
            sent = 0
            try:
                sent = await self.send_due()
                if self._failing:
                    log.info("alert webhook: outbox reachable again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis down: try again next pass
                if not self._failing:
                    log.warning("alert webhook: outbox unavailable (%s: %s)", type(e).__name__, e)
                self._failing = True
            if not sent:
                try:
                    await asyncio.wait_for(self._stopping.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass

    async def send_due(self, now: float | None = None) -> int:
        """One pass: settle what an earlier pass could not, claim what is due, POST it, settle it."""
        await self._settle_unsettled()
        now = time.time() if now is None else now
        raw = await self._claim(keys=[due_key(self.prefix), outbox_key(self.prefix), tries_key(self.prefix)],
                                args=[int(now * 1000), int((now + self.cfg.lease_s) * 1000), BATCH])
        items = [(_s(raw[i]), _s(raw[i + 1]), int(raw[i + 2])) for i in range(0, len(raw), 3)]
        if not items:
            return 0
        outcomes = await asyncio.gather(*(self._post(i, body) for i, body, _ in items))
        self._unsettled += [(i, body, attempt if ok else -attempt) for (i, body, attempt), ok in zip(items, outcomes)]
        await self._settle_unsettled()
        return len(items)

    async def _post(self, alert_id: str, body: str) -> bool:
        data = body.encode("utf-8", "surrogatepass")
        ts = int(time.time())
        headers = {"Content-Type": "application/json", ALERT_ID: alert_id, TIMESTAMP: str(ts),
                   SIGNATURE: sign(self.secret, ts, data)}
        try:
            # Never follow a redirect: it would re-post the signed body to wherever the Location points
            # (another host included). A 3xx is a failed delivery like any other non-2xx.
            async with self._open().post(self.cfg.webhook_url, data=data, headers=headers,
                                         allow_redirects=False) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return True
                if 300 <= resp.status < 400:
                    log.warning("alert webhook: %s answered %d (a redirect to %r) for %s; redirects are not "
                                "followed: set spend.alerts.webhook_url to the final URL", self.cfg.webhook_url,
                                resp.status, resp.headers.get("Location", ""), alert_id)
                else:
                    log.warning("alert webhook: %s answered %d for %s", self.cfg.webhook_url, resp.status, alert_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - connection refused, timeout, bad URL: retry later
            log.warning("alert webhook: POST %s for %s failed (%s: %s)", self.cfg.webhook_url, alert_id,
                        type(e).__name__, e)
        return False

    async def _settle_unsettled(self) -> None:
        while self._unsettled:
            alert_id, body, attempt = self._unsettled[0]
            await self._settle(alert_id, body, attempt)
            self._unsettled.pop(0)

    async def _settle(self, alert_id: str, body: str, attempt: int) -> None:
        """attempt > 0: delivered; < 0: attempt -attempt failed."""
        p = self.prefix
        pipe = self.redis.pipeline(transaction=True)
        if attempt > 0 or -attempt >= self.cfg.max_attempts:
            pipe.hdel(outbox_key(p), alert_id)
            pipe.zrem(due_key(p), alert_id)
            pipe.hdel(tries_key(p), alert_id)
            if attempt < 0:
                pipe.lpush(dead_key(p), body)
                pipe.ltrim(dead_key(p), 0, DEAD_KEPT - 1)
            outcome = "sent" if attempt > 0 else "gave_up"
        else:
            n = -attempt
            delay = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2 ** (n - 1)) * (0.5 + random.random() / 2)
            pipe.zadd(due_key(p), {alert_id: int((time.time() + delay) * 1000)}, xx=True)
            outcome = "failed"
        await pipe.execute()
        self.metrics.alert_webhooks.labels(outcome).inc()
        if outcome == "gave_up":
            log.error("alert webhook: gave up on %s after %d attempts (kept on %s)", alert_id, -attempt, dead_key(p))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
