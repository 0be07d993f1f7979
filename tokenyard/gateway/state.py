"""The gateway's shared state, built once: engines, router, policy, keys, limits, admission, spend, Redis.

Every endpoint reads it from `request.app.state.gateway` (see `gateway_of`) and imports this module,
never the app: the app (app.py) imports the endpoints, so an endpoint importing the app would tie
every route module into one import circle.

Built once: each part is constructed in `Gateway.__init__` with its final collaborators. Two things
are only known later and are attached rather than rebuilt: the engines (loaded at start-up in a
worker thread unless a test hands them in) join the admission queues through `attach_engines`, and
Redis connections open lazily on first use. Without a Redis URL (tests that set none), keys come
only from the dev key and limits are off.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from starlette.requests import Request

from tokenyard.gateway.admission.engine_queues import Admission
from tokenyard.gateway.admission.gatekeeper import Gatekeeper
from tokenyard.gateway.admission.rate_limiter import RateLimiter
from tokenyard.gateway.auth.api_keys import DEV_TENANT, KeyStore, new_record
from tokenyard.gateway.auth.key_cache import KeyCache
from tokenyard.gateway.auth.sessions import SessionStore
from tokenyard.gateway.backends.adapter_control import adapters_of
from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.backends.replica_metrics import ReplicaCollector
from tokenyard.gateway.config.deployment import Deployment
from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.policy.state import PolicyState
from tokenyard.gateway.routing.interim_rule import Router
from tokenyard.gateway.routing.learned_router import ArtifactError, LearnedRouter, RouterSettings
from tokenyard.gateway.routing.traffic_learning import TrafficLearning
from tokenyard.gateway.spend.alert_runner import BudgetAlerts
from tokenyard.gateway.spend.budget import BudgetReader
from tokenyard.gateway.spend.ledger import SpendLedger
from tokenyard.gateway.spend.usage import FanOut, RecentUsage, UsageRecord, UsageSink
from tokenyard.gateway.store.redis_guard import RedisGuard

log = logging.getLogger("tokenyard.gateway")
POOL_RESERVE = 8   # Redis connections beyond redis_pool_size, for callers outside the guard


def gateway_of(request: Request) -> "Gateway":
    """The state of the app serving `request`."""
    return request.app.state.gateway


class Gateway:
    """Everything the endpoints share: engines, router, metrics, keys, limits, admission, drain state, Redis."""

    def __init__(self, deployment: Deployment, handles: dict[str, EngineHandle] | None,
                 usage_sink: UsageSink | None, dev_key: str | None) -> None:
        self.deployment = deployment
        self.handles: dict[str, EngineHandle] = handles or {}
        # Engines of the bulk pool run Batch API lines only: "auto" never picks them.
        bulk = deployment.batch.bulk_engines
        # LoRA adapters (an engine's lora_modules) are models of their own: ENGINE:ADAPTER.
        adapters = {n: sorted(spec.options.get("lora_modules") or {}) for n, spec in deployment.engines.items()}
        self.router = Router([n for n in deployment.engines if n not in bulk] or list(self.handles), deployment.routing,
                             adapters)
        # ENGINE:ADAPTER names also come from what each engine reports (run-time loads, other gateways')
        self.router.live = lambda e: adapters_of(self.handles[e].engine) if e in self.handles else []
        self.metrics = GatewayMetrics(lambda: {n: h.engine for n, h in self.handles.items()})
        self.metrics.slo_ttft_s = deployment.web.metrics.slo_ttft_s
        self.metrics.slo_itl_s = deployment.web.metrics.slo_itl_s
        self.metrics.registry.register(ReplicaCollector(lambda: self.handles))   # replica pools' own stats
        self.usage = RecentUsage()
        # Every record goes to memory (access log, tests), to a caller's sink if given, and to the
        # spend ledger when Redis is configured.
        self.ledger: SpendLedger | None = None
        self.usage_sink: UsageSink = FanOut(self.usage, usage_sink, self._to_ledger, self.metrics.count_spend)
        self.baseline_engine = deployment.baseline_engine
        spec = deployment.engines.get(self.baseline_engine)
        self.baseline_prices = spec.prices if spec is not None else None
        self.dev_key = dev_key
        self.draining = False
        self.ready = False
        self.in_progress = 0                # HTTP requests being handled (drain waits for 0)
        self.redis_ok: bool | None = None   # None: not checked yet, or no Redis configured
        self.redis, self._pubsub_redis = _redis_clients(deployment)    # both None without a Redis URL
        prefix = deployment.redis_prefix
        if self.redis is not None and deployment.web.spend.enabled:
            self.ledger = SpendLedger(deployment.redis_url, prefix, deployment.web.spend, self.metrics)
        self.sessions = SessionStore(self.redis, prefix, deployment.web.dashboard.session_ttl_s)
        self.guard = RedisGuard(self.metrics, deployment.rate_limits.redis_retry_s, deployment.redis_pool_size,
                                deployment.redis_pool_wait_ms / 1000)
        auth = deployment.auth
        self.keys = KeyCache(self.redis, prefix, auth.key_cache_ttl_s, self.guard, self.metrics,
                             auth.negative_cache_ttl_s, auth.max_concurrent_lookups)
        self.limiter = RateLimiter(self.redis, prefix, deployment.rate_limits, self.guard, self.metrics)
        self.admission = Admission(deployment.admission, self.metrics, {})
        self.metrics.admission = self.admission.snapshot
        self.admission.scaling = replace(deployment.autoscaling, slo_ttft_s=deployment.web.metrics.slo_ttft_s)
        self.metrics.desired_replicas = self.admission.desired_replicas
        self.gatekeeper = Gatekeeper(self.limiter, self.admission)
        # The learned router behind model "auto" (None: the interim rule of routing.py).
        self.learned_router = load_learned_router(deployment)
        # The routing policy in force (kept equal to Redis's current version) and tenant budgets.
        self.policy = PolicyState(deployment, self.metrics, self.learned_router)
        self.admission.weight_of = self.policy.weight_of
        # Routing samples for feedback and the shadow candidate's counts (docs/router.md).
        self.learning = TrafficLearning(deployment.router_learning, self.redis, prefix, self.metrics)
        self.budgets = BudgetReader(self.redis, prefix, self.guard, self.metrics)
        # Budget alerts (50/80/100 %) from the ledger, and their webhook: tokenyard/gateway/spend/alerts.py.
        self.alerts: BudgetAlerts | None = None
        if self.ledger is not None:
            try:
                self.alerts = BudgetAlerts.build(deployment, self.metrics,
                                                 lambda: (self.policy.policy, self.policy.number))
            except ValueError as e:
                raise StartupError(str(e)) from e
        # The Batch API (tokenyard/gateway/batch/service.py: /v1/files, /v1/batches and the runner), attached by
        # create_app when Redis is configured: its runner drives the request flow, which imports this module.
        self.batch: Any = None
        self._tasks: list[asyncio.Task] = []
        if dev_key:
            self.keys.preload(new_record(dev_key, DEV_TENANT, name="dev", role="admin"))

    def _to_ledger(self, record: UsageRecord) -> None:
        if self.ledger is not None:
            self.ledger(record)

    def attach_engines(self, handles: dict[str, EngineHandle]) -> None:
        """The engines loaded at start-up join the gateway (and their admission queues)."""
        self.handles.update(handles)
        self.admission.add_engines({n: h.engine for n, h in handles.items()})

    async def start_redis(self) -> None:
        dep = self.deployment
        if self.ledger is not None:
            await self.ledger.start()      # replays what an earlier run left in the spool
        await self.policy.start_redis(self.redis, self._pubsub_redis)
        self.learning.start()
        if self.alerts is not None:
            await self.alerts.start()
        if self.dev_key:
            try:   # the configured dev key becomes an admin key record (a revoked one stays revoked)
                await asyncio.to_thread(_ensure_dev_key, dep.redis_url, dep.redis_prefix, self.dev_key)
            except Exception as e:  # noqa: BLE001 - Redis down at start: the preloaded record serves
                log.warning("could not store the development key's record in redis: %s", e)
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._watch_redis()), loop.create_task(self.keys.listen(self._pubsub_redis))]

    async def stop_redis(self) -> None:
        await self.policy.stop()
        await self.learning.stop()
        if self.alerts is not None:
            await self.alerts.stop()       # POSTs in flight finish and are settled first
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.limiter.drain()
        if self.ledger is not None:
            await self.ledger.stop()       # what is still queued goes to Redis, else to the spool
        for client in (self.redis, self._pubsub_redis):
            if client is not None:
                await client.aclose()

    def start_drain(self) -> None:
        if not self.draining:
            log.info("draining: /ready is false, new chat requests get 503")
            self.draining = True

    async def _watch_redis(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.redis.ping(), 2.0)
                self.redis_ok = True
            except Exception:  # noqa: BLE001 - any failure means "not reachable"
                if self.redis_ok is not False:
                    log.warning("redis at %s is not reachable", self.deployment.redis_url)
                self.redis_ok = False
            await asyncio.sleep(5.0)


class StartupError(RuntimeError):
    """The gateway cannot start as configured (e.g. a bad router artifact); the message says why."""


def load_learned_router(deployment: Deployment) -> LearnedRouter | None:
    settings = deployment.router or RouterSettings()
    routing = deployment.routing
    try:
        return LearnedRouter.from_settings(settings, routing.small, routing.large)
    except (ArtifactError, ValueError, OSError) as e:
        raise StartupError(f"router.artifact {settings.artifact}: {e}") from e


def _ensure_dev_key(url: str, prefix: str, dev_key: str) -> None:
    import redis
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        KeyStore(client, prefix).ensure_dev_key(dev_key)
    finally:
        client.close()


def _redis_clients(dep: Deployment) -> tuple[Any, Any]:
    """The request path's client and the pub/sub client; connections open on first use."""
    if not dep.redis_url:
        return None, None
    import redis.asyncio as aioredis
    timeout = dep.redis_timeout_ms / 1000
    # A blocking pool with a bounded wait: a burst of calls queues for a connection instead of
    # failing with "too many connections". The guard admits at most redis_pool_size calls; the
    # extra connections serve what does not go through it (sessions, policy reads, the health ping).
    pool = aioredis.BlockingConnectionPool.from_url(
        dep.redis_url, max_connections=dep.redis_pool_size + POOL_RESERVE, timeout=dep.redis_pool_wait_ms / 1000,
        socket_connect_timeout=timeout, socket_timeout=timeout)
    # The subscription sits idle between events: no read timeout on its connection.
    return (aioredis.Redis.from_pool(pool),
            aioredis.Redis.from_url(dep.redis_url, socket_connect_timeout=2, socket_timeout=None))
