"""The admin API for an engine's replicas: their state, sleep and wake (admin keys only).

    GET  /admin/engines/{engine}/replicas                    every replica: index, label, state
                                                             (up, asleep, waking, down), sleep level
    POST /admin/engines/{engine}/replicas/{replica}/sleep    {"level": 1|2 (default 1), "drain_timeout_s": 30}
    POST /admin/engines/{engine}/replicas/{replica}/wake

{replica} is the replica's index in the engine's `replicas` list (0, 1, ...; as GET lists them) or
its label ("local" for the in-process one; an engine without `replicas` is one replica, "local" or 0).
sleep answers once the replica finished its requests and released the memory:
200 {"replica", "sleep_level", "sleep_state", "seconds"}; wake answers when it serves again, with
"seconds" and the phases the wake went through. Errors (OpenAI-shaped, each naming what is wrong):
404 `engine_not_found` / `replica_not_found`, 400 `invalid_sleep_level` (param `level`),
`invalid_drain_timeout`, `invalid_json`; 409 `replica_busy` (requests still in flight after the drain
timeout: it stays awake) or `sleep_not_supported`; 503 `replica_down` (unreachable, or it failed
while waking: its requests are retried on other replicas).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.gateway.backends.replica_pool import Replica
from tokenyard.gateway.backends.replica_sleep import ReplicaControlError, describe, replicas_of, sleep_replica, wake_replica
from tokenyard.gateway.edge.edge_params import json_int
from tokenyard.gateway.edge.errors import APIError, BadRequest, NotFound
from tokenyard.gateway.routes.policy_api import admin_key

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

MAX_BODY_BYTES = 4096
MAX_DRAIN_TIMEOUT_S = 3600.0


def routes() -> list[Route]:
    base = "/admin/engines/{engine}/replicas"
    return [Route(base, list_replicas, methods=["GET"]),
            Route(base + "/{replica}/sleep", sleep, methods=["POST"]),
            Route(base + "/{replica}/wake", wake, methods=["POST"])]


def _members(request: Request) -> tuple[str, list[Replica]]:
    gw: "Gateway" = request.app.state.gateway
    name = request.path_params["engine"]
    handle = gw.handles.get(name)
    if handle is None:
        raise NotFound(f"No engine named {name!r} (known: {', '.join(sorted(gw.handles))})", param="engine",
                       code="engine_not_found")
    return name, replicas_of(handle.engine)


def _one(request: Request) -> tuple[str, int, Replica]:
    name, members = _members(request)
    key = request.path_params["replica"]
    for i, r in enumerate(members):
        if key == str(i) or key == r.label:
            return name, i, r
    known = ", ".join(f"{i} ({r.label})" for i, r in enumerate(members))
    raise NotFound(f"Engine {name} has no replica {key!r} (known: {known})", param="replica",
                   code="replica_not_found")


async def list_replicas(request: Request) -> Response:
    await admin_key(request)
    name, members = _members(request)
    return JSONResponse({"engine": name, "replicas": [describe(i, r) for i, r in enumerate(members)]})


async def sleep(request: Request) -> Response:
    await admin_key(request)
    name, index, r = _one(request)
    body = await _body(request)
    timeout = body.get("drain_timeout_s", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_DRAIN_TIMEOUT_S:
        raise BadRequest(f"drain_timeout_s must be a number of seconds in [0, {MAX_DRAIN_TIMEOUT_S:g}], got "
                         f"{timeout!r}", param="drain_timeout_s", code="invalid_drain_timeout")
    try:
        result = await sleep_replica(r, body.get("level", 1), float(timeout))
    except ReplicaControlError as e:
        raise _api_error(e) from None
    return JSONResponse({"engine": name, "index": index, **result})


async def wake(request: Request) -> Response:
    await admin_key(request)
    name, index, r = _one(request)
    try:
        result = await wake_replica(r)
    except ReplicaControlError as e:
        raise _api_error(e) from None
    return JSONResponse({"engine": name, "index": index, **result})


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"Body exceeds {MAX_BODY_BYTES} bytes", code="invalid_json")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_int=json_int)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"Body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("Body must be a JSON object such as {\"level\": 1}", code="invalid_json")
    return body


def _api_error(e: ReplicaControlError) -> APIError:
    err = APIError(e.message, param=e.param, code=e.code)
    err.status = e.status
    err.type = {400: "invalid_request_error", 409: "invalid_request_error"}.get(e.status, "service_unavailable")
    return err
