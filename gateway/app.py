"""The Starlette app: `create_app(deployment)` builds one gateway over its engines.

State lives in one `Gateway` object (app.state.gateway) rather than in module globals, so a
test can run several apps in one process. Engines load in a worker thread at startup (the
lifespan), so the event loop is not blocked while weights are read.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .access_log import AccessLog
from .admission import Admission
from .api_keys import DEV_TENANT, KeyStore, new_record
from .chat_endpoint import chat_completions
from . import dashboard
from .deployment import Deployment
from .engine_pool import EngineHandle, load_engines
from .errors import APIError, ServerError, error_for_status
from .gatekeeper import Gatekeeper
from .key_cache import KeyCache
from .metrics import GatewayMetrics
from .metrics_access import check_metrics_access
from .openapi import openapi_schema
from .rate_limiter import RateLimiter
from .redis_guard import RedisGuard
from .replica_metrics import ReplicaCollector
from .routing import AUTO, Router
from .sessions import SessionStore
from .spend_ledger import SpendLedger
from .spend_routes import spend_report, spend_requests
from .usage import FanOut, RecentUsage, UsageRecord, UsageSink
from . import policy_page, policy_routes
from .budget import BudgetReader
from .policy_state import PolicyState
from .router_route import ArtifactError, LearnedRouter, RouterSettings

log = logging.getLogger("tokenyard.gateway")
POOL_RESERVE = 8   # Redis connections beyond redis_pool_size, for callers outside the guard


class Gateway:
    """Everything the endpoints share: engines, router, metrics, keys, limits, admission, drain state, Redis."""

    def __init__(self, deployment: Deployment, handles: dict[str, EngineHandle] | None,
                 usage_sink: UsageSink | None, dev_key: str | None) -> None:
        self.deployment = deployment
        self.handles: dict[str, EngineHandle] = handles or {}
        self.router = Router(list(deployment.engines) or list(self.handles), deployment.routing)
        self.metrics = GatewayMetrics(lambda: {n: h.engine for n, h in self.handles.items()})
        self.metrics.registry.register(ReplicaCollector(lambda: self.handles))   # issue 16: replica pools
        self.usage = RecentUsage()
        # Every record goes to memory (access log, tests), to a caller's sink if given, and to the
        # spend ledger once Redis is up (issue 11).
        self.ledger: SpendLedger | None = None
        self.usage_sink: UsageSink = FanOut(self.usage, usage_sink, self._to_ledger)
        self.baseline_engine = deployment.baseline_engine
        spec = deployment.engines.get(self.baseline_engine)
        self.baseline_prices = spec.prices if spec is not None else None
        self.sessions = SessionStore(None, deployment.redis_prefix, deployment.web.dashboard.session_ttl_s)
        self.dev_key = dev_key
        self.draining = False
        self.ready = False
        self.redis: Any = None
        self.redis_ok: bool | None = None   # None: no Redis configured
        self.in_progress = 0                # HTTP requests being handled (drain waits for 0)
        # Built for real in start_redis() / start_admission(); without Redis (tests that set no
        # redis_url) keys come only from the dev key and limits are off.
        self.guard = RedisGuard(self.metrics, deployment.rate_limits.redis_retry_s, deployment.redis_pool_size,
                                deployment.redis_pool_wait_ms / 1000)
        auth = deployment.auth
        self.keys = KeyCache(None, deployment.redis_prefix, auth.key_cache_ttl_s, self.guard, self.metrics,
                             auth.negative_cache_ttl_s, auth.max_concurrent_lookups)
        self.limiter = RateLimiter(None, deployment.redis_prefix, deployment.rate_limits, self.guard, self.metrics)
        self.admission = Admission(deployment.admission, self.metrics, {})
        self.gatekeeper = Gatekeeper(self.limiter, self.admission)
        # Issue 12: the learned router behind model "auto" (None: the interim rule of routing.py).
        self.learned_router = load_learned_router(deployment)
        # Issue 13: the routing policy in force (kept equal to Redis's current version) and budgets.
        self.policy = PolicyState(deployment, self.metrics, self.learned_router)
        self.budgets = BudgetReader(None, deployment.redis_prefix, self.guard, self.metrics)
        self._tasks: list[asyncio.Task] = []
        self._pubsub_redis: Any = None
        if dev_key:
            self.keys.preload(new_record(dev_key, DEV_TENANT, name="dev", role="admin"))

    def _to_ledger(self, record: UsageRecord) -> None:
        if self.ledger is not None:
            self.ledger(record)

    async def start_redis(self) -> None:
        import redis.asyncio as aioredis
        dep = self.deployment
        timeout = dep.redis_timeout_ms / 1000
        # A blocking pool with a bounded wait: a burst of calls queues for a connection instead of
        # failing with "too many connections". The guard admits at most redis_pool_size calls; the
        # extra connections serve what does not go through it (sessions, policy reads, the health ping).
        pool = aioredis.BlockingConnectionPool.from_url(
            dep.redis_url, max_connections=dep.redis_pool_size + POOL_RESERVE, timeout=dep.redis_pool_wait_ms / 1000,
            socket_connect_timeout=timeout, socket_timeout=timeout)
        self.redis = aioredis.Redis.from_pool(pool)
        # The subscription sits idle between events: no read timeout on its connection.
        self._pubsub_redis = aioredis.Redis.from_url(dep.redis_url, socket_connect_timeout=2, socket_timeout=None)
        self.keys.redis = self.redis
        self.sessions = SessionStore(self.redis, dep.redis_prefix, dep.web.dashboard.session_ttl_s)
        if dep.web.spend.enabled:
            self.ledger = SpendLedger(dep.redis_url, dep.redis_prefix, dep.web.spend, self.metrics)
            await self.ledger.start()      # replays what an earlier run left in the spool
        self.limiter = RateLimiter(self.redis, dep.redis_prefix, dep.rate_limits, self.guard, self.metrics)
        self.gatekeeper.limiter = self.limiter
        self.budgets.redis = self.redis
        await self.policy.start_redis(self.redis, self._pubsub_redis)
        if self.dev_key:
            try:   # the configured dev key becomes an admin key record (a revoked one stays revoked)
                await asyncio.to_thread(_ensure_dev_key, dep.redis_url, dep.redis_prefix, self.dev_key)
            except Exception as e:  # noqa: BLE001 - Redis down at start: the preloaded record serves
                log.warning("could not store the development key's record in redis: %s", e)
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._watch_redis()), loop.create_task(self.keys.listen(self._pubsub_redis))]

    async def stop_redis(self) -> None:
        await self.policy.stop()
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


def create_app(deployment: Deployment, *, handles: dict[str, EngineHandle] | None = None,
               usage_sink: UsageSink | None = None, dev_key: str | None = None) -> Starlette:
    """handles: engines already built (tests); otherwise the deployment's engines load at startup.
    dev_key (else auth.dev_key / TOKENYARD_DEV_KEY): an admin key for tenant "dev" that this
    gateway knows even before Redis answers."""
    gw = Gateway(deployment, handles, usage_sink, dev_key or deployment.auth.dev_key)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owns_engines = not gw.handles
        if owns_engines:
            gw.handles = await asyncio.to_thread(load_engines, deployment.engines)
        for h in gw.handles.values():
            await h.engine.start()
        gw.admission = Admission(deployment.admission, gw.metrics, {n: h.engine for n, h in gw.handles.items()})
        gw.gatekeeper.admission = gw.admission
        gw.metrics.admission = gw.admission.snapshot
        if deployment.redis_url:
            await gw.start_redis()
        else:
            gw.policy.start_local()
        # Everything loaded so far (torch, weights' Python objects) lives as long as the process:
        # freezing it keeps the cyclic GC from rescanning it, which shows up as latency spikes.
        gc.freeze()
        gw.ready = True
        try:
            yield
        finally:
            gw.ready = False
            await gw.admission.stop()
            await gw.stop_redis()
            for h in gw.handles.values():
                await h.engine.stop()
                # Engines this gateway built are released (tensor-parallel workers and their
                # process group); engines handed in by the caller stay the caller's to close.
                inner = getattr(h.engine, "engine", None)
                if owns_engines and callable(getattr(inner, "close", None)):
                    inner.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model}", _model, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        Route("/v1/spend/report", spend_report, methods=["GET"]),
        Route("/v1/spend/requests", spend_requests, methods=["GET"]),
    ]
    if deployment.web.dashboard.enabled:
        routes += dashboard.routes()
    routes += policy_routes.routes() + policy_page.routes()     # issue 13: admin API and operator page
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _unexpected}
    # AccessLog sits inside Starlette's error middleware but outside the exception handlers, so
    # it sees every API error's final status and stamps x-request-id on error responses too.
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(AccessLog, gateway=gw)])
    app.state.gateway = gw
    return app


def _model_entry(h: EngineHandle) -> dict[str, Any]:
    return {"id": h.name, "object": "model", "created": h.created, "owned_by": "tokenyard"}


async def _models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await gw.keys.authenticate(request.headers.get("authorization"))
    created = min((h.created for h in gw.handles.values()), default=int(time.time()))
    data = [{"id": AUTO, "object": "model", "created": created, "owned_by": "tokenyard"}]
    data += [_model_entry(h) for h in gw.handles.values()]
    return JSONResponse({"object": "list", "data": data})


async def _model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await gw.keys.authenticate(request.headers.get("authorization"))
    name = request.path_params["model"]
    route = gw.router.pinned(name)  # NotFound for unknown names
    if route is None:
        created = min((h.created for h in gw.handles.values()), default=int(time.time()))
        return JSONResponse({"id": AUTO, "object": "model", "created": created, "owned_by": "tokenyard"})
    return JSONResponse(_model_entry(gw.handles[route.engine]))


async def _health(request: Request) -> Response:
    # Liveness: answers from the event loop alone (no engine or Redis round trip), so it stays
    # fast while engines are saturated; Redis shows its last known state.
    gw: Gateway = request.app.state.gateway
    redis = "off" if gw.redis_ok is None and gw.redis is None else ("ok" if gw.redis_ok else "unreachable")
    engines = {n: ("down" if h.engine.dead else "ok") for n, h in gw.handles.items()}
    return JSONResponse({"status": "ok", "engines": engines, "redis": redis})


async def _ready(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    ok = gw.ready and not gw.draining and all(not h.engine.dead for h in gw.handles.values())
    body = {"ready": ok, "draining": gw.draining}
    return JSONResponse(body, status_code=200 if ok else 503)


async def _metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await check_metrics_access(gw, request)
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    gw: Gateway = request.app.state.gateway
    request.scope.setdefault("tokenyard", {})["error_code"] = exc.code
    if request.url.path == "/v1/chat/completions":
        gw.metrics.count_request("", exc.status, "")
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"Unknown path {request.url.path}", 405: f"Method {request.method} not allowed here"}
    err = error_for_status(exc.status_code, message.get(exc.status_code, str(exc.detail)))
    return err.response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return ServerError("Internal server error").response()
