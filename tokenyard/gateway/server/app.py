"""The Starlette app: `create_app(deployment)` builds one gateway over its engines.

State lives in one `Gateway` object (app.state.gateway) rather than in module globals, so a
test can run several apps in one process. Engines load in a worker thread at startup (the
lifespan), so the event loop is not blocked while weights are read.
"""
from __future__ import annotations

import asyncio
import atexit
import gc
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from tokenyard.gateway.backends.engine_pool import EngineHandle, load_engines
from tokenyard.gateway.batch import batch_routes, file_routes
from tokenyard.gateway.batch.batch_metrics import BatchCollector
from tokenyard.gateway.batch.service import BatchService
from tokenyard.gateway.config.deployment import Deployment
from tokenyard.gateway.edge.errors import APIError, ServerError, error_for_status
from tokenyard.gateway.edge.messages_errors import error_response, is_messages_path
from tokenyard.gateway.http import (
    chat_endpoint,
    completions_endpoint,
    embeddings_endpoint,
    feedback_endpoint,
    messages_endpoint,
    responses_endpoint,
)
from tokenyard.gateway.observability.access_log import AccessLog
from tokenyard.gateway.routes import adapter_admin, router_admin
from tokenyard.gateway.routes import policy_api as policy_routes
from tokenyard.gateway.routes import replica_api as replica_routes
from tokenyard.gateway.routes import spend_api as spend_routes
from tokenyard.gateway.server import service_routes
from tokenyard.gateway.spend.usage import UsageSink
from tokenyard.gateway.state import Gateway, gateway_of
from tokenyard.gateway.web import dashboard, favicon, policy_page

log = logging.getLogger("tokenyard.gateway")
atexit.register(gc.unfreeze)    # see gc.freeze() in the lifespan


def create_app(deployment: Deployment, *, handles: dict[str, EngineHandle] | None = None,
               usage_sink: UsageSink | None = None, dev_key: str | None = None) -> Starlette:
    """handles: engines already built (tests); otherwise the deployment's engines load at startup.
    dev_key (else auth.dev_key / TOKENYARD_DEV_KEY): an admin key for tenant "dev" that this
    gateway knows even before Redis answers."""
    gw = Gateway(deployment, handles, usage_sink, dev_key or deployment.auth.dev_key)
    if gw.redis is not None and deployment.batch.enabled:
        gw.batch = BatchService(gw, deployment.redis_url, deployment.redis_prefix, deployment.batch)
        gw.metrics.registry.register(BatchCollector(gw.batch.runner))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owns_engines = not gw.handles
        if owns_engines:
            gw.attach_engines(await asyncio.to_thread(load_engines, deployment.engines, deployment.engine_process,
                                                       deployment.engine_sockets))
        else:
            gw.admission.add_engines({n: h.engine for n, h in gw.handles.items()})
        for h in gw.handles.values():
            if getattr(h.engine, "metrics", 0) is None:    # an upstream engine counts cooldowns here
                h.engine.metrics = gw.metrics
            await h.engine.start()
        if deployment.redis_url:
            await gw.start_redis()
            if gw.batch is not None:
                await gw.batch.start()      # resumes the batches a stopped gateway left running
        else:
            gw.policy.start_local()
        # Everything loaded so far (torch, weights' Python objects) lives as long as the process:
        # freezing it keeps the cyclic GC from rescanning it, which shows up as latency spikes.
        # Frozen objects are never collected, not even at interpreter exit: Triton's nanobind module
        # (imported by torch._dynamo) then finds its objects alive and prints ~30 lines of
        # "nanobind: leaked ..." at every stop. So they are unfrozen when the gateway stops, and at
        # exit (registered once, below the imports) for a process that never reaches the lifespan's end.
        gc.freeze()
        gw.ready = True
        try:
            yield
        finally:
            gw.ready = False
            if gw.batch is not None:
                await gw.batch.stop()       # lines in flight are cut; they run again on the next start
            await gw.admission.stop()
            await gw.stop_redis()
            for h in gw.handles.values():
                await h.engine.stop()
                # Engines this gateway built are released (tensor-parallel workers and their
                # process group); engines handed in by the caller stay the caller's to close.
                inner = getattr(h.engine, "engine", None)
                if owns_engines and callable(getattr(inner, "close", None)):
                    inner.close()
            gc.unfreeze()

    routes = chat_endpoint.routes() + completions_endpoint.routes() + embeddings_endpoint.routes()
    routes += messages_endpoint.routes()
    routes += responses_endpoint.routes() + feedback_endpoint.routes() + router_admin.routes()
    routes += service_routes.routes() + spend_routes.routes()
    if deployment.web.dashboard.enabled:
        routes += dashboard.routes()
    routes += policy_routes.routes() + replica_routes.routes() + adapter_admin.routes() + policy_page.routes()
    routes += file_routes.routes() + batch_routes.routes()
    routes += favicon.routes()
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _unexpected}
    # AccessLog sits inside Starlette's error middleware but outside the exception handlers, so
    # it sees every API error's final status and stamps x-request-id on error responses too.
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(AccessLog, gateway=gw)])
    app.state.gateway = gw
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    gw = gateway_of(request)
    request.scope.setdefault("tokenyard", {})["error_code"] = exc.code
    if request.url.path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        gw.metrics.count_request("", exc.status, "")
    return _respond(request, exc)


def _respond(request: Request, err: APIError) -> Response:
    """The error in the shape of the API the path belongs to (Anthropic's on the Messages API)."""
    return error_response(err) if is_messages_path(request.url.path) else err.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"Unknown path {request.url.path}", 405: f"Method {request.method} not allowed here"}
    err = error_for_status(exc.status_code, message.get(exc.status_code, str(exc.detail)))
    return _respond(request, err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return _respond(request, ServerError("Internal server error"))
