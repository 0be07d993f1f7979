"""The gateway's budget-alert tasks: the watcher (alerts.py) every spend.alerts.interval_s and, with
spend.alerts.webhook_url, the webhook sender (alert_webhook.py), on a Redis client of their own
(off the request path, like the ledger's). Built by Gateway when the spend ledger is on.

The signing secret is read from the environment variable spend.alerts.secret_env when the gateway
is built; a webhook without a secret stops the start (ValueError, a StartupError in tokenyard/gateway/state.py):
alerts are never sent unsigned.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

from tokenyard.gateway.spend.alert_webhook import AlertSender
from tokenyard.gateway.spend.alerts import AlertWatcher
from tokenyard.policies.schema import Policy


class BudgetAlerts:
    def __init__(self, redis_url: str, prefix: str, cfg: Any, metrics: Any,
                 policy: Callable[[], tuple[Policy | None, int]], secret: bytes = b"") -> None:
        import redis.asyncio as aioredis
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2.0, socket_timeout=5.0)
        self.watcher = AlertWatcher(self.redis, prefix, cfg, metrics, policy)
        self.sender = AlertSender(self.redis, prefix, cfg, secret, metrics) if cfg.webhook_url else None
        self._task: asyncio.Task | None = None

    @classmethod
    def build(cls, deployment: Any, metrics: Any, policy: Callable[[], tuple[Policy | None, int]]) -> "BudgetAlerts | None":
        cfg = deployment.web.spend.alerts
        if not cfg.enabled or not deployment.redis_url:
            return None
        secret = os.environ.get(cfg.secret_env, "").encode()
        return cls(deployment.redis_url, deployment.redis_prefix, cfg, metrics, policy, secret)   # ValueError: no secret

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.watcher.run())
        if self.sender is not None:
            await self.sender.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.sender is not None:
            await self.sender.stop()
        await self.redis.aclose()
