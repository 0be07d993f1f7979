"""The service's own endpoints: the model list, liveness and readiness, metrics and the OpenAPI document.

    GET /v1/models, /v1/models/{model}   any valid key; "auto", every engine, every ENGINE:ADAPTER (LoRA)
    GET /health                          liveness, from the event loop alone
    GET /ready                           readiness: started, not draining, no engine down
    GET /metrics                         Prometheus text (who may read it: metrics_access.py)
    GET /openapi.json                    the API description
"""
from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.routing.interim_rule import AUTO
from tokenyard.gateway.server.metrics_access import check_metrics_access
from tokenyard.gateway.server.openapi import openapi_schema
from tokenyard.gateway.state import gateway_of


def routes() -> list[Route]:
    return [Route("/v1/models", _models, methods=["GET"]),
            Route("/v1/models/{model}", _model, methods=["GET"]),
            Route("/health", _health, methods=["GET"]),
            Route("/ready", _ready, methods=["GET"]),
            Route("/metrics", _metrics, methods=["GET"]),
            Route("/openapi.json", _openapi, methods=["GET"])]


def _model_entry(h: EngineHandle, adapter: str | None = None) -> dict[str, Any]:
    # max_model_len (as vLLM's model card has it): the longest prompt + max_tokens the engine takes.
    entry = {"id": h.name if adapter is None else f"{h.name}:{adapter}", "object": "model", "created": h.created,
             "owned_by": "tokenyard", "max_model_len": h.engine.max_model_len}
    if adapter is not None:   # a LoRA adapter on the engine's base (vLLM lists its adapters with their parent)
        entry["parent"] = h.name
    return entry


async def _models(request: Request) -> Response:
    gw = gateway_of(request)
    await gw.keys.authenticate(request.headers.get("authorization"))
    created = min((h.created for h in gw.handles.values()), default=int(time.time()))
    data = [{"id": AUTO, "object": "model", "created": created, "owned_by": "tokenyard"}]
    data += [_model_entry(h) for h in gw.handles.values()]
    data += [_model_entry(gw.handles[e], a) for e, a in gw.router.adapter_models() if e in gw.handles]
    return JSONResponse({"object": "list", "data": data})


async def _model(request: Request) -> Response:
    gw = gateway_of(request)
    await gw.keys.authenticate(request.headers.get("authorization"))
    name = request.path_params["model"]
    route = gw.router.pinned(name)  # NotFound for unknown names
    if route is None:
        created = min((h.created for h in gw.handles.values()), default=int(time.time()))
        return JSONResponse({"id": AUTO, "object": "model", "created": created, "owned_by": "tokenyard"})
    return JSONResponse(_model_entry(gw.handles[route.engine], route.lora))


async def _health(request: Request) -> Response:
    # Liveness: answers from the event loop alone (no engine or Redis round trip), so it stays
    # fast while engines are saturated; Redis shows its last known state.
    gw = gateway_of(request)
    redis = "off" if gw.redis_ok is None and gw.redis is None else ("ok" if gw.redis_ok else "unreachable")
    engines = {n: ("down" if h.engine.dead else "ok") for n, h in gw.handles.items()}
    return JSONResponse({"status": "ok", "engines": engines, "redis": redis})


async def _ready(request: Request) -> Response:
    gw = gateway_of(request)
    ok = gw.ready and not gw.draining and all(not h.engine.dead for h in gw.handles.values())
    body = {"ready": ok, "draining": gw.draining}
    return JSONResponse(body, status_code=200 if ok else 503)


async def _metrics(request: Request) -> Response:
    gw = gateway_of(request)
    await check_metrics_access(gw, request)
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())
